"""Layout search: enumerate valid layouts, drop those that do not fit, rank by tokens/s.

The space is every ``(tp, sp, cp, pp, dp, ep)`` whose product is the world and that divides
the model (tp divides the heads, KV heads and MLP width and stays inside a node; pp x vpp
divides the layers; cp divides the sequence into 2 cp chunks; ep divides the experts and
dp x cp), crossed with the ZeRO stage (0-3; 0-1 with pipelining, as Megatron and DeepSpeed
allow), every micro-batch size dividing the per-replica batch, recomputation and, with pp > 1,
the schedules 1F1B and ZB-H1; interleaved 1F1B, interleaved zero bubble and looped BFS with
v = 2, 4, 8 chunks per rank dividing the layers per rank; ZB-V and DualPipeV (two chunks in a
V) where the 2 pp stages divide the layers. The layout rules then drop what a schedule cannot
run (interleaving: micro-batches divisible by pp; BFS: at least pp of them; DualPipeV: at
least 2 pp).
With ZeRO, ZeRO's group is every divisor ``dp_shard`` of dp (hybrid sharding: shard groups of
dp_shard x cp ranks, replicated dp / dp_shard times); dp_shard = dp is plain ZeRO.
AFAB is left out: it has 1F1B's bubble and holds more activations, so it never ranks higher.
Among equally fast layouts the simpler schedule ranks first (:data:`SIMPLER`).

Four cuts keep the search fast without losing the best layout. The splits of the world
come from the divisors of the model's dimensions and of the batch, so the work is bounded
by the model, not by the number of ranks (at most :data:`MAX_WORLD`). A layout whose
weights, gradients and Adam moments alone overflow the device is dropped with every
micro-batch and recomputation mode (neither changes them). The recomputation modes are
tried from least to most recomputation (none, selective, op, full); each keeps fewer
activations and recomputes a superset of the one before, except selective (the attention
core) and op (every other matmul and the elementwise ops), which do not nest. So the first
mode that fits is timed -- and op too when that is selective. Memory does not fall as the
micro-batch grows (activations, logits and transients grow with it; a pipeline holds
min(micro-batches, stages) of them), so once no mode fits a micro-batch, no larger one of the
same layout is tried -- except on one rank without ZeRO, where one micro-batch per step frees
the gradients between steps. And memory, which is cheap, is checked before time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..layout import LOOPED_SCHEDULES, RECOMPUTE, SCHEDULES, V_SCHEDULES, Layout
from .hardware import Accelerator
from .memory import MemoryBreakdown, frees_gradients, memory
from .timing import TimeBreakdown, step_time
from .workload import Workload

# Schedules from the simplest: the tie-break among equally fast layouts
SIMPLER = ("1f1b", "zb", "interleaved", "interleaved-zb", "bfs", "zbv", "dualpipev", "afab")
assert set(SIMPLER) == set(SCHEDULES), "every schedule of layout.SCHEDULES ranked"


@dataclass
class Plan:
    """A layout with its predicted memory and time (``problems``: why it cannot run)."""

    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown | None
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems and self.memory.fits

    @property
    def tokens_per_s(self) -> float:
        return self.time.tokens_per_s if self.time else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layout": self.layout.describe(), **self.layout.as_dict(),
            "fits": self.fits, "problems": self.problems,
            "memory_bytes": {**self.memory.items, "total": self.memory.total},
            "memory_capacity_bytes": self.memory.capacity,
            **({"memory_host_bytes": self.memory.host} if self.memory.host else {}),
        }
        if self.time is not None:
            t = self.time
            out.update(step_time_s=t.step, tokens_per_s=t.tokens_per_s, mfu=t.mfu, hfu=t.hfu,
                       time_s=t.items, comm_s_before_overlap=t.comm,
                       comm_bytes_per_step=t.volumes, micro_batches=t.micro_batches)
        return out


def evaluate(work: Workload, layout: Layout, hw: Accelerator, world: int | None = None,
             strict: bool = False) -> Plan:
    """Memory and time of one layout (time is left out when the layout is invalid). A tensor-
    parallel group wider than a node is evaluated (its collectives at the network's rate, as
    published runs such as nanotron's tp=16 did); the search never proposes one."""
    problems = layout.problems(work.model.config, work.seq_len, work.global_batch, world,
                               None, strict)
    mem = memory(work, layout, hw) if not problems else _empty_memory(hw)
    t = step_time(work, layout, hw) if not problems else None
    return Plan(layout, mem, t, problems)


def _empty_memory(hw: Accelerator) -> MemoryBreakdown:
    return MemoryBreakdown({"params": 0.0, "grads": 0.0, "optim": 0.0}, 0, hw.memory)


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` >= 1, ascending, by trial division up to sqrt(n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# The most ranks the planner splits: 2^24, beyond any cluster built (the largest runs used
# about 10^5 GPUs); it keeps every divisor enumeration short.
MAX_WORLD = 2**24


def _splits(work: Workload, world: int, hw: Accelerator) -> Iterator[tuple[int, int, int, int]]:
    """Every (tp, cp, pp, dp) with tp * cp * pp * dp = world that divides the model and batch:
    tp the heads, KV heads and MLP width (inside a node), cp half the sequence, pp the
    layers, dp the global batch. Enumerated from the model's divisors, so the work does not
    grow with the world."""
    c = work.model.config
    node = world if hw.is_cpu else hw.gpus_per_node
    tps = _divisors(math.gcd(c.n_heads, c.n_kv_heads, c.ffn_hidden))
    cps = _divisors(work.seq_len // 2) if work.seq_len % 2 == 0 else [1]
    for tp in (t for t in tps if t <= node and world % t == 0):
        for cp in (x for x in cps if (world // tp) % x == 0):
            for pp in (x for x in _divisors(c.n_layers) if (world // (tp * cp)) % x == 0):
                dp = world // (tp * cp * pp)
                if work.global_batch % dp == 0:
                    yield tp, cp, pp, dp


def largest_world(work: Workload, hw: Accelerator) -> int:
    """The most ranks any layout of ``work`` can use: the largest tp x cp x pp x dp."""
    c = work.model.config
    node = 1 << 62 if hw.is_cpu else hw.gpus_per_node
    tp = max(t for t in _divisors(math.gcd(c.n_heads, c.n_kv_heads, c.ffn_hidden))
             if t <= node)
    cp = work.seq_len // 2 if work.seq_len % 2 == 0 else 1
    return tp * max(cp, 1) * c.n_layers * work.global_batch


def world_problem(work: Workload, world: int, hw: Accelerator) -> str | None:
    """Why no layout splits ``world`` ranks for ``work`` (None: some split exists)."""
    if world < 1:
        return f"{world} ranks: the number must be >= 1"
    if world > MAX_WORLD:
        return (f"{world} ranks is more than the planner's maximum of {MAX_WORLD} (2^24, "
                "beyond any cluster built)")
    if next(_splits(work, world, hw), None) is not None:
        return None
    c = work.model.config
    most = largest_world(work, hw)
    rule = (f"tp must divide the {c.n_heads} heads, {c.n_kv_heads} KV heads and MLP width "
            f"{c.ffn_hidden}{'' if hw.is_cpu else f' within a node of {hw.gpus_per_node}'}, "
            f"cp half the sequence of {work.seq_len}, pp the {c.n_layers} layers, dp the "
            f"global batch of {work.global_batch} sequences")
    if world > most:
        return (f"{world} ranks is more than model {c.name} can use: at most {most} "
                f"({rule})")
    return f"no split of {world} ranks into tp x cp x pp x dp fits model {c.name} ({rule})"


def base_layouts(work: Workload, world: int, hw: Accelerator,
                 allowed: Callable[[Layout], bool] | None = None) -> Iterator[Layout]:
    """Every (tp, sp, cp, pp, dp, ep, schedule, vpp, mbs) that divides model and world."""
    c = work.model.config
    for tp, cp, pp, dp in _splits(work, world, hw):
        eps = [e for e in _divisors(c.moe_experts) if (dp * cp) % e == 0] if c.is_moe else [1]
        scheds = [("1f1b", 1)]
        if pp > 1:
            per_stage = c.n_layers // pp
            scheds.append(("zb", 1))
            scheds += [(name, v) for name in LOOPED_SCHEDULES for v in (2, 4, 8)
                       if per_stage % v == 0]
            if per_stage % 2 == 0:
                scheds += [(name, 2) for name in V_SCHEDULES]
        per_replica = work.global_batch // dp
        mbss = [m for m in range(1, min(128, per_replica) + 1) if per_replica % m == 0]
        for ep in eps:
            for sp in ([False, True] if tp > 1 else [False]):
                for schedule, vpp in scheds:
                    for mbs in mbss:
                        lo = Layout(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, sp=sp,
                                    pp_schedule=schedule, pp_virtual=vpp, micro_batch=mbs)
                        if allowed is None or allowed(lo):
                            yield lo


def search(work: Workload, world: int, hw: Accelerator, top: int = 10,
           allowed: Callable[[Layout], bool] | None = None,
           recompute: tuple[str, ...] = RECOMPUTE, zero: tuple[int, ...] = (0, 1, 2, 3),
           tp_overlap: bool = False, counts: dict[str, int] | None = None) -> list[Plan]:
    """The ``top`` feasible layouts, fastest first (empty when nothing fits or no layout
    splits ``world``: :func:`world_problem` says why).

    ``tp_overlap`` lets tensor-parallel layouts overlap their collectives with GEMMs -- only
    to compare with published runs that did; meshlm itself does not. ``counts`` (when given)
    receives the work done: ``layouts`` considered, ``memory`` and ``timed`` evaluations.
    """
    counts = counts if counts is not None else {}
    counts.update(layouts=0, memory=0, timed=0)
    if world_problem(work, world, hw):
        return []
    found: list[Plan] = []
    gpn = None if hw.is_cpu else hw.gpus_per_node
    hopeless: dict[tuple, bool] = {}  # (layout less micro-batch) -> its states alone overflow
    too_big: set[tuple] = set()  # (layout less micro-batch): no mode fits a smaller micro-batch
    for base in base_layouts(work, world, hw, allowed):
        fields = base.as_dict()
        for stage in zero:
            if base.pp > 1 and stage > 1:
                continue
            # dp_shard = 0: plain ZeRO (all of dp); hybrid sharding needs a ZeRO stage
            shards = [0] + ([d for d in _divisors(base.dp) if d < base.dp] if stage else [])
            for dp_shard in shards:
                lo = Layout(**{**fields, "zero": stage, "dp_shard": dp_shard,
                               "tp_overlap": tp_overlap and base.tp > 1})
                counts["layouts"] += 1
                key = _less_micro_batch(lo)
                if key in too_big or _states_overflow(work, hw, lo, key, hopeless, counts):
                    continue
                best, overflow = _best_recompute(work, world, hw, allowed, recompute, gpn, lo,
                                                 counts)
                if best is not None:
                    found.append(best)
                # (one micro-batch per step frees the gradients there: a larger one may fit)
                elif overflow and not frees_gradients(lo):
                    too_big.add(key)
    found.sort(key=_rank_key)
    return found[:top]


def _less_micro_batch(lo: Layout) -> tuple:
    """The layout's fields but its micro-batch and recomputation mode."""
    return tuple(v for k, v in lo.as_dict().items() if k not in ("micro_batch", "recompute"))


def _states_overflow(work: Workload, hw: Accelerator, lo: Layout, key: tuple,
                     seen: dict[tuple, bool], counts: dict[str, int]) -> bool:
    """Whether the weights, gradients and Adam moments alone overflow the device -- then no
    micro-batch or recomputation fits (the optimizer step holds all of them, and they do not
    depend on either). Decided once per layout less its micro-batch (``key``)."""
    if key not in seen:
        counts["memory"] += 1
        m = memory(work, lo, hw)
        seen[key] = m.states > m.capacity
    return seen[key]


def _best_recompute(work: Workload, world: int, hw: Accelerator,
                    allowed: Callable[[Layout], bool] | None, recompute: tuple[str, ...],
                    gpn: int | None, base: Layout, counts: dict[str, int]
                    ) -> tuple[Plan | None, bool]:
    """The fastest recomputation mode of ``base`` that fits (module docstring's cut), and
    whether every mode of ``recompute`` was allowed and overflows the device (then none fits a
    larger micro-batch either). The layout rules do not depend on the mode: checked once."""
    if base.problems(work.model.config, work.seq_len, work.global_batch, world, gpn,
                     strict=True):
        return None, False
    best: Plan | None = None
    overflow = True
    fields = base.as_dict()
    for rc in recompute:
        if rc not in RECOMPUTE:
            return best, False  # (a mode the rules refuse)
        lo = Layout(**{**fields, "recompute": rc})
        if allowed is not None and not allowed(lo):
            overflow = False
            continue
        counts["memory"] += 1
        mem = memory(work, lo, hw)
        if mem.fits:
            overflow = False
            counts["timed"] += 1
            plan = Plan(lo, mem, step_time(work, lo, hw))
            if best is None or plan.tokens_per_s > best.tokens_per_s:
                best = plan
            if rc != "selective":
                break  # what follows recomputes a superset: slower
    return best, overflow and best is None


def _rank_key(p: Plan) -> tuple:
    """Fastest first; among equally fast layouts (to 1e-6) the simpler one: fewer pipeline
    and context ranks, less tensor parallelism, lower ZeRO stage, fewer shard-group replicas,
    fewer chunks per rank, the simpler schedule (:data:`SIMPLER`)."""
    lo = p.layout
    return (-round(p.tokens_per_s, -int(math.floor(math.log10(max(p.tokens_per_s, 1e-30)))) + 5),
            lo.cp, lo.pp, lo.tp, lo.ep, lo.zero, lo.dp_rep, lo.pp_virtual,
            SIMPLER.index(lo.pp_schedule), lo.sp, -lo.micro_batch)
