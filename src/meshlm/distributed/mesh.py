"""The process mesh: a :class:`~meshlm.layout.Layout`'s axes pp, dp, cp, tp over the world.

Rank r sits at coordinates ``(pp, dp, cp, tp)`` of a row-major grid, so tp neighbours have
consecutive ranks (the fastest links, inside a node) and pp is the outermost axis. Groups are
built once by ``torch.distributed.device_mesh.init_device_mesh`` and handed around in one
:class:`Mesh` object: no global process groups. Expert parallelism (``ep``) is carved out of the
dp x cp ranks (Megatron-Core's layout): the ``ep`` group is ``ep`` consecutive ranks of
the ``dp_cp`` group (index ``i`` of dp_cp sits at ep rank ``i % ep``), and the expert-data-parallel
group ``edp`` joins the ranks with the same ep rank (the ``dp_cp / ep`` copies of each expert).
Expert gradients are summed over ``edp`` and divided by the whole dp x cp size
(:meth:`Mesh.grad_divisor`): each copy's gradient already sums the tokens of its ``ep`` peers.

Composite axes (:data:`COMPOSITE`) join several axes into one group: ``dp_cp`` is every rank
of this rank's (pp, tp) coordinate, over which the gradients of weights replicated on dp and cp
are reduced (and ZeRO shards them) when context parallelism is on, as in Megatron-Core. It is
the dp group itself when cp = 1 (no extra group is made) and the cp group when dp = 1.

Islands (DiLoCo, ``parallel.islands`` = K > 1): an outermost axis ``island`` in front of pp,
so island k holds the consecutive ranks ``[k n, (k + 1) n)`` of n = pp dp cp tp each, every one
a whole copy of the inner mesh. The ``island`` group joins the ranks at the same inner
coordinates in every island -- the holders of the same shard -- and ``inner`` is this rank's
island (the whole world when K = 1): per-step agreements (overflow, non-finite flags, metrics)
run over ``inner``, so islands exchange nothing between synchronisations.

A one-process run gets a Mesh with every axis of size 1 and no process groups, so the same
code path serves the laptop and the cluster.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..layout import AXES, CONFIG_KEYS, Layout

# A composite axis -> the axes it joins (its rank: row-major over them, the last fastest).
COMPOSITE: dict[str, tuple[str, ...]] = {"dp_cp": ("dp", "cp")}
# Sub-axes of dp_cp (expert parallelism): the ep peers and the expert-data-parallel copies.
EXPERT_AXES = ("ep", "edp")


def axis_parts(axis: str) -> tuple[str, ...]:
    """The plain axes an axis name stands for (itself unless composite)."""
    return COMPOSITE.get(axis, (axis,))


class Mesh:
    """This rank's place in the layout: sizes, coordinates and process groups per axis."""

    def __init__(self, layout: Layout, device_type: str = "cpu") -> None:
        self.layout = layout
        self.device_type = device_type
        self.distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if self.distributed else 1
        problems = layout.problems(world=world, keys=CONFIG_KEYS)
        if problems:
            raise ValueError("; ".join(problems))
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = world
        self.device_mesh = None
        self._groups: dict[str, dist.ProcessGroup | None] = {a: None for a in AXES}
        self.islands = layout.islands
        self.island = self.rank // layout.inner_size
        if self.distributed:
            from torch.distributed.device_mesh import init_device_mesh

            names = (("island",) if self.islands > 1 else ()) + AXES
            shape = tuple(getattr(layout, "islands" if a == "island" else a) for a in names)
            self.device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
            for axis in names:
                self._groups[axis] = self.device_mesh.get_group(axis)
            self._groups["world"] = dist.group.WORLD
            self._groups["inner"] = self._inner_group()
            self._groups["embed"] = self._embedding_group() if layout.pp > 1 else None
            self._groups["dp_cp"] = self._data_context_group()
            self._groups.update(self._expert_groups())
        self.coords = layout.coords(self.rank)
        if self.islands > 1:
            self.coords = {"island": self.island, **self.coords}

    def _inner_group(self) -> dist.ProcessGroup | None:
        """This rank's island (the world group when there is one island)."""
        if self.islands == 1:
            return dist.group.WORLD
        n, mine = self.layout.inner_size, None
        for k in range(self.islands):
            ranks = list(range(k * n, (k + 1) * n))
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def _islands_grids(self):  # noqa: ANN202
        """The rank grid (pp, dp, cp, tp) of each island, in island order."""
        d = self.layout
        return self.device_mesh.mesh.reshape(self.islands, d.pp, d.dp, d.cp, d.tp)

    def _data_context_group(self) -> dist.ProcessGroup | None:
        """The dp x cp ranks of this rank's (pp, tp) coordinate (the dp or cp group when the
        other axis has size 1)."""
        d = self.layout
        if d.cp == 1 or d.dp == 1:
            return self._groups["dp" if d.cp == 1 else "cp"]
        mine = None
        for island in self._islands_grids():
            grid = island.reshape(d.pp, d.dp * d.cp, d.tp)
            for pp in range(d.pp):
                for tp in range(d.tp):
                    ranks = [int(r) for r in grid[pp, :, tp]]
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        mine = group
        return mine

    def _expert_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """This rank's ``ep`` group (``ep`` consecutive dp_cp ranks) and ``edp`` group (the
        dp_cp ranks with its ep rank); None for a group of one rank."""
        d = self.layout
        n, ep = d.dp * d.cp, d.ep
        if ep == 1:
            return {"ep": None, "edp": self._groups["dp_cp"]}
        if ep == n:
            return {"ep": self._groups["dp_cp"], "edp": None}
        mine: dict[str, dist.ProcessGroup | None] = {}
        for island in self._islands_grids():
            grid = island.reshape(d.pp, n, d.tp)
            for pp in range(d.pp):
                for tp in range(d.tp):
                    column = [int(r) for r in grid[pp, :, tp]]
                    sets = {"ep": [column[i:i + ep] for i in range(0, n, ep)],
                            "edp": [column[j::ep] for j in range(ep)]}
                    for axis, rank_sets in sets.items():
                        for ranks in rank_sets:
                            group = dist.new_group(ranks)
                            if self.rank in ranks:
                                mine[axis] = group
        return mine

    def _embedding_group(self) -> dist.ProcessGroup | None:
        """First and last pipeline stage of this rank's (dp, cp, tp) coordinate.

        They hold the two copies of tied input/output embeddings (Megatron's embedding group).
        Every rank creates every group, in the same order, as ``new_group`` requires.
        """
        mine = None
        for island in self._islands_grids():
            pp_groups = island.reshape(self.layout.pp, -1)  # (pp, dp*cp*tp) ranks
            for column in range(pp_groups.shape[1]):
                ranks = [int(pp_groups[0, column]), int(pp_groups[-1, column])]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    mine = group
        return mine

    def group_ranks(self) -> dict[str, list[int]]:
        """World ranks of this rank's group on every axis of size > 1 (flight recorder)."""
        out: dict[str, list[int]] = {}
        for axis, group in self._groups.items():
            if group is not None:
                out[axis] = [int(r) for r in dist.get_process_group_ranks(group)]
        return out

    def set_timeout(self, seconds: float) -> None:
        """How long every collective of this rank's groups waits for its peers from now on."""
        if not self.distributed:
            return
        from datetime import timedelta

        from torch.distributed.distributed_c10d import _set_pg_timeout

        seen: set[int] = set()
        for group in [dist.group.WORLD, *self._groups.values()]:
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                _set_pg_timeout(timedelta(seconds=seconds), group)

    def size(self, axis: str) -> int:
        if axis == "embed":
            return 2 if self._groups.get("embed") is not None else 1
        if axis in COMPOSITE:
            return math.prod(getattr(self.layout, a) for a in COMPOSITE[axis])
        if axis == "edp":
            return self.layout.dp * self.layout.cp // self.layout.ep
        if axis == "island":
            return self.islands
        if axis == "inner":
            return self.layout.inner_size
        return self.world_size if axis == "world" else getattr(self.layout, axis)

    def local_rank(self, axis: str) -> int:
        """This rank's index along ``axis``."""
        if axis == "embed":
            return 0 if self.coords["pp"] == 0 else 1
        if axis in COMPOSITE:
            rank = 0
            for a in COMPOSITE[axis]:
                rank = rank * getattr(self.layout, a) + self.coords[a]
            return rank
        if axis in EXPERT_AXES:
            i = self.local_rank("dp_cp")
            return i % self.layout.ep if axis == "ep" else i // self.layout.ep
        if axis == "island":
            return self.island
        if axis == "inner":
            return self.rank % self.layout.inner_size
        return self.rank if axis == "world" else self.coords[axis]

    def grad_divisor(self, axis: str) -> int:
        """What gradients summed over ``axis`` are divided by to become the global mean:
        the axis size, except for expert weights (``edp``): the whole dp x cp size."""
        return self.size("dp_cp") if axis == "edp" else self.size(axis)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """Process group of ``axis`` (None on a one-process run)."""
        return self._groups.get(axis)

    @property
    def is_logging_rank(self) -> bool:
        """Rank 0 prints and writes the run's files."""
        return self.rank == 0

    def describe(self) -> str:
        d = self.layout
        return (f"world {self.world_size} ("
                + (f"islands={self.islands} x " if self.islands > 1 else "")
                + f"pp={d.pp} dp={d.dp} cp={d.cp} tp={d.tp}"
                + (f" ep={d.ep}" if d.ep > 1 else "") + ")")

    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
