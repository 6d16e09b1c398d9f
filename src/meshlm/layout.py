"""The single description of a parallel layout, and the one place its rules live.

A :class:`Layout` is one point of the 5D space: ``pp x dp x cp x tp`` ranks (``ep`` carved out
of ``dp x cp``, Megatron-Core's layout), sequence parallelism, a ZeRO stage, the pipeline
schedule with its virtual stages and layer split, the micro-batch size, activation
recomputation, tensor-parallel overlap and where the optimizer states live (offload). The
config (:meth:`meshlm.config.Config.layout`), the process mesh
(:class:`meshlm.distributed.mesh.Mesh`) and the planner all use it.

:meth:`Layout.problems` checks it against a model, a sequence length, a global batch and a
world; its messages name the keys the caller speaks of (:data:`CONFIG_KEYS`: the config
file's ``parallel.tp``, ``model.n_heads``, ...; :data:`SHORT_KEYS`: the planner's ``tp``,
``n_heads``, ``mbs``, ...). :func:`partition_layers` is the one split of layers into pipeline
stages, :func:`schedule_problems` the rules of the pipeline schedules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .models.config import ModelConfig

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost: rank = row-major index, tp fastest
SCHEDULES = ("afab", "1f1b", "interleaved", "zb", "zbv", "dualpipev", "bfs", "interleaved-zb")
# Pipeline schedules by placement (parallel/schedules.py, stage_rank): two chunks per rank in a
# V (rank r: stages r and 2p - 1 - r), and v >= 2 chunks per rank round robin (rank r: stages
# r, r + p, ...); the others run one stage per rank
V_SCHEDULES = ("zbv", "dualpipev")
LOOPED_SCHEDULES = ("interleaved", "bfs", "interleaved-zb")
CP_MODES = ("zigzag", "ring", "ulysses")  # context-parallel attention (parallel/context.py)
RECOMPUTE = ("none", "selective", "op", "full")  # least to most recomputation
OFFLOADS = ("none", "cpu", "disk")  # where AdamW moments live (parallel/offload.py)
ZERO_STAGES = (0, 1, 2, 3)  # 0: none (DDP); 1: optimizer states; 2: + gradients; 3: + weights

_MODEL_KEYS = ("n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "moe_ffn_hidden")
# Layout fields that are keys of the config's [parallel] section (the rest: see CONFIG_KEYS).
PARALLEL_KEYS = ("pp", "dp", "cp", "tp", "ep", "sp", "zero", "pp_schedule", "pp_virtual",
                 "pp_layers", "cp_attention", "offload", "islands", "dp_shard")
CONFIG_KEYS: Mapping[str, str] = {
    **{k: f"parallel.{k}" for k in PARALLEL_KEYS}, "micro_batch": "train.micro_batch",
    "global_batch": "train.global_batch", "seq_len": "data.seq_len",
    "recompute": "train.recompute",
    **{k: f"model.{k}" for k in _MODEL_KEYS},
}
SHORT_KEYS: Mapping[str, str] = {"micro_batch": "mbs", "pp_schedule": "schedule",
                                 "pp_virtual": "vpp"}


@dataclass(frozen=True)
class Layout:
    """One parallel layout; ``world_size`` = pp * dp * cp * tp (ep lives inside dp * cp)."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sp: bool = False  # sequence parallelism (needs tp > 1)
    zero: int = 0  # ZeRO stage, 0-3
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1  # model chunks per pipeline rank (interleaved, bfs, interleaved-zb, V)
    pp_layers: str = ""  # explicit layers per stage, e.g. "3,3,2"; "" -> balanced by count
    cp_attention: str = "zigzag"  # one of CP_MODES (used when cp > 1)
    micro_batch: int = 1  # sequences per forward/backward on one data-parallel rank
    recompute: str = "none"  # activation recomputation, one of RECOMPUTE
    # Tensor-parallel collectives decomposed and overlapped with their GEMMs (Wang et al. 2022;
    # Megatron-LM --tp-comm-overlap, torchtitan async TP). meshlm does not do this, so the
    # search never sets it; it describes published runs that did.
    tp_overlap: bool = False
    # The expert group folded over tp x dp x cp (Megatron-Core's MoE parallel folding with
    # expert tensor parallelism 1): ep divides tp * dp * cp instead of dp * cp, each rank holds
    # E / ep whole experts and dispatches its own 1 / tp of the routed rows, and an expert's
    # copies are the tp * dp * cp / ep ranks ep apart. meshlm places ep inside dp x cp, so the
    # search never sets it; it describes published runs that did.
    ep_over_tp: bool = False
    # Where AdamW moments live: none (device) | cpu (host) | disk (a file per rank). The
    # planner counts offloaded moments off the device; its search never sets this.
    offload: str = "none"
    # DiLoCo islands (parallel/diloco.py): an outermost mesh axis of ``islands`` copies of this
    # inner layout that synchronise only every diloco.inner_steps steps; 1 = no islands
    islands: int = 1
    # Hybrid sharding (HSDP): ZeRO shards over groups of ``dp_shard`` consecutive dp ranks, and
    # the dp / dp_shard groups are replicas of each other; 0 = all of dp (plain ZeRO)
    dp_shard: int = 0

    @property
    def shard_size(self) -> int:
        """dp ranks one ZeRO shard group spans (``dp_shard``; 0 reads as all of dp)."""
        return self.dp_shard or self.dp

    @property
    def dp_rep(self) -> int:
        """Replicas of the shard group: dp / dp_shard (1 without hybrid sharding)."""
        return max(1, self.dp // max(1, self.shard_size))

    @property
    def hybrid(self) -> bool:
        """Whether ZeRO shards over part of dp and replicates across the rest (HSDP)."""
        return self.shard_size < self.dp

    @property
    def inner_size(self) -> int:
        """Ranks of one island: pp * dp * cp * tp."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def world_size(self) -> int:
        return self.islands * self.inner_size

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on each axis (row-major, tp fastest)."""
        out, rest = {}, rank
        for axis in reversed(AXES):
            size = getattr(self, axis)
            out[axis] = rest % size
            rest //= size
        return {a: out[a] for a in AXES}

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches per optimizer step on each pipeline (gradient accumulation); islands
        split the global batch like data-parallel ranks."""
        return max(1, global_batch // (self.islands * self.dp * self.micro_batch))

    def describe(self) -> str:
        """The planner's text, e.g. ``tp=8,sp,pp=4,dp=16,zero=1,mbs=1,recompute=none``."""
        parts = [f"tp={self.tp}"] + (["sp"] if self.sp else []) + (
            ["tp_overlap"] if self.tp_overlap else [])
        parts += [f"pp={self.pp}", f"dp={self.dp}"]
        if self.hybrid:
            parts.append(f"dp_shard={self.shard_size}")
        parts += [f"{k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) > 1]
        if self.ep_over_tp:
            parts.append("ep_over_tp")
        if self.cp > 1 and self.cp_attention != "zigzag":
            parts.append(f"cp_attention={self.cp_attention}")
        parts += [f"zero={self.zero}", f"mbs={self.micro_batch}", f"recompute={self.recompute}"]
        if self.pp > 1:
            parts.append(f"schedule={self.pp_schedule}")
            if self.pp_virtual > 1:
                parts.append(f"vpp={self.pp_virtual}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        if self.islands > 1:
            parts.append(f"islands={self.islands}")
        return ",".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    # ------------------------------------------------------------------ the rules
    def problems(self, model_cfg: ModelConfig | None = None, seq_len: int | None = None,
                 global_batch: int | None = None, world: int | None = None,
                 gpus_per_node: int | None = None, strict: bool = False,
                 trainer: bool = False, keys: Mapping[str, str] = SHORT_KEYS) -> list[str]:
        """Why this layout cannot run (empty when it can), one message per broken rule.

        Rules that need an argument left at None are skipped. ``keys`` names the fields in
        the messages (:data:`CONFIG_KEYS` or :data:`SHORT_KEYS`). ``trainer`` applies the
        rules of meshlm's own trainer: its interleaved schedule needs a micro-batch count
        divisible by pp, and it runs pipelines with fewer micro-batches than stages (which the
        planner refuses otherwise). ``strict`` (the planner's search) also demands an even
        split of the layers over the stages and Megatron's interleaving rule; a layout given
        by hand may split layers unevenly (the slowest stage is modelled).
        """
        k = _Names(keys)
        sizes = ("pp", "dp", "cp", "tp", "ep", "pp_virtual", "micro_batch", "islands")
        out = [f"{k(s)}={getattr(self, s)} must be >= 1" for s in sizes if getattr(self, s) < 1]
        if out:
            return out
        if world is not None and self.world_size != world:
            names = (("islands",) if self.islands > 1 else ()) + AXES
            out.append(f"{k.product(*names)} = "
                       f"{' * '.join(str(getattr(self, a)) for a in names)} = "
                       f"{self.world_size} is not the world of {world} ranks")
        if self.pp_schedule not in SCHEDULES:
            out.append(_unknown_schedule(self.pp_schedule, k))
        if self.zero not in ZERO_STAGES:
            out.append(f"{k('zero')}={self.zero} must be "
                       f"{', '.join(map(str, ZERO_STAGES[:-1]))} or {ZERO_STAGES[-1]}")
        if self.cp_attention not in CP_MODES:
            out.append(f"{k('cp_attention')}={self.cp_attention!r} is not one of "
                       f"{', '.join(CP_MODES)}")
        if self.recompute not in RECOMPUTE:
            out.append(f"{k('recompute')}={self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if self.offload not in OFFLOADS:
            out.append(f"{k('offload')}={self.offload!r} is not one of {', '.join(OFFLOADS)}")
        if gpus_per_node and self.tp > gpus_per_node:
            out.append(f"{k('tp')}={self.tp} exceeds the {gpus_per_node} GPUs of a node")
        if self.sp and self.tp == 1:
            out.append(f"{k('sp')}=true needs {k('tp')} > 1")
        if self.ep_over_tp and self.ep > 1 and (self.tp * self.dp * self.cp) % self.ep:
            out.append(f"{k('ep')}={self.ep} must divide {k.product('tp', 'dp', 'cp')} = "
                       f"{self.tp * self.dp * self.cp} (ep_over_tp: the expert group folds "
                       "over tp)")
        elif not self.ep_over_tp and self.ep > 1 and (self.dp * self.cp) % self.ep:
            out.append(f"{k('ep')}={self.ep} must divide {k.product('dp', 'cp')} = "
                       f"{self.dp * self.cp}")
        out += self._hybrid_problems(k)
        ranks = self.islands * self.dp  # ranks that split the global batch
        if global_batch is not None and global_batch % (self.micro_batch * ranks):
            names = ("micro_batch", "dp") + (("islands",) if self.islands > 1 else ())
            out.append(f"{k('global_batch')}={global_batch} is not divisible by "
                       f"{' * '.join(k(n) for n in names)} = "
                       f"{' * '.join(str(getattr(self, n)) for n in names)} = "
                       f"{self.micro_batch * ranks}")
        if seq_len is not None:
            out += self._sequence_problems(seq_len, k)
        if model_cfg is not None:
            out += self._model_problems(model_cfg, strict, k)
        if global_batch is not None and self.pp_schedule in SCHEDULES:
            out += self._pipeline_problems(global_batch, strict, trainer, k)
        return out

    def _hybrid_problems(self, k: _Names) -> list[str]:
        """Rules of hybrid sharding (``dp_shard``): shard groups tile dp, ZeRO does the
        sharding, and an expert group lies inside one shard group (x cp)."""
        if self.dp_shard == 0 or self.dp_shard == self.dp:
            return []
        if self.dp_shard < 0:
            return [f"{k('dp_shard')}={self.dp_shard} must be >= 1 (or 0: all of "
                    f"{k.leaf('dp')})"]
        if self.dp % self.dp_shard:
            return [f"{k('dp_shard')}={self.dp_shard} does not divide {k('dp')}={self.dp}"]
        out = []
        if self.zero == 0:
            out.append(f"{k('dp_shard')}={self.dp_shard} < {k('dp')}={self.dp} (hybrid "
                       f"sharding) needs {k('zero')} = 1, 2 or 3: without ZeRO nothing is "
                       "sharded")
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            out.append(f"{k('ep')}={self.ep} must divide {k.product('dp_shard', 'cp')} = "
                       f"{self.dp_shard * self.cp} under hybrid sharding (an expert group "
                       "lies inside one shard group)")
        return out

    def _sequence_problems(self, seq_len: int, k: _Names) -> list[str]:
        out = []
        local = seq_len // self.cp
        if self.sp and self.tp > 1 and local % self.tp:
            shown = (f"{k('seq_len')}={seq_len}" if self.cp == 1
                     else f"{k('seq_len')} / {k.leaf('cp')} = {local}")
            out.append(f"{k('sp')}=true: {shown} is not divisible by {k('tp')}={self.tp}")
        chunks = 2 * self.cp if self.cp_attention == "zigzag" else self.cp
        if self.cp > 1 and seq_len % chunks:
            shown = f"2 * {k.leaf('cp')} (zigzag)" if chunks != self.cp else k.leaf("cp")
            out.append(f"{k('cp')}={self.cp}: {k('seq_len')}={seq_len} is not divisible by "
                       f"{shown}")
        return out

    def _model_problems(self, c: ModelConfig, strict: bool, k: _Names) -> list[str]:
        heads = c.tp_split_heads()
        out = [f"{k('tp')}={self.tp} does not divide {k(key)}={getattr(c, key)}"
               for key in (*(h for h, _ in heads), "ffn_hidden") if getattr(c, key) % self.tp]
        if self.cp > 1 and self.cp_attention == "ulysses" and not out:
            out += [f"{k('cp_attention')}=ulysses: {k('cp')}={self.cp} does not divide the "
                    f"{getattr(c, key) // self.tp} {what} of each tp rank ({k(key)}="
                    f"{getattr(c, key)} / {k.leaf('tp')}={self.tp}); use zigzag or ring"
                    for key, what in heads if (getattr(c, key) // self.tp) % self.cp]
        if c.is_moe and c.expert_hidden % self.tp:
            out.append(f"{k('tp')}={self.tp} does not divide the expert width "
                       f"{k('moe_ffn_hidden')}={c.expert_hidden}")
        if self.ep > 1 and not c.is_moe:
            out.append(f"{k('ep')}={self.ep} needs a Mixture-of-Experts model")
        elif self.ep > 1 and c.moe_experts % self.ep:
            out.append(f"{k('ep')}={self.ep} does not divide the {c.moe_experts} experts")
        stages = self.pp * self.pp_virtual
        if stages > c.n_layers and not self.pp_layers:
            out.append(f"{k.product('pp', 'pp_virtual')} = {stages} stages exceed "
                       f"{k('n_layers')}={c.n_layers}")
        if self.pp_layers:
            problem = _split_problem(self.pp_layers, c.n_layers, stages, k)
            if problem:
                out.append(problem)
        if (strict or (self.pp_schedule in V_SCHEDULES and not self.pp_layers)) and (
                c.n_layers % stages):
            out.append(f"{k.product('pp', 'pp_virtual')} = {stages} stages do not divide "
                       f"{k('n_layers')}={c.n_layers}" + (
                           f" ({k('pp_schedule')}={self.pp_schedule} places them in a V; give "
                           f"{k('pp_layers')} for an uneven split)"
                           if self.pp_schedule in V_SCHEDULES and not strict else ""))
        return out

    def _pipeline_problems(self, global_batch: int, strict: bool, trainer: bool, k: _Names
                           ) -> list[str]:
        m = self.micro_batches(global_batch)
        out = []
        if self.pp > 1 or self.pp_virtual > 1:
            per_step = (f"micro-batches per step = {k('global_batch')} / "
                        f"({k('micro_batch')} * {k('dp')})")
            out += schedule_problems(self.pp_schedule, self.pp, m, self.pp_virtual, k.keys,
                                     divisible=trainer or strict, counted=per_step)
        if self.pp > 1 and m < self.pp and not trainer:
            out.append(f"{m} micro-batch(es) per step cannot fill a pipeline of "
                       f"{k('pp')}={self.pp} stages")
        return out


_FIELDS = tuple(f.name for f in fields(Layout))  # (as_dict's keys, in declaration order)


class _Names:
    """How a caller names the fields: ``keys[field]``, the field's own name otherwise."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self.keys = keys

    def __call__(self, name: str) -> str:
        return self.keys.get(name, name)

    def leaf(self, name: str) -> str:
        """The name without its section: ``parallel.cp`` -> ``cp``."""
        return self(name).rpartition(".")[2]

    def product(self, *names: str) -> str:
        """``parallel.pp * dp * cp * tp``: the first name in full, the others by their leaf."""
        return " * ".join([self(names[0]), *(self.leaf(n) for n in names[1:])])


def _unknown_schedule(schedule: str, k: _Names) -> str:
    return (f"unknown schedule: {k('pp_schedule')}={schedule!r} is not one of "
            f"{', '.join(SCHEDULES)}")


def schedule_problems(schedule: str, pp: int, m: int, v: int,
                      keys: Mapping[str, str] = CONFIG_KEYS, divisible: bool = True,
                      counted: str = "") -> list[str]:
    """Why ``m`` micro-batches cannot run under ``schedule`` on ``pp`` ranks with ``v`` virtual
    stages each (empty when they can). ``divisible``: demand ``m % pp == 0`` for interleaving
    (meshlm's and Megatron's interleaved 1F1B); ``counted`` says how ``m`` was counted."""
    k = _Names(keys)
    if schedule not in SCHEDULES:
        return [_unknown_schedule(schedule, k)]
    if pp < 1 or m < 1 or v < 1:
        return [f"{k('pp')}={pp}, micro-batches={m} and {k('pp_virtual')}={v} must be >= 1"]
    if schedule in V_SCHEDULES and v != 2:
        return [f"{k('pp_schedule')}={schedule} places exactly 2 model chunks per rank in a V "
                f"(rank r holds stages r and 2 * {k.leaf('pp')} - 1 - r): it needs "
                f"{k('pp_virtual')}=2, not {v}"]
    if schedule not in (*V_SCHEDULES, *LOOPED_SCHEDULES) and v != 1:
        # (or another schedule of LOOPED_SCHEDULES / V_SCHEDULES: the README lists them)
        return [f"{k('pp_virtual')}={v} needs {k('pp_schedule')}=interleaved"]
    if schedule in LOOPED_SCHEDULES and v < 2:
        return [f"the {schedule} schedule needs {k('pp_virtual')} >= 2"]
    problem = micro_batch_problem(schedule, pp, m, keys, divisible)
    return [problem + (f" ({counted})" if counted else "")] if problem else []


def micro_batch_problem(schedule: str, pp: int, m: int, keys: Mapping[str, str] = CONFIG_KEYS,
                        divisible: bool = True) -> str | None:
    """Why ``schedule`` cannot run ``m`` micro-batches per step on ``pp`` ranks (None: it can).
    ``divisible``: as :func:`schedule_problems`."""
    k = _Names(keys)
    if schedule in ("interleaved", "interleaved-zb") and divisible and m % pp:
        return (f"the {schedule} schedule needs micro-batches ({m}) divisible by "
                f"{k('pp')} ({pp})")
    if schedule == "bfs" and m < pp:
        return (f"the bfs schedule needs at least {k('pp')} ({pp}) micro-batches per step, not "
                f"{m}: a chunk's forwards on the first rank must last until the first "
                "micro-batch comes round the loop")
    if schedule == "dualpipev" and m < 2 * pp:
        return (f"the dualpipev schedule needs at least 2 * {k('pp')} ({2 * pp}) micro-batches "
                f"per step, not {m}: one per stage of the V")
    return None


def _split_problem(explicit: str, n_layers: int, n_stages: int, k: _Names) -> str | None:
    """What is wrong with an explicit split of ``n_layers`` layers into ``n_stages`` stages.
    The first and the last stage may hold no decoder layer -- only the embedding, only the
    final norm, head and loss (Megatron-Core's ``--account-for-embedding-in-pipeline-split``
    and ``--account-for-loss-in-pipeline-split``: each counts as a layer)."""
    items = explicit.split(",")
    inner = items[1:-1] if len(items) > 1 else items  # (the end stages may be empty)
    if not all(c.strip().isdigit() for c in items) or any(int(c) < 1 for c in inner):
        return (f"{k('pp_layers')}={explicit!r} must be a comma list of layer counts >= 1 "
                '(0 allowed for the first and the last stage), e.g. "3,3,2" or "0,4,4,0"')
    if len(items) != n_stages or sum(int(c) for c in items) != n_layers:
        return (f"{k('pp_layers')}={explicit!r} must list {n_stages} counts summing to "
                f"{k('n_layers')}={n_layers}")
    return None


def partition_layers(n_layers: int, n_stages: int, explicit: str = "") -> list[list[int]]:
    """Layer ids of each pipeline stage: an explicit comma list of counts, or balanced by count.

    With a remainder, the extra layers go to the middle stages first, because the first and
    last stages also hold the embedding and the head. Raises ValueError for a bad split.
    """
    if explicit:
        problem = _split_problem(explicit, n_layers, n_stages, _Names(CONFIG_KEYS))
        if problem:
            raise ValueError(problem)
        counts = [int(c) for c in explicit.split(",")]
    else:
        counts = [n_layers // n_stages] * n_stages
        order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1), s))
        for s in order[: n_layers % n_stages]:
            counts[s] += 1
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out
