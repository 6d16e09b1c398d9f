"""The process mesh: named axes pp, dp, cp, tp (outermost to innermost) over the world.

Rank r sits at coordinates ``(pp, dp, cp, tp)`` of a row-major grid, so tp neighbours have
consecutive ranks (the fastest links, inside a node) and pp is the outermost axis. Groups are
built once by ``torch.distributed.device_mesh.init_device_mesh`` and handed around in one
:class:`Mesh` object: no global process groups. Expert parallelism (``ep``) is carved out of the
dp x cp ranks (Megatron-Core's layout) when it lands.

A one-process run gets a Mesh with every axis of size 1 and no process groups, so the same
code path serves the laptop and the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

AXES = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel axes; ``world_size`` is their product."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def problems(self, world_size: int | None = None) -> list[str]:
        """Layout errors, each naming the keys involved (empty when valid)."""
        out = [f"parallel.{a}={getattr(self, a)} must be >= 1" for a in (*AXES, "ep")
               if getattr(self, a) < 1]
        if out:
            return out
        if world_size is not None and world_size != self.world_size:
            out.append(
                f"parallel.pp * dp * cp * tp = {self.pp} * {self.dp} * {self.cp} * {self.tp} = "
                f"{self.world_size} does not match the world size {world_size}"
            )
        if (self.dp * self.cp) % self.ep:
            out.append(f"parallel.ep={self.ep} must divide parallel.dp * parallel.cp = "
                       f"{self.dp * self.cp}")
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on each axis (row-major, tp fastest)."""
        out, rest = {}, rank
        for axis in reversed(AXES):
            size = getattr(self, axis)
            out[axis] = rest % size
            rest //= size
        return {a: out[a] for a in AXES}


class Mesh:
    """This rank's place in the layout: sizes, coordinates and process groups per axis."""

    def __init__(self, dims: ParallelDims, device_type: str = "cpu") -> None:
        self.dims = dims
        self.device_type = device_type
        self.distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if self.distributed else 1
        problems = dims.problems(world)
        if problems:
            raise ValueError("; ".join(problems))
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = world
        self.device_mesh = None
        self._groups: dict[str, dist.ProcessGroup | None] = {a: None for a in AXES}
        if self.distributed:
            from torch.distributed.device_mesh import init_device_mesh

            shape = tuple(getattr(dims, a) for a in AXES)
            self.device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
            for axis in AXES:
                self._groups[axis] = self.device_mesh.get_group(axis)
            self._groups["world"] = dist.group.WORLD
            self._groups["embed"] = self._embedding_group() if dims.pp > 1 else None
        self.coords = dims.coords(self.rank)

    def _embedding_group(self) -> dist.ProcessGroup | None:
        """First and last pipeline stage of this rank's (dp, cp, tp) coordinate.

        They hold the two copies of tied input/output embeddings (Megatron's embedding group).
        Every rank creates every group, in the same order, as ``new_group`` requires.
        """
        mine = None
        pp_groups = self.device_mesh.mesh.reshape(self.dims.pp, -1)  # (pp, dp*cp*tp) ranks
        for column in range(pp_groups.shape[1]):
            ranks = [int(pp_groups[0, column]), int(pp_groups[-1, column])]
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def size(self, axis: str) -> int:
        if axis == "embed":
            return 2 if self._groups.get("embed") is not None else 1
        return self.world_size if axis == "world" else getattr(self.dims, axis)

    def local_rank(self, axis: str) -> int:
        """This rank's index along ``axis``."""
        if axis == "embed":
            return 0 if self.coords["pp"] == 0 else 1
        return self.rank if axis == "world" else self.coords[axis]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """Process group of ``axis`` (None on a one-process run)."""
        return self._groups.get(axis)

    @property
    def is_logging_rank(self) -> bool:
        """Rank 0 prints and writes the run's files."""
        return self.rank == 0

    def describe(self) -> str:
        d = self.dims
        return (f"world {self.world_size} (pp={d.pp} dp={d.dp} cp={d.cp} tp={d.tp}"
                + (f" ep={d.ep}" if d.ep > 1 else "") + ")")

    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
