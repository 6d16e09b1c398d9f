"""Memory levers: what would make a layout fit, ranked as the planner ranks layouts.

When a run does not fit -- refused before it starts, or out of memory while it runs -- the user
gets the changes of one config key each that lower its peak, with the bytes each saves: a
smaller micro-batch, more activation recomputation, the chunked loss, the fused AdamW,
compilation, a higher ZeRO stage, a larger ZeRO shard group (hybrid sharding's
``parallel.dp_shard``), optimizer states offloaded to the host. The planner orders
them as it orders layouts: those that fit first, fastest predicted step first; then those
that do not fit alone, most bytes saved first.

No communication; planner arithmetic only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..layout import RECOMPUTE, Layout
from .hardware import Accelerator
from .memory import memory
from .timing import step_time
from .workload import Workload


@dataclass(frozen=True)
class Lever:
    """One config change (``key=value``), the peak bytes it saves and whether it then fits."""

    key: str
    value: str
    saves: float
    fits: bool
    step_s: float

    def describe(self) -> str:
        return f"{self.key}={self.value} (saves {size_text(self.saves)})"


def size_text(nbytes: float) -> str:
    """``"3.2 GiB"``, or ``"120 MiB"`` below one GiB."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def candidates(work: Workload, lo: Layout, hw: Accelerator
               ) -> list[tuple[str, str, Workload, Layout]]:
    """(key, value, workload, layout) of each one-key change that may lower the peak."""
    out: list[tuple[str, str, Workload, Layout]] = []
    m = lo.micro_batch
    if m > 1:
        per_rank = m * lo.micro_batches(work.global_batch)
        smaller = max((d for d in range(1, m) if per_rank % d == 0), default=1)
        out.append(("train.micro_batch", str(smaller), work, replace(lo, micro_batch=smaller)))
    order = list(RECOMPUTE)  # least to most recomputation
    for mode in order[order.index(lo.recompute) + 1:]:
        out.append(("train.recompute", mode, work, replace(lo, recompute=mode)))
    if work.loss == "torch":
        out.append(("train.loss", "chunked", replace(work, loss="chunked"), lo))
    if work.optimizer == "foreach":
        out.append(("train.adamw_impl", "fused", replace(work, optimizer="fused"), lo))
    if work.profile == "meshlm" and work.kernels == "eager":
        out.append(("train.compile", "true", replace(work, kernels="fused"), lo))
    if lo.dp * lo.cp > 1 and lo.zero < 3:
        for z in range(lo.zero + 1, 4):
            out.append(("parallel.zero", str(z), work, replace(lo, zero=z)))
    if lo.hybrid and lo.zero:  # larger shard groups: each rank holds less (dp_shard = dp: plain)
        for d in range(lo.shard_size + 1, lo.dp + 1):
            if lo.dp % d == 0:
                out.append(("parallel.dp_shard", str(d), work, replace(lo, dp_shard=d)))
    if lo.offload == "none" and not hw.is_cpu:
        out.append(("parallel.offload", "cpu", work, replace(lo, offload="cpu")))
    return out


def levers(work: Workload, lo: Layout, hw: Accelerator, top: int = 4) -> list[Lever]:
    """The ``top`` levers that lower the peak of ``lo``, in the planner's order (module
    docstring)."""
    base = memory(work, lo, hw).total
    found = []
    for key, value, w, layout in candidates(work, lo, hw):
        m = memory(w, layout, hw)
        if m.total >= base:
            continue
        try:
            t = step_time(w, layout, hw).step
        except (ValueError, ZeroDivisionError):  # (a layout the time model cannot price)
            t = math.inf
        found.append(Lever(key, value, base - m.total, m.fits, t))
    found.sort(key=lambda v: (not v.fits, v.step_s if v.fits else -v.saves))
    return found[:top]


def levers_text(work: Workload, lo: Layout, hw: Accelerator, top: int = 4) -> str:
    """``"a=1 (saves 3.0 GiB), then b=2 (...)"``; "" when no single key helps."""
    return ", then ".join(v.describe() for v in levers(work, lo, hw, top))
