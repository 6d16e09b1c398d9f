"""The V schedules: ZB-V and DualPipeV, two model chunks per pipeline rank placed in a V.

Placement (``schedules.stage_rank``): the ``2p`` stages run down the ranks and back up, so
rank ``r`` holds stage ``r`` (chunk 0) and stage ``2p - 1 - r`` (chunk 1). Rank 0 holds both
the first stage (the embedding) and the last (final norm, head, loss, extra training heads):
a tied head or a training head's lookups use the one embedding table, with nothing to sum
across ranks.
The turn of the V, stage ``p - 1`` -> ``p``, stays on rank ``p - 1``: that activation and its
gradient are handed over in memory, with no send. Exactly two chunks per rank:
``parallel.pp_virtual`` must be 2 (torch's ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``
take two stages per rank too; meshlm asks for the count instead of inferring it, so the
``pp * pp_virtual`` stages of every layout rule mean the same), and without ``parallel.pp_layers``
the ``2p`` stages must divide ``model.n_layers``.

This module gives each rank's *compute order* as ``(op, micro-batch, stage)`` tuples (ops
``F``, ``B``, ``I``, ``W``; ``B+`` is a backward overlapped with the forward right before it);
``schedules.py`` places the point-to-point actions and registers the schedules.

- ``zbv``       ZB-V (Qi et al. 2023, sec. 6), the order of torch's ``ScheduleZBVZeroBubble``:
                warm-up forwards of chunk 0, then chunk 1's forward / input gradient / weight
                gradient, a steady state that alternates F, I, W on chunk 0 and chunk 1, and a
                cool-down whose deferred W passes fill the tail. Every backward is split
                (``I`` then ``W``). Bubble near zero when F, I and W take equal time; at most
                about ``2p`` chunk forwards alive on rank 0 (``p`` micro-batches of the rank's
                whole layer share, as 1F1B). Any micro-batch count (below ``2p - 1`` the
                order of ``2p - 1`` with the missing micro-batches left out).
- ``dualpipev`` DualPipeV (DeepSeek-V3's DualPipe folded into a V; the order of torch's
                ``ScheduleDualPipeV``): forwards of both chunks first, then a steady state of
                *overlapped* steps, each one micro-batch's forward on one chunk with another
                micro-batch's full backward on the other chunk (an ``F`` followed by ``B+``),
                and a cool-down where the second half of the backwards is split into ``I`` and
                deferred ``W``. Needs at least ``2p`` micro-batches (the stages of the V).
                The pair is one unit of the table (no point-to-point action between its two
                halves; ``schedules.overlapped_pairs`` lists them). With expert parallelism
                the executor runs its halves as two lanes taking turns at their expert
                all-to-alls (``overlap.py``), so one micro-batch's all-to-all is in flight
                while the other micro-batch computes; without, one after the other.

Communication: the activation and gradient of each of the ``2p - 2`` cross-rank stage
boundaries per micro-batch (the turn of the V sends nothing). Memory: ``I``/``W`` keep each
linear's input and output gradient from ``I`` until ``W`` (see ``pipeline.py``).
"""

from __future__ import annotations

Order = list[tuple[str, int, int]]


def v_stages(pp: int, r: int) -> tuple[int, int]:
    """(chunk 0, chunk 1) stages of rank ``r`` in the V."""
    return r, 2 * pp - 1 - r


def zbv_order(pp: int, m: int, r: int) -> Order:
    """Rank ``r``'s compute order under ZB-V (see the module docstring)."""
    n = max(2 * pp - 1, m)  # the order of n micro-batches; those >= m are left out
    s0, s1 = v_stages(pp, r)
    out: Order = []
    count = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}

    def add(op: str, chunk: int, key: str) -> None:
        out.append((op, count[key], s0 if chunk == 0 else s1))
        count[key] += 1

    for _ in range(2 * (pp - r) - 1):  # warm-up: chunk 0
        add("F", 0, "f0")
    for _ in range(r):  # chunk 1 starts
        add("F", 1, "f1")
        add("F", 0, "f0")
    for _ in range(pp - r):  # the first backwards, on chunk 1
        add("F", 1, "f1")
        out.append(("I", count["b1"], s1))
        out.append(("W", count["b1"], s1))
        count["b1"] += 1
    while count["f1"] < count["f0"] or count["f0"] < n:  # steady state
        if count["f0"] < n:
            add("F", 0, "f0")
        out += [("I", count["b0"], s0), ("W", count["b0"], s0)]
        count["b0"] += 1
        add("F", 1, "f1")
        out += [("I", count["b1"], s1), ("W", count["b1"], s1)]
        count["b1"] += 1
    w0, w1 = count["b0"], count["b1"]
    for _ in range(r):  # cool-down: input gradients first, their weight gradients fill the tail
        add("I", 0, "b0")
        add("I", 1, "b1")
    for _ in range(pp - r):
        add("I", 0, "b0")
        out.append(("W", w0, s0))
        w0 += 1
    out += [("W", i, s1) for i in range(w1, count["b1"])]
    out += [("W", i, s0) for i in range(w0, count["b0"])]
    return [a for a in out if a[1] < m]


def dualpipev_order(pp: int, m: int, r: int) -> Order:
    """Rank ``r``'s compute order under DualPipeV (see the module docstring; m >= 2 pp)."""
    s0, s1 = v_stages(pp, r)
    out: Order = []
    nxt = {("F", s0): 0, ("F", s1): 0, ("B", s0): 0, ("B", s1): 0}
    weights: list[tuple[int, int]] = []  # (micro-batch, stage) of I passes awaiting their W

    def add(op: str, s: int) -> None:
        key = ("F" if op == "F" else "B", s)
        mb = nxt[key]
        nxt[key] += 1
        out.append((op, mb, s))
        if op == "I":
            weights.append((mb, s))

    def overlapped(f_stage: int, b_stage: int) -> None:
        add("F", f_stage)
        add("B+", b_stage)

    def pending_w() -> None:
        if weights:
            mb, s = weights.pop(0)
            out.append(("W", mb, s))

    for _ in range(2 * (pp - r - 1)):  # 1: forwards of chunk 0
        add("F", s0)
    for _ in range(r + 1):  # 2: chunk 0 and chunk 1
        add("F", s0)
        add("F", s1)
    for _ in range(pp - r - 1):  # 3: chunk 1's first backwards (split), then its forward
        add("I", s1)
        pending_w()
        add("F", s1)
    for i in range(m - 2 * pp + r + 1):  # 4: the steady state of overlapped steps
        if i == 0 and r == pp - 1:  # (not overlapped: the last rank has nothing to hide yet)
            add("F", s0)
            add("B", s1)
        else:
            overlapped(s0, s1)
        overlapped(s1, s0)
    for _ in range(pp - r - 1):  # 5: chunk 1's backward, then an overlapped step
        add("B", s1)
        overlapped(s1, s0)
    split = False
    steps = r + 1
    for i in range(steps):  # 6: both chunks' backwards; the second half split into I + W
        if i == steps // 2 and r % 2 == 1:
            split = True
        add("I" if split else "B", s1)
        if i == steps // 2 and r % 2 == 0:
            split = True
        add("I" if split else "B", s0)
    for _ in range(pp - r - 1):  # 7: deferred weight gradients between chunk 0's backwards
        pending_w()
        add("I" if split else "B", s0)
    while weights:  # 8: the rest of the weight gradients
        pending_w()
    return out
