"""Pipeline schedules as the planner sees them (torch-free): placement, activations held,
bubble, sends.

The schedules themselves are the action tables of :mod:`.schedules`, run by :mod:`.pipeline`;
``parallel.pp_schedule`` accepts exactly the names here. For ``p`` pipeline ranks, ``v``
model chunks per rank and ``m`` micro-batches per step; ``f``, ``i``, ``w``: the time of one
micro-batch's forward, input-gradient and weight-gradient passes over a rank's whole layer
share (a full backward is ``b = i + w``; a chunk takes 1 / v of each).

**Placement**: stage ``s`` of ``p v`` on rank ``s % p`` (Megatron's interleaving; one stage
per rank when v = 1); the V schedules (ZB-V, DualPipeV) put stages r and ``2p - 1 - r`` on
rank r, so rank 0 holds the first and the last stage and the turn of the V (stage p - 1 ->
p) stays on rank p - 1.

**Memory** (``held``): micro-batches of the rank's whole layer share alive at rank r's peak,
counted as ``schedules.simulate`` and the executor's ``peak_live`` count them -- a chunk from
its forward to its last backward pass (its ``W`` in the split schedules, so the linears'
inputs and output gradients kept from ``I`` to ``W`` count as a whole micro-batch: an upper
bound). AFAB (GPipe) and looped BFS ``m``; 1F1B (Narayanan et al. 2021) ``min(p - r, m)``;
ZB-H1 (Qi et al. 2023) ``min(p, m)`` on every rank (rank r's r deferred W passes fill 1F1B's
p - r up to p); interleaved 1F1B ``2 (p - r - 1) + (v - 1) p + 1`` chunks (Megatron's warm-up,
``p (1 + (p - 1) / (p v))`` on the first rank, Korthikanti et al. 2022, sec. 4.2.3) and all
``m v`` when m == p; ZB-V ``min(2p, m + 1 + r, 2m)`` chunks (``p`` micro-batches once m >=
2p - 1, as 1F1B's first stage: the paper's claim); DualPipeV ``2p + 1`` chunks; interleaved
zero bubble ``min(m, p)``.

**Bubble** (``idle``): the idle time per step of a rank with equal stages, transfers free, as
the executor runs the tables (a compute starts when its rank is free and its input is made).
Closed forms, exact for meshlm's tables for every (f, i, w):

- AFAB, 1F1B (Narayanan et al. 2021): ``(p - 1)(f + b)``; interleaved 1F1B and looped BFS
  (Lamy-Poirier 2022): ``(p - 1)(f + b) / v``;
- ZB-H1: ``(p - 1)(f + i) - min(m - 1, p - 1) min(i, w)`` -- the paper's ``(p - 1)(T_F + T_B
  - T_W)`` once m >= p and w <= i (each rank's r deferred W passes fill its cool-down).

ZB-V, DualPipeV and interleaved zero bubble are replayed (:func:`replay`: their compute
orders, ``schedules.compute_order``, with these costs); with f = i = w they give ``(p - 1)(f +
b) / 6`` (ZB-V, once m >= 2p), ``(p - 1)(f + b) / 3`` (DualPipeV, its overlapped F + B pair
counted as run one after the other, as the executor runs it) and ``(p - 1)(f + b) / (3 v)``
(interleaved zero bubble). With unequal passes they follow no published formula: DualPipe's
``(p/2 - 1)(F&B + B - 3W)`` (DeepSeek-V3) matches only at f = i = w; ZB-V's bubble is not
linear in p; interleaved zero bubble's grows with m when i > f (its W passes, deferred r steps
on rank r, no longer fill the gap). ``schedules.simulate`` also holds each rank's messages to
the order it posts them (NCCL's rule): with unequal passes that can add idle time to these
three, so the replay is the bound a run reaches where transfers never wait on each other
(gloo, or NCCL when the posted order happens to fit the times).

**Host time and transfers** (``bubble(..., overhead=, latency=, post=, starts=)``, default 0
and None: the closed forms above). The executor's timeline counts as idle what happens
between two computes of a rank -- posting each send and receive the table puts between them
(``post``, per op: a rank pays for what its table posts there, e.g. two ops per micro-batch
and chunk on a middle rank of looped BFS, one on its end ranks) and the rest, dispatch
(``overhead``, per compute, so v times per micro-batch with v chunks per rank: a looped or V
schedule's v-fold smaller bubble is bought with v-fold more of both) -- the time a message
takes once both its sides are posted (``latency``), and the ranks entering the step at
different times (``starts``). With any set, the schedule's action tables are replayed as the
executor runs them (:func:`replay_tables`: each run of sends and receives posted as one
group, op after op, a compute waiting for the whole group holding its input -- sends
included, one handle per group -- and groups completing in the order posted under NCCL,
``ordered``, or each on its own under gloo); with all unset and ``ordered`` that replay is
``schedules.simulate``'s, exactly. On a 2-core CPU with gloo (``benchmarks/pipeline_bubble.py``,
2026-11-29) posting measured 0.2-0.6 ms per op, dispatch 0.02-0.08 ms, the delivery up to
2.7 ms (mean over the waits that blocked; a quiet ping-pong: 0.03-0.2 ms, the rest is waking
the threads of the ranks involved) and the ranks' starts up to 7 ms apart, enough to move a
looped or V schedule's bubble by 12-44 %. The planner passes none of them: on GPUs they are
host-side costs hidden behind queued kernels while the host runs ahead of the device, and
exposed only where a rank waits for a transfer (NCCL's point-to-point latency); no GPU value
has been measured for them, so the planner's GPU predictions keep them at 0.

The planner scales the idle time to unequal stages: ``bubble(others, ...)`` is ``others``
(the other stages' micro-batch times, summed: ``(p - 1)(f + b)`` with equal stages) times the
schedule's idle time per ``(p - 1)(f + b)``; the three replayed schedules replay each rank's
own micro-batch time instead (``ranks``: in a V rank 0 holds both the embedding and the head).
Replays are cached on the passes' and ranks' ratios; beyond ``REPLAY_ROUNDS`` p micro-batches
the idle time is extrapolated linearly (it is constant or linear in m there).

**Overlapped pairs** (``paired``): the share of a rank's passes that DualPipeV runs as a
forward paired with another micro-batch's backward; with expert parallelism the executor runs
each pair as two lanes taking turns at their all-to-alls (``overlap.py``), so that share of
the rank's expert all-to-alls hides behind the other lane's compute. ``(2(m - 2p + r + 1) +
p - r - 1) / (2m)`` of rank r's passes (less one pair on the last rank): 0 for every other
schedule.

**Communication** (``messages``): per micro-batch rank r sends one activation forward for each
of its stages whose next stage is on another rank, one gradient back for each whose previous
stage is, and receives the same from its neighbours: 2 v (fewer on the end ranks) round
robin, 4 per middle rank and 2 on ranks 0 and p - 1 in a V (the turn needs no send).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .cost import Registry

if TYPE_CHECKING:
    from .schedules import Action

Split = tuple[float, float, float]  # (f, i, w): forward, input gradient, weight gradient
EQUAL: Split = (1.0, 1.0, 1.0)


# ---------------------------------------------------------------------- placement
def _round_robin(p: int, v: int, r: int) -> tuple[int, ...]:
    return tuple(k * p + r for k in range(v))


def _v_shape(p: int, v: int, r: int) -> tuple[int, ...]:
    return (r, 2 * p - 1 - r)


# ---------------------------------------------------------------------- held
def _all(p: int, v: int, m: int, r: int) -> float:
    return float(m)


def _one_f_one_b(p: int, v: int, m: int, r: int) -> float:
    return float(min(m, p - r))


def _up_to_p(p: int, v: int, m: int, r: int) -> float:
    return float(min(m, p))


def _interleaved(p: int, v: int, m: int, r: int) -> float:
    chunks = m * v if m == p else min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)
    return chunks / v


def _zbv(p: int, v: int, m: int, r: int) -> float:
    return min(2 * p, m + 1 + r, 2 * m) / 2


def _dualpipev(p: int, v: int, m: int, r: int) -> float:
    return (2 * p + 1) / 2


def _no_pairs(p: int, m: int, r: int) -> float:
    return 0.0


def _dualpipev_pairs(p: int, m: int, r: int) -> float:
    """Share of rank r's chunk passes (2m forwards, 2m backwards) run in overlapped pairs."""
    from .schedule_v import dualpipev_order  # (torch-free)

    return sum(op == "B+" for op, _, _ in dualpipev_order(p, m, r)) / (2 * m)


