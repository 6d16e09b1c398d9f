"""The process mesh: a :class:`~meshlm.layout.Layout`'s axes pp, dp, cp, tp over the world.

Every axis is declared once, in :data:`AXIS_DEFS`, as the grid dimensions (:data:`DIMS`) its
groups span; sizes, ranks and the rank sets of every group -- flattened ones such as ``dp_cp``
and the expert groups included -- are derived from that table (:meth:`Mesh.rank_sets`).

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

Hybrid sharding (``parallel.dp_shard`` < dp): dp is the grid dimensions ``dp_rep x dp_shard``
(shard groups of consecutive dp ranks, replicated ``dp_rep`` times). ZeRO shards over
``dp_shard`` (``dp_shard_cp`` with cp, ``edp_shard`` for experts: :meth:`Mesh.shard_axis`) and
reduces each gradient shard across ``dp_rep`` (:meth:`Mesh.replica_axis`); without it
``dp_shard`` is the dp group itself and ``dp_rep`` has none.

A one-process run gets a Mesh with every axis of size 1 and no process groups, so the same
code path serves the laptop and the cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..layout import AXES, CONFIG_KEYS, Layout

# The rank grid's dimensions, outermost first. dp is split into replicas x shard groups
# (hybrid sharding, ``parallel.dp_shard``; without it dp_rep = 1 and dp_shard = dp), so a
# shard group holds consecutive dp ranks -- inside a node -- and its replicas sit across nodes.
DIMS = ("island", "pp", "dp_rep", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class AxisDef:
    """A mesh axis: the grid dimensions its groups span (its rank is row-major over them, the
    last fastest). ``ep``: an expert axis carved out of those ranks -- "inner" keeps ``ep``
    consecutive ones (the ep peers), "outer" every ``ep``-th (the copies of one expert)."""

    dims: tuple[str, ...]
    ep: str = ""


# Every axis a group, a shard spec or a collective can name: declared once, here. Adding an
# axis is adding an entry (and, for a new grid dimension, a DIMS entry and its size).
_DP_CP = ("dp_rep", "dp_shard", "cp")
AXIS_DEFS: dict[str, AxisDef] = {
    "world": AxisDef(DIMS),
    "island": AxisDef(("island",)),
    "inner": AxisDef(DIMS[1:]),
    "pp": AxisDef(("pp",)),
    "dp": AxisDef(("dp_rep", "dp_shard")),
    "cp": AxisDef(("cp",)),
    "tp": AxisDef(("tp",)),
    "dp_cp": AxisDef(_DP_CP),  # weights replicated on dp and cp: reduced (and ZeRO-sharded) here
    "ep": AxisDef(_DP_CP, ep="inner"),
    "edp": AxisDef(_DP_CP, ep="outer"),
    "dp_rep": AxisDef(("dp_rep",)),  # hybrid sharding: the replicas of a shard group
    "dp_shard": AxisDef(("dp_shard",)),
    "dp_shard_cp": AxisDef(("dp_shard", "cp")),
    "edp_shard": AxisDef(("dp_shard", "cp"), ep="outer"),
}
# The order groups are made in (the same on every rank; the plain axes come from the device
# mesh, "embed" -- the first and last pipeline stages -- is built apart, see Mesh._build_groups).
DERIVED = ("dp_cp", "ep", "edp")
# An axis ZeRO shards over under hybrid sharding -> (its replica axis, its shard axis); the
# hybrid axes get groups of their own only under hybrid sharding (else a shard axis is its
# whole axis, and dp_rep has size 1)
HYBRID: dict[str, tuple[str, str]] = {"dp": ("dp_rep", "dp_shard"),
                                      "dp_cp": ("dp_rep", "dp_shard_cp"),
                                      "edp": ("dp_rep", "edp_shard")}
HYBRID_AXES = ("dp_rep", "dp_shard", "dp_shard_cp", "edp_shard")
# Composite axes (several plain axes in one group) and the expert sub-axes, by name
COMPOSITE: dict[str, tuple[str, ...]] = {"dp_cp": ("dp", "cp"), "dp_shard_cp": ("dp_shard", "cp")}
EXPERT_AXES = tuple(a for a, d in AXIS_DEFS.items() if d.ep)
AXIS_NAMES = (*AXIS_DEFS, "embed")


def axis_parts(axis: str) -> tuple[str, ...]:
    """The plain axes an axis name stands for (itself unless composite)."""
    return COMPOSITE.get(axis, (axis,))


def covered_dims(axis: str) -> set[str]:
    """Grid dimensions whose copies a sum over ``axis`` meets (expert axes: all of dp x cp,
    as an expert's copies sit on the dp x cp ranks of one ep rank; "embed": the pipeline)."""
    if axis == "embed":
        return {"pp"}
    return set(AXIS_DEFS[axis].dims)


def without_sharded(replicated: tuple[str, ...], axis: str) -> tuple[str, ...]:
    """The axes still holding identical copies once a tensor is sharded over ``axis``: its
    parts go, and an axis it is only a part of (dp, when sharded over dp_shard under hybrid
    sharding) leaves its replica axis (dp_rep) behind."""
    parts = set(axis_parts(axis))
    out: list[str] = []
    for a in replicated:
        if a in parts:
            continue
        rep, shard = HYBRID.get(a, ("", ""))
        out.append(rep if shard and set(axis_parts(shard)) & parts else a)
    return tuple(dict.fromkeys(out))


def _key(ranks: list[int]) -> tuple[int, ...]:
    return tuple(sorted(ranks))


def _set_timeout(group: dist.ProcessGroup, seconds: float) -> None:
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds), group)


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
        self._embed_built = False  # (build_embed_group, made after construction)
        self._timeout_s: float | None = None  # the last set_timeout (a later group gets it)
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
        shared with no derived group, and the embedding group (:meth:`build_embed_group`) gets
        its own. The tied embedding's gradient all-reduce runs while pp transfers are in
        flight, and in another order on the first stage (after its last receive) than on the
        last (before its last send); a communicator runs its operations in the order issued,
        so one communicator for both would deadlock (NCCL; gloo too)."""
        maker = GroupMaker(self.rank, can_split(device_type))
        maker.register([list(range(self.world_size))], dist.group.WORLD)
        self._groups["world"] = dist.group.WORLD
        self._build_device_mesh(device_type, maker)
        self._groups["inner"] = (maker.partition(self.rank_sets("inner")) if self.islands > 1
                                 else dist.group.WORLD)
        self._maker = maker  # (the embedding group is made later, where it is needed)
        hybrid = HYBRID_AXES if self.layout.hybrid else ()
        for axis in (*DERIVED, *hybrid):  # (one partition each, the same order on every rank)
            self._groups[axis] = maker.partition(self.rank_sets(axis))

    def build_embed_group(self) -> None:
        """The "embed" groups: the first and the last pipeline rank of each (dp, cp, tp)
        coordinate, a communicator of their own. Collective: every rank calls it, at the same
        point, when the model keeps an embedding table on both pipeline ends (a tied head, or
        a training head's lookups); a model without one gets none, so it costs no
        communicator (and no idle gloo threads waking with the others). Again: a no-op."""
        if self._embed_built or not self.distributed or self.layout.pp == 1:
            return
        d = self.layout
        group = self._groups["embed"] = self._maker.partition(
            [[int(g[0, c]), int(g[-1, c])] for g in (i.reshape(d.pp, -1)
                                                      for i in self._islands_grids())
             for c in range(g.shape[1])], share=False)
        self._embed_built = True
        if group is not None and self._timeout_s is not None:  # (the others' timeout)
            _set_timeout(group, self._timeout_s)

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

    def dim_sizes(self) -> dict[str, int]:
        """The size of every grid dimension (:data:`DIMS`)."""
        d = self.layout
        return {"island": self.islands, "pp": d.pp, "dp_rep": d.dp_rep,
                "dp_shard": d.shard_size, "cp": d.cp, "tp": d.tp}

    def rank_sets(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` as its world ranks (in the axis's rank order): the grid
        with the axis's dimensions moved last, one row per coordinate of the others."""
        spec, sizes = AXIS_DEFS[axis], self.dim_sizes()
        grid = torch.arange(self.world_size).reshape(tuple(sizes[x] for x in DIMS))
        span = [DIMS.index(x) for x in spec.dims]
        rest = [i for i in range(len(DIMS)) if i not in span]
        rows = grid.permute(*rest, *span).reshape(-1, math.prod(sizes[x] for x in spec.dims))
        ep = self.layout.ep
        if spec.ep == "inner":
            return rows.reshape(-1, ep).tolist()
        if spec.ep == "outer":
            return rows.reshape(rows.shape[0], -1, ep).transpose(1, 2).reshape(-1, rows.shape[1] // ep).tolist()
        return rows.tolist()

    def dim_coords(self) -> dict[str, int]:
        """This rank's coordinate on every grid dimension."""
        shard = self.layout.shard_size
        return {"island": self.island, "pp": self.coords["pp"],
                "dp_rep": self.coords["dp"] // shard, "dp_shard": self.coords["dp"] % shard,
                "cp": self.coords["cp"], "tp": self.coords["tp"]}

    def shard_axis(self, axis: str) -> str:
        """The axis ZeRO shards a group reduced over ``axis`` across: ``axis`` itself, or its
        shard part under hybrid sharding (dp -> dp_shard, dp_cp -> dp_shard_cp, edp ->
        edp_shard)."""
        return HYBRID[axis][1] if self.layout.hybrid and axis in HYBRID else axis

    def replica_axis(self, axis: str) -> str | None:
        """Under hybrid sharding, the axis across which the shards of a group reduced over
        ``axis`` are replicated (dp_rep); None otherwise."""
        return HYBRID[axis][0] if self.layout.hybrid and axis in HYBRID else None

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
        self._timeout_s = seconds
        seen: set[int] = set()
        for group in [dist.group.WORLD, *self._groups.values()]:
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                _set_timeout(group, seconds)

    def size(self, axis: str) -> int:
        if axis == "embed":
            return 2 if self._groups.get("embed") is not None else 1
        spec, sizes = AXIS_DEFS[axis], self.dim_sizes()
        n = 1
        for x in spec.dims:  # (a plain loop: compiled tp regions trace this call)
            n *= sizes[x]
        return n if not spec.ep else (self.layout.ep if spec.ep == "inner"
                                      else n // self.layout.ep)

    def local_rank(self, axis: str) -> int:
        """This rank's index along ``axis`` (row-major over its dimensions)."""
        if axis == "embed":
            return 0 if self.coords["pp"] == 0 else 1
        spec, sizes, coords = AXIS_DEFS[axis], self.dim_sizes(), self.dim_coords()
        rank = 0
        for x in spec.dims:
            rank = rank * sizes[x] + coords[x]
        if not spec.ep:
            return rank
        return rank % self.layout.ep if spec.ep == "inner" else rank // self.layout.ep

    def grad_divisor(self, axis: str) -> int:
        """What gradients summed over ``axis`` are divided by to become the global mean:
        the axis size, except for expert weights (``edp``): the whole dp x cp size."""
        return self.size("dp_cp") if axis in ("edp", "edp_shard") else self.size(axis)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """Process group of ``axis`` (None on a one-process run, or for a size-1 axis); a
        hybrid axis without hybrid sharding is its whole axis (dp_shard: dp, ...)."""
        if axis not in self._groups and axis in HYBRID_AXES:
            whole = {shard: a for a, (_, shard) in HYBRID.items()}
            return self._groups.get(whole[axis]) if axis in whole else None
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
                + (f" dp_shard={d.shard_size}" if d.hybrid else "")
                + (f" ep={d.ep}" if d.ep > 1 else "") + ")")

    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
