"""Layout search: enumerate valid layouts, drop those that do not fit, rank by tokens/s.

The space is every ``(tp, sp, cp, pp, dp, ep)`` whose product is the world and that divides
the model (tp divides the heads, KV heads and MLP width and stays inside a node; pp x vpp
divides the layers; cp divides the sequence into 2 cp chunks; ep divides the experts and
dp x cp), crossed with the ZeRO stage (0-3; 0-1 with pipelining, as Megatron and DeepSpeed
allow), every micro-batch size dividing the per-replica batch, recomputation and, with pp > 1,
the schedules 1F1B, interleaved 1F1B (v = 2, 4, ... dividing the layers per stage) and ZB-H1.
With ZeRO, ZeRO's group is every divisor ``dp_shard`` of dp (hybrid sharding: shard groups of
dp_shard x cp ranks, replicated dp / dp_shard times); dp_shard = dp is plain ZeRO.
AFAB is left out: it has 1F1B's bubble and holds more activations, so it never ranks higher.

Two cuts keep the search fast without losing the best layout. The recomputation modes are
tried from least to most recomputation (none, selective, op, full); each keeps fewer
activations and recomputes a superset of the one before, except selective (the attention
core) and op (every other matmul and the elementwise ops), which do not nest. So the first
mode that fits is timed -- and op too when that is selective. And memory, which is cheap, is
checked before time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ..layout import RECOMPUTE, Layout
from .hardware import Accelerator
from .memory import MemoryBreakdown, memory
from .timing import TimeBreakdown, step_time
from .workload import Workload


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
    return [d for d in range(1, n + 1) if n % d == 0]


def base_layouts(work: Workload, world: int, hw: Accelerator,
                 allowed: Callable[[Layout], bool] | None = None) -> Iterator[Layout]:
    """Every (tp, sp, cp, pp, dp, ep, schedule, vpp, mbs) that divides model and world."""
    c = work.model.config
    node = world if hw.is_cpu else hw.gpus_per_node
    for tp in _divisors(world):
        if tp > node or any(x % tp for x in (c.n_heads, c.n_kv_heads, c.ffn_hidden)):
            continue
        for cp in _divisors(world // tp):
            if work.seq_len % (2 * cp) and cp > 1:
                continue
            for pp in _divisors(world // (tp * cp)):
                if pp > c.n_layers or c.n_layers % pp:
                    continue
                dp = world // (tp * cp * pp)
                if work.global_batch % dp:
                    continue
                eps = [e for e in _divisors(dp * cp) if c.moe_experts % e == 0] if c.is_moe else [1]
                scheds = [("1f1b", 1)]
                if pp > 1:
                    per_stage = c.n_layers // pp
                    scheds += [("interleaved", v) for v in (2, 4, 8) if per_stage % v == 0]
                    scheds.append(("zb", 1))
                for ep in eps:
                    for sp in ([False, True] if tp > 1 else [False]):
                        for schedule, vpp in scheds:
                            for mbs in _divisors(work.global_batch // dp):
                                if mbs > 128:
                                    break
                                lo = Layout(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, sp=sp,
                                            pp_schedule=schedule, pp_virtual=vpp,
                                            micro_batch=mbs)
                                if allowed is None or allowed(lo):
                                    yield lo


def search(work: Workload, world: int, hw: Accelerator, top: int = 10,
           allowed: Callable[[Layout], bool] | None = None,
           recompute: tuple[str, ...] = RECOMPUTE, zero: tuple[int, ...] = (0, 1, 2, 3),
           tp_overlap: bool = False) -> list[Plan]:
    """The ``top`` feasible layouts, fastest first (empty when nothing fits).

    ``tp_overlap`` lets tensor-parallel layouts overlap their collectives with GEMMs -- only
    to compare with published runs that did; meshlm itself does not.
    """
    found: list[Plan] = []
    gpn = None if hw.is_cpu else hw.gpus_per_node
    for base in base_layouts(work, world, hw, allowed):
        for stage in zero:
            if base.pp > 1 and stage > 1:
                continue
            # dp_shard = 0: plain ZeRO (all of dp); hybrid sharding needs a ZeRO stage
            shards = [0] + ([d for d in _divisors(base.dp) if d < base.dp] if stage else [])
            for dp_shard in shards:
                best = _best_recompute(work, world, hw, allowed, recompute, gpn, Layout(
                    **{**base.as_dict(), "zero": stage, "dp_shard": dp_shard,
                       "tp_overlap": tp_overlap and base.tp > 1}))
                if best is not None:
                    found.append(best)
    found.sort(key=_rank_key)
    return found[:top]


def _best_recompute(work: Workload, world: int, hw: Accelerator,
                    allowed: Callable[[Layout], bool] | None, recompute: tuple[str, ...],
                    gpn: int | None, base: Layout) -> Plan | None:
    """The fastest recomputation mode of ``base`` that fits (module docstring's cut)."""
    best: Plan | None = None
    for rc in recompute:
        lo = replace(base, recompute=rc)
        if allowed is not None and not allowed(lo):
            continue
        if lo.problems(work.model.config, work.seq_len, work.global_batch, world, gpn,
                       strict=True):
            break
        mem = memory(work, lo, hw)
        if mem.fits:
            plan = Plan(lo, mem, step_time(work, lo, hw))
            if best is None or plan.tokens_per_s > best.tokens_per_s:
                best = plan
            if rc != "selective":
                break  # what follows recomputes a superset: slower
    return best


def _rank_key(p: Plan) -> tuple:
    """Fastest first; among equally fast layouts (to 1e-6) the simpler one: fewer pipeline
    and context ranks, less tensor parallelism, lower ZeRO stage, fewer shard-group replicas,
    no interleaving."""
    lo = p.layout
    return (-round(p.tokens_per_s, -int(math.floor(math.log10(max(p.tokens_per_s, 1e-30)))) + 5),
            lo.cp, lo.pp, lo.tp, lo.ep, lo.zero, lo.dp_rep, lo.pp_virtual,
            lo.pp_schedule != "1f1b", lo.sp, -lo.micro_batch)