# ---------------------------------------------------------------------- idle time
def _flush(p: int, v: int, m: int, split: Split) -> float:
    """AFAB, 1F1B, interleaved 1F1B, looped BFS: ``(p - 1)(f + b) / v``."""
    return (p - 1) * sum(split) / v


def _zb_h1(p: int, v: int, m: int, split: Split) -> float:
    f, i, w = split
    return (p - 1) * (f + i) - min(m - 1, p - 1) * min(i, w)


# Replays beyond this many micro-batches per rank extrapolate linearly from two shorter ones
# (the idle time is constant or linear in m once the steady state is reached).
REPLAY_ROUNDS = 6


def replay(schedule: str, p: int, v: int, m: int, split: Split = EQUAL,
           stages: Sequence[Split] | None = None, latency: float = 0.0, overhead: float = 0.0
           ) -> tuple[float, list[float]]:
    """(step time, each rank's compute time) of ``schedule``'s compute orders, a compute
    starting when its rank is free and its input is made -- ``latency`` later when it was
    made on another rank (default: transfers free) -- and ``overhead`` after the rank's
    previous compute ended (the executor's host time between two computes: posting the
    sends and receives between them, dispatch; idle time, as the timeline counts it). Each
    pass of a chunk costs ``split`` / v, or ``stages[s]``: stage s's own (f, i, w) per
    micro-batch. Torch-free: the orders are ``schedules.compute_order``'s."""
    from .schedules import COMPUTE, compute_order, stage_rank  # (torch-free)

    n_stages = p * v
    costs = [tuple(x / v for x in split)] * n_stages if stages is None else list(stages)
    if len(costs) != n_stages:
        raise ValueError(f"{len(costs)} stage costs for {n_stages} stages")
    units: list[list[list[tuple[str, int, int]]]] = []
    for r in range(p):
        rank_units: list[list[tuple[str, int, int]]] = []
        for op, mb, s in compute_order(schedule, p, m, v, r):
            if op == "B+":  # a backward overlapped with the forward before it: run after it
                rank_units[-1].append(("B", mb, s))
            else:
                assert op in COMPUTE, op
                rank_units.append([(op, mb, s)])
        units.append(rank_units)

    def cost(op: str, s: int) -> float:
        f, i, w = costs[s]
        return {"F": f, "B": i + w, "I": i, "W": w}[op]

    def needs(op: str, mb: int, s: int) -> list[tuple[str, int, int]]:
        if op == "F":
            return [("F", mb, s - 1)] if s > 0 else []
        if op in ("B", "I"):
            return [("F", mb, s)] + ([("B", mb, s + 1)] if s < n_stages - 1 else [])
        return [("I", mb, s)]

    made: dict[tuple[str, int, int], float] = {}
    pos, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    while any(pos[r] < len(units[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(units[r]):
                unit = units[r][pos[r]]
                deps = [d for a in unit for d in needs(*a)]
                if any(d not in made for d in deps):
                    break
                t = max([clock[r] + (overhead if pos[r] else 0.0),
                         *(made[d] + (latency if stage_rank(schedule, d[2], p) != r else 0.0)
                           for d in deps)])
                for k, (op, mb, s) in enumerate(unit):
                    t += cost(op, s) + (overhead if k else 0.0)
                    busy[r] += cost(op, s)
                    made[("B" if op in ("B", "I") else op, mb, s)] = t
                    if op == "I":
                        made[("I", mb, s)] = t
                clock[r], pos[r], moved = t, pos[r] + 1, True
        if not moved:
            raise RuntimeError(f"{schedule}: the compute orders of p={p}, m={m}, v={v} wait on "
                               "each other")
    return max(clock), busy


def replay_tables(schedule: str, p: int, v: int, m: int, stages: Sequence[Split],
                  latency: float = 0.0, overhead: float = 0.0, ordered: bool = False,
                  post: float = 0.0, starts: Sequence[float] | None = None,
                  each: Callable[[int, Action], float | None] | None = None,
                  delivery: Callable[[Action], float | None] | None = None
                  ) -> tuple[float, list[float]]:
    """(step time, each rank's compute time) of ``schedule``'s action tables
    (``schedules.build_schedule``) as the executor runs them: each run of sends and receives
    posted as one group when the rank reaches it, the rank's host busy ``post`` per send or
    receive while posting it (one after the other, in the table's order); a message done
    ``latency`` after both its sides are posted (under ``ordered``: each side when its whole
    group is posted); a compute waiting for the whole group holding its input
    (its sends too: a handle per group) and starting ``overhead`` after the rank's previous
    compute and the groups posted since (the host's remaining time between two computes:
    dispatch); the step ending when the last group is done (the executor waits for its
    sends). ``stages[s]``: stage s's (f, i, w) per micro-batch. ``starts[r]``: when rank r
    enters the step (default 0 for every rank). ``ordered``: a rank's groups also complete
    in the order it posts them (NCCL's rule, as ``schedules.simulate``); otherwise each
    group when its own messages are (gloo). ``each(r, action)`` and ``delivery(receive)``,
    where given and not None, replace the constants action by action (a replay of a
    measured step, or of drawn costs): a compute's own time, a send's or receive's own
    posting time, and a message's own delivery (named by its receive action). With
    ``post``, ``starts``, ``each`` and ``delivery`` unset, the replay is the one the planner
    had before they were added."""
    from .schedules import COMPUTE, build_schedule, group_end, is_p2p  # (torch-free)

    tables = build_schedule(schedule, p, m, v)
    n_stages = p * v
    if len(stages) != n_stages:
        raise ValueError(f"{len(stages)} stage costs for {n_stages} stages")
    if starts is not None and len(starts) != p:
        raise ValueError(f"{len(starts)} start times for {p} ranks")
    owner = {a.stage: r for r, acts in enumerate(tables) for a in acts if a.op in COMPUTE}

    def cost(r: int, a: Action) -> float:
        own = each(r, a) if each is not None else None
        if own is not None:
            return own
        f, i, w = stages[a.stage]
        return {"F": f, "B": i + w, "I": i, "W": w}[a.op]

    def posting(r: int, a: Action) -> float:
        own = each(r, a) if each is not None else None
        return post if own is None else own

    def delivered(receive: Action) -> float:
        own = delivery(receive) if delivery is not None else None
        return latency if own is None else own

    receives: dict[tuple[int, int, int], Action] = {}  # (sender, receiver, n) -> the receive
    posted: dict[tuple[int, int, str, int], tuple[list, int, int]] = {}  # -> group, rank, k
    count: dict[tuple[int, int, str], int] = {}
    # per group: [ops, done, posted at (its last op's posting), {op: its own posting}]
    groups: list[list[list]] = [[] for _ in range(p)]
    holder: dict[tuple[int, str, int, int], tuple[list, int]] = {}
    pos, busy, computes = [0] * p, [0.0] * p, [0] * p
    clock = [0.0] * p if starts is None else [float(t) for t in starts]

    def start(g: list, r: int, k: int) -> float | None:
        """When the group can run: posted (ordered: and the rank's previous group done)."""
        if not ordered or k == 0:
            return g[2]
        before = done(groups[r][k - 1], r, k - 1)
        return None if before is None else max(g[2], before)

    def side_at(op: tuple[int, int, str, int]) -> float | None:
        """When one side of a message can go: its own posting (gloo, op by op), or its
        group's start (ordered: the group is launched as one)."""
        g, r, k = posted[op]
        return start(g, r, k) if ordered else g[3][op]

    def done(g: list, r: int, k: int) -> float | None:
        if g[1] is None:
            if start(g, r, k) is None:
                return None
            ends = []
            for sender, receiver, side, n in g[0]:
                other = (sender, receiver, "recv" if side == "send" else "send", n)
                there = side_at(other) if other in posted else None
                if there is None:
                    return None
                mine = side_at((sender, receiver, side, n))
                assert mine is not None
                ends.append(max(mine, there) + delivered(receives[(sender, receiver, n)]))
            g[1] = max(ends)
        return g[1]

    while any(pos[r] < len(tables[r]) for r in range(p)):
        moved = False
        for r in range(p):
            acts = tables[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if is_p2p(a):
                    end = group_end(acts, pos[r])
                    g: list = [[], None, clock[r], {}]
                    k = len(groups[r])
                    for x in acts[pos[r]:end]:
                        clock[r] += posting(r, x)  # (the host posting this send or receive)
                        side = "send" if x.op.startswith("SEND") else "recv"
                        pair = (r, x.peer) if side == "send" else (x.peer, r)
                        n = count.get((*pair, side), 0)
                        count[(*pair, side)] = n + 1
                        if side == "recv":
                            receives[(*pair, n)] = x
                        posted[(*pair, side, n)] = (g, r, k)
                        g[0].append((*pair, side, n))
                        g[3][(*pair, side, n)] = clock[r]
                        if side == "recv":
                            holder[(r, x.op[-1], x.mb, x.stage)] = (g, k)
                    g[2] = clock[r]
                    groups[r].append(g)
                    pos[r], moved = end, True
                    continue
                t = clock[r] + (overhead if computes[r] else 0.0)
                src = (a.stage - 1 if a.op == "F" else a.stage + 1 if a.op in ("B", "I")
                       else -1)
                if 0 <= src < n_stages and owner[src] != r:
                    g, k = holder[(r, "F" if a.op == "F" else "B", a.mb, a.stage)]
                    ready = done(g, r, k)
                    if ready is None:
                        break
                    t = max(t, ready)
                took = cost(r, a)
                clock[r] = t + took
                busy[r] += took
                computes[r] += 1
                pos[r], moved = pos[r] + 1, True
        if not moved:
            raise RuntimeError(f"{schedule}: the tables of p={p}, m={m}, v={v} wait on each "
                               "other")
    last = [done(g, r, k) for r in range(p) for k, g in enumerate(groups[r])]
    if any(t is None for t in last):
        raise RuntimeError(f"{schedule}: a message of p={p}, m={m}, v={v} is never matched")
    return max([*clock, *last]), busy  # type: ignore[list-item]


@functools.lru_cache(maxsize=4096)
def _replayed_idle(schedule: str, p: int, v: int, m: int, split: Split,
                   weights: tuple[float, ...] | None = None) -> float:
    """Idle time of the busiest rank; ``weights``: each rank's micro-batch time over the
    slowest rank's (its chunks' passes scaled by it; None: equal ranks)."""
    stages = None
    if weights is not None:
        from .schedules import stage_rank

        stages = [tuple(weights[stage_rank(schedule, s, p)] * x / v for x in split)
                  for s in range(p * v)]
    time, busy = replay(schedule, p, v, m, split, stages)
    return time - max(busy)


def _replayed(schedule: str) -> Callable[..., float]:
    def idle(p: int, v: int, m: int, split: Split, ranks: Sequence[float] | None = None
             ) -> float:
        # (the cache's key: the passes' ratios to the forward, to 4 decimals, and the ranks'
        # times over the slowest one's, to 2; idle time scales with the forward's)
        scale = split[0]
        key = (1.0, round(split[1] / scale, 4), round(split[2] / scale, 4))
        weights = None
        if ranks is not None:
            slow = max(ranks)
            weights = tuple(round(t / slow, 2) for t in ranks)
            scale = slow * split[0] / sum(split)
        hi = REPLAY_ROUNDS * p
        if m <= hi:
            return scale * _replayed_idle(schedule, p, v, m, key, weights)
        a = _replayed_idle(schedule, p, v, hi - p, key, weights)
        b = _replayed_idle(schedule, p, v, hi, key, weights)
        return scale * (b + (b - a) * (m - hi) / p)

    return idle


def _host_idle(schedule: str, p: int, v: int, m: int, split: Split, ranks: Sequence[float],
               overhead: float, latency: float, ordered: bool, post: float = 0.0,
               starts: Sequence[float] | None = None) -> float:
    """Idle time of the busiest rank with the executor's host time between computes
    (``overhead`` per compute, ``post`` per send or receive posted) and a transfer time
    (``latency`` per message), the ranks entering the step at ``starts``: ``schedule``'s action tables replayed
    (:func:`replay_tables`), each rank's chunks sharing its micro-batch time ``ranks[r]`` in
    the ratio of ``split``. Beyond ``REPLAY_ROUNDS`` p micro-batches, extrapolated linearly
    (the steady state adds a constant idle time per micro-batch)."""
    from .schedules import stage_rank  # (torch-free)

    total = sum(split)
    stages = [tuple(ranks[stage_rank(schedule, s, p)] * x / (total * v) for x in split)
              for s in range(p * v)]

    def idle(k: int) -> float:
        time, busy = replay_tables(schedule, p, v, k, stages, latency, overhead, ordered,
                                   post, starts)
        return time - max(busy)

    hi = REPLAY_ROUNDS * p
    if m <= hi:
        return idle(m)
    a, b = idle(hi - p), idle(hi)
    return b + (b - a) * (m - hi) / p


# ---------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class ScheduleCost:
    """One pipeline schedule's cost, as the planner reads it (see the module docstring)."""

    name: str
    doc: str
    held: Callable[[int, int, int, int], float]  # (p, v, m, r) -> micro-batches held
    idle: Callable[..., float]  # (p, v, m, (f, i, w)) -> idle time per step
    stages: Callable[[int, int, int], tuple[int, ...]] = _round_robin  # (p, v, r) -> stages
    replayed: bool = False  # idle(..., ranks=...) replays unequal ranks too
    # (p, m, r) -> share of rank r's passes that run in overlapped forward + backward pairs,
    # whose expert all-to-alls hide behind the other pass's compute (overlap.py)
    paired: Callable[[int, int, int], float] = _no_pairs

    def in_flight(self, p: int, v: int, m: int, r: int) -> float:
        """Micro-batches (of the rank's whole layer share) rank ``r`` holds at its peak."""
        return self.held(p, v, m, r)

    def bubble(self, others: float, v: int, p: int, m: int, split: Split = EQUAL,
               ranks: Sequence[float] | None = None, overhead: float = 0.0,
               latency: float = 0.0, ordered: bool = True, post: float = 0.0,
               starts: Sequence[float] | None = None) -> float:
        """Idle time per step of the slowest rank, given ``others``: the other stages'
        micro-batch times, summed ((p - 1) t_mb with equal stages), and the forward /
        input-gradient / weight-gradient shares ``split`` of a micro-batch's time. ``ranks``
        (each rank's micro-batch time): the replayed schedules replay them, each rank's chunks
        sharing its time (a V's rank 0 holds the embedding and the head). ``overhead`` (the
        executor's host time between two computes of a rank) and ``latency`` (an
        activation's or gradient's transfer between ranks), in seconds: when either is set
        every schedule's action tables are replayed with them (``m v`` computes per rank and
        step each pay the overhead, so it weighs v times more in a looped or V schedule; a
        compute waits for the whole group of sends and receives holding its input; groups
        complete in the order posted when ``ordered``, NCCL's rule, else each on its own,
        gloo's); ``post``: the host time to post one send or receive (each group's posted
        ops add up between two computes); ``starts``: when each rank enters the step (its
        idle time before is counted). All unset (the default): transfers and dispatch free,
        the closed forms."""
        if p < 2:
            return 0.0
        if overhead > 0 or latency > 0 or post > 0 or starts is not None:
            times = list(ranks) if ranks is not None else [others / (p - 1)] * p
            return _host_idle(self.name, p, v, m, split, times, overhead, latency, ordered,
                              post, starts)
        if ranks is not None and self.replayed:
            return self.idle(p, v, m, split, ranks)
        return others * self.idle(p, v, m, split) / ((p - 1) * sum(split))

    def fraction(self, p: int, v: int, m: int, split: Split = EQUAL) -> float:
        """The ideal bubble fraction with equal stages: idle / (idle + m (f + b)) -- what
        ``schedules.simulate`` reports, and the executor measures, for these costs."""
        idle = self.idle(p, v, m, split) if p > 1 else 0.0
        return idle / (idle + m * sum(split))

    def last_rank(self, p: int, v: int) -> int:
        """The rank holding the last stage (final norm, head, loss)."""
        return next(r for r in range(p) if p * v - 1 in self.stages(p, v, r))

    def messages(self, p: int, v: int, r: int) -> tuple[int, int]:
        """(sends, receives) of rank ``r`` per micro-batch: activations forward and gradients
        back across the stage boundaries that cross ranks."""
        mine = set(self.stages(p, v, r))
        last = p * v - 1
        sends = sum((s < last and s + 1 not in mine) + (s > 0 and s - 1 not in mine)
                    for s in mine)
        return sends, sends  # (a stage's neighbours on other ranks: received from as sent to)


SCHEDULES: Registry[ScheduleCost] = Registry("pipeline schedule")
SCHEDULES.register(ScheduleCost("afab", "all forwards, then all backwards (GPipe)", _all,
                                _flush))
SCHEDULES.register(ScheduleCost("1f1b", "one forward, one backward (PipeDream-Flush)",
                                _one_f_one_b, _flush))
SCHEDULES.register(ScheduleCost("interleaved", "1F1B over v virtual stages per rank (Megatron)",
                                _interleaved, _flush))
SCHEDULES.register(ScheduleCost("zb", "ZB-H1: backward split into input and weight gradients",
                                _up_to_p, _zb_h1))
SCHEDULES.register(ScheduleCost("zbv", "ZB-V: two chunks per rank in a V, backward split", _zbv,
                                _replayed("zbv"), _v_shape, replayed=True))
SCHEDULES.register(ScheduleCost("dualpipev", "DualPipeV: a V, one micro-batch's forward paired "
                                "with another's backward", _dualpipev, _replayed("dualpipev"),
                                _v_shape, replayed=True, paired=_dualpipev_pairs))
SCHEDULES.register(ScheduleCost("bfs", "looped BFS: all micro-batches through a chunk, then the "
                                "next", _all, _flush))
SCHEDULES.register(ScheduleCost("interleaved-zb", "interleaved 1F1B with the backward split",
                                _up_to_p, _replayed("interleaved-zb"), replayed=True))

__all__ = ["EQUAL", "SCHEDULES", "ScheduleCost", "Split", "replay", "replay_tables"]
