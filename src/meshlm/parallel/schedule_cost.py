"""Pipeline schedules as the planner sees them (torch-free): activations held, bubble.

The schedules themselves are the action tables of :mod:`.schedules`, run by :mod:`.pipeline`;
``parallel.pp_schedule`` accepts exactly the names here. For ``p`` pipeline ranks, ``v``
virtual stages per rank and ``m`` micro-batches per step:

**Memory**: pipeline rank ``r`` holds, at its peak, the activations of ``min(p - r, m)``
micro-batches under 1F1B (Narayanan et al. 2021) and ZB-H1 (Qi et al. 2023), ``m`` under AFAB
(GPipe); interleaving runs ``2 (p - r - 1) + (v - 1) p`` warm-up chunk forwards (Megatron's
schedule, as ``schedules.py``) -- ``p (1 + (p - 1) / (p v))`` on the first rank (Korthikanti
et al. 2022, sec. 4.2.3) -- and all of them when m == p (Megatron-Core's rule); counted in
units of the rank's whole layer share (``v`` chunks).

**Bubble**: ``(p - 1) / v`` micro-batch times for AFAB, 1F1B and interleaved 1F1B (Narayanan
et al. 2021), ``(p - 1) / 3`` for ZB-H1 with equal forward, input- and weight-gradient times
(Qi et al. 2023) -- the fractions ``schedules.simulate`` gives. With unequal stages the planner
passes the other stages' micro-batch times, summed, for ``p - 1``.

Communication: the stage boundaries' sends, the same for every schedule (counted by the
planner from the stages a rank holds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .cost import Registry


def _all(p: int, v: int, m: int, r: int) -> float:
    return float(m)


def _one_f_one_b(p: int, v: int, m: int, r: int) -> float:
    return float(min(m, p - r))


def _interleaved(p: int, v: int, m: int, r: int) -> float:
    chunks = m * v if m == p else min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)
    return chunks / v


@dataclass(frozen=True)
class ScheduleCost:
    """One pipeline schedule's cost, as the planner reads it (see the module docstring)."""

    name: str
    doc: str
    held: Callable[[int, int, int, int], float]  # (p, v, m, r) -> micro-batches held
    bubble_parts: int = 0  # the others' time is split into this many parts (0: v)

    def in_flight(self, p: int, v: int, m: int, r: int) -> float:
        """Micro-batches (of the rank's whole layer share) rank ``r`` holds at its peak."""
        return self.held(p, v, m, r)

    def bubble(self, others: float, v: int) -> float:
        """Idle time per step of a rank, given ``others``: the other stages' micro-batch
        times, summed ((p - 1) t_mb with equal stages)."""
        return others / (self.bubble_parts or v)


SCHEDULES: Registry[ScheduleCost] = Registry("pipeline schedule")
SCHEDULES.register(ScheduleCost("afab", "all forwards, then all backwards (GPipe)", _all))
SCHEDULES.register(ScheduleCost("1f1b", "one forward, one backward (PipeDream-Flush)",
                                _one_f_one_b))
SCHEDULES.register(ScheduleCost("interleaved", "1F1B over v virtual stages per rank (Megatron)",
                                _interleaved))
SCHEDULES.register(ScheduleCost("zb", "ZB-H1: backward split into input and weight gradients",
                                _one_f_one_b, bubble_parts=3))

__all__ = ["SCHEDULES", "ScheduleCost"]
