"""The process mesh: a :class:`~meshlm.layout.Layout`'s axes pp, dp, cp, tp over the world.

Rank r sits at coordinates ``(pp, dp, cp, tp)`` of a row-major grid, so tp neighbours have
consecutive ranks (the fastest links, inside a node) and pp is the outermost axis. Groups are
built once -- the axes of size > 1 by ``torch.distributed.device_mesh.init_device_mesh``, the
derived ones below by :class:`GroupMaker` -- and handed around in one :class:`Mesh` object: no
global process groups. Each distinct set of ranks is one group object, hence one communicator
(``dp_cp`` is the world when pp = tp = 1, ``ep`` the cp group when ep = cp, ...), except that
the pp and embedding groups are shared with no other (:meth:`Mesh._build_groups`), and an axis
of size 1 has none. On NCCL with a bound device every group is split from the default
communicator (ncclCommSplit), each derived partition in one call (GPU-only). Expert parallelism (``ep``) is carved out of the
dp x cp ranks (Megatron-Core's layout): the ``ep`` group is ``ep`` consecutive ranks of
the ``dp_cp`` group (index ``i`` of dp_cp sits at ep rank ``i % ep``), and the expert-data-parallel
group ``edp`` joins the ranks with the same ep rank (the ``dp_cp / ep`` copies of each expert).
Expert gradients are summed over ``edp`` and divided by the whole dp x cp size
(:meth:`Mesh.grad_divisor`): each copy's gradient already sums the tokens of its ``ep`` peers.

Composite axes (:data:`COMPOSITE`) join several axes into one group: ``dp_cp`` is every rank
of this rank's (pp, tp) coordinate, over which the gradients of weights replicated on dp and cp
are reduced (and ZeRO shards them) when context parallelism is on, as in Megatron-Core. It is
the dp group itself when cp = 1 and the cp group when dp = 1 (the same object).

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


def _key(ranks: list[int]) -> tuple[int, ...]:
    return tuple(sorted(ranks))


def can_split(device_type: str) -> bool:
    """Whether process groups can be split from the default communicator in one call per
    partition (``dist.split_group``, ncclCommSplit): NCCL with a device bound to the default
    group, as ``launch.init_worker`` binds it. GPU-only; gloo cannot."""
    if device_type != "cuda" or dist.get_backend() != "nccl":
        return False
    return getattr(dist.group.WORLD, "bound_device_id", None) is not None  # GPU-only path


class GroupMaker:
    """Process groups by rank set: one group, hence one communicator, per distinct set of ranks.

    Every rank asks for every partition in the same order (as ``new_group`` requires); a set
    made before and registered as shared -- the world, an axis of the device mesh, another
    partition -- is handed out again instead of a second communicator over the same ranks. A
    set of one rank gets no group (None). A partition asked for with ``share=False`` gets
    groups of its own, shared with nothing (see :meth:`Mesh._build_groups`). With
    :func:`can_split` a partition is one ``dist.split_group`` call, one ncclCommSplit of the
    default communicator for all of its sets (GPU-only path, untested on the CPU machines
    meshlm's tests run on); otherwise one ``new_group`` per set.
    """

    def __init__(self, rank: int, split: bool = False) -> None:
        self.rank, self.split = rank, split
        self.known: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.made = 0  # rank sets this object turned into new groups

    def register(self, sets: list[list[int]], mine: dist.ProcessGroup | None) -> None:
        """Groups made elsewhere, to share: ``mine`` is this rank's among ``sets``."""
        for ranks in sets:
            self.known.setdefault(_key(ranks), mine if self.rank in ranks else None)

    def partition(self, sets: list[list[int]], share: bool = True) -> dist.ProcessGroup | None:
        """This rank's group among the disjoint rank ``sets`` (the same list on every rank);
        None when it is in none of them or alone in its set. ``share``: reuse known groups of
        the same ranks and offer these to later partitions."""
        keys = list(dict.fromkeys(_key(r) for r in sets if len(r) > 1))
        new = [k for k in keys if k not in self.known] if share else keys
        made = self._make([list(k) for k in new]) if new else {}
        if share:
            self.known.update(made)
        mine = next((k for k in keys if self.rank in k), None)
        if mine is None:
            return None
        return self.known[mine] if share else made[mine]

    def _make(self, sets: list[list[int]]) -> dict[tuple[int, ...], dist.ProcessGroup | None]:
        if self.split:  # GPU-only path: one ncclCommSplit for the whole partition
            group = dist.split_group(split_ranks=sets)
            groups = [group if self.rank in ranks else None for ranks in sets]
        else:
            groups = [dist.new_group(ranks) for ranks in sets]
        self.made += len(sets)
        return {_key(ranks): group if self.rank in ranks else None
                for ranks, group in zip(sets, groups, strict=True)}


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
            self._build_groups(device_type)
        self.coords = layout.coords(self.rank)
        if self.islands > 1:
            self.coords = {"island": self.island, **self.coords}

    def _build_groups(self, device_type: str) -> None:
        """Every axis's group, one per distinct rank set (:class:`GroupMaker`): the device mesh
        over the axes of size > 1, then the derived groups, which reuse those they equal.

        Except around the pipeline: the pp group carries its point-to-point transfers and is
        shared with no derived group, and the embedding group gets its own. The tied
        embedding's gradient all-reduce runs while pp transfers are in flight, and in another
        order on the first stage (after its last receive) than on the last (before its last
        send); a communicator runs its operations in the order issued, so one communicator
        for both would deadlock (NCCL; gloo too)."""
        maker = GroupMaker(self.rank, can_split(device_type))
        maker.register([list(range(self.world_size))], dist.group.WORLD)
        self._groups["world"] = dist.group.WORLD
        self._build_device_mesh(device_type, maker)
        grids = self._islands_grids()
        d = self.layout
        self._groups["inner"] = maker.partition(
            [g.reshape(-1).tolist() for g in grids]) if self.islands > 1 else dist.group.WORLD
        self._groups["embed"] = maker.partition(
            [[int(g[0, c]), int(g[-1, c])] for g in (i.reshape(d.pp, -1) for i in grids)
             for c in range(g.shape[1])], share=False) if d.pp > 1 else None
        columns = [col.tolist() for i in grids
                   for col in i.reshape(d.pp, d.dp * d.cp, d.tp).permute(0, 2, 1)
                   .reshape(-1, d.dp * d.cp)]  # every (pp, tp) coordinate's dp x cp ranks
        self._groups["dp_cp"] = maker.partition(columns)
        self._groups["ep"] = maker.partition([c[i:i + d.ep] for c in columns
                                              for i in range(0, len(c), d.ep)])
        self._groups["edp"] = maker.partition([c[j::d.ep] for c in columns for j in range(d.ep)])

    def _build_device_mesh(self, device_type: str, maker: GroupMaker) -> None:
        """torch's DeviceMesh over the axes of size > 1 (none for a size-1 axis: a group of
        one rank would be a communicator of its own); its groups registered with ``maker``."""
        from torch.distributed.device_mesh import init_device_mesh

        names = (("island",) if self.islands > 1 else ()) + AXES
        sizes = {a: self.islands if a == "island" else getattr(self.layout, a) for a in names}
        used = tuple(a for a in names if sizes[a] > 1)
        if not used:
            return
        self.device_mesh = init_device_mesh(device_type, tuple(sizes[a] for a in used),
                                            mesh_dim_names=used)
        grid = torch.arange(self.world_size).reshape(tuple(sizes[a] for a in used))
        for dim, axis in enumerate(used):
            mine = self.device_mesh.get_group(axis)
            if axis != "pp":  # (pp: point-to-point only, see _build_groups)
                maker.register(grid.movedim(dim, -1).reshape(-1, sizes[axis]).tolist(), mine)
            self._groups[axis] = mine

    def _islands_grids(self) -> torch.Tensor:
        """The rank grid (pp, dp, cp, tp) of each island, in island order (row-major ranks)."""
        d = self.layout
        return torch.arange(self.world_size).reshape(self.islands, d.pp, d.dp, d.cp, d.tp)

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
