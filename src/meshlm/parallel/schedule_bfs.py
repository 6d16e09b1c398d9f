"""Looped BFS and interleaved zero bubble: ``v`` chunks per pipeline rank, placed round robin.

Placement as interleaved 1F1B (Megatron): stage ``s`` of ``S = p v`` on rank ``s % p``, so
chunk ``k`` of rank ``r`` is stage ``k p + r``. This module gives each rank's *compute order*
as ``(op, micro-batch, stage)`` tuples; ``schedules.py`` places the point-to-point actions and
registers the schedules.

- ``bfs``            Looped BFS (Lamy-Poirier 2022, "Breadth-First Pipeline Parallelism"; the
                     order of torch's ``ScheduleLoopedBFS``): all ``m`` micro-batches' forwards
                     through chunk 0, then chunk 1, ..., then the backwards chunk by chunk in
                     reverse. (torch runs a chunk's backwards last micro-batch first; here they
                     run first micro-batch first, as every other schedule accumulates the
                     gradients, so the sums are added in the one-process order; the last stage
                     finds every micro-batch's forward done either way.)
                     Each virtual stage's backwards run back to back, so its weight gradients
                     are complete as soon as its last backward ends -- the order that lets a
                     sharded data-parallel engine (ZeRO-3, HSDP) gather a chunk's weights once
                     per step and reduce its gradients once. (meshlm's engines still gather and
                     reduce once per step for all of a rank's chunks together, after the last
                     backward.) Needs ``v >= 2`` (with one chunk it is AFAB) and ``m >= p``: a
                     chunk's ``m`` forwards on rank 0 must last until the first micro-batch has
                     come round the loop from rank ``p - 1``. Memory: every micro-batch of every
                     chunk alive at the turn (``m`` micro-batches of the rank's layer share, as
                     AFAB); bubble ``(p - 1) / (v m + p - 1)``.
- ``interleaved-zb`` Interleaved zero bubble (ZB-1P of Qi et al. 2023 over Megatron's
                     interleaving; the order of torch's ``ScheduleInterleavedZeroBubble``):
                     interleaved 1F1B whose backward is split into ``I`` (input gradient, on the
                     critical path) and a deferred ``W`` (weight gradient); rank ``r`` defers its
                     ``W`` passes by ``r`` steps so they fill the cool-down bubble; the warm-up
                     is ``(v - 1) p + p - 1 - r`` chunk forwards. Needs ``v >= 2`` and ``m``
                     divisible by ``p`` (micro-batches go through the chunks in rounds of ``p``).

Communication: the activation and gradient of every stage boundary per micro-batch (``S - 1``
each way). Memory of the split: see ``pipeline.py``.
"""

from __future__ import annotations

Order = list[tuple[str, int, int]]


def bfs_order(pp: int, m: int, v: int, r: int) -> Order:
    """Rank ``r``'s compute order under looped BFS."""
    stages = [k * pp + r for k in range(v)]
    out: Order = [("F", mb, s) for s in stages for mb in range(m)]
    out += [("B", mb, s) for s in reversed(stages) for mb in range(m)]
    return out


def interleaved_zb_order(pp: int, m: int, v: int, r: int) -> Order:
    """Rank ``r``'s compute order under interleaved zero bubble (m % pp == 0)."""
    total = m * v
    warmup = min((v - 1) * pp + (pp - 1 - r), total)
    f_next: dict[int, int] = {}
    b_next: dict[int, int] = {}
    w_next: dict[int, int] = {}
    out: Order = []
    backwards: list[int] = []  # the stage of each I pass, in order: W passes follow them
    n_w = 0

    def take(counter: dict[int, int], s: int) -> int:
        mb = counter.get(s, 0)
        counter[s] = mb + 1
        return mb

    def forward_stage(step: int) -> int:
        return ((step // pp) % v) * pp + r

    def backward_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // pp) % v) * pp + r

    def weight() -> None:
        nonlocal n_w
        s = backwards[n_w]
        out.append(("W", take(w_next, s), s))
        n_w += 1

    for step in range(total + warmup):  # warm-up, steady state (F then I), cool-down (I)
        if step < total:
            s = forward_stage(step)
            out.append(("F", take(f_next, s), s))
        if step >= warmup:
            s = backward_stage(step)
            out.append(("I", take(b_next, s), s))
            backwards.append(s)
            if step - warmup >= r:  # rank r defers its W passes by r steps
                weight()
    while n_w < len(backwards):
        weight()
    return out
