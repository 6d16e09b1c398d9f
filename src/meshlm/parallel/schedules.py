"""Pipeline schedules as data: each is a pure function from (pp, micro-batches, virtual stages)
to every rank's ordered list of actions, registered by name in :data:`SCHEDULE_DEFS`.

Actions: ``F`` forward, ``B`` backward, ``I`` backward for inputs, ``W`` backward for weights
(zero bubble splits B into I + W), and the point-to-point ``SEND_F``/``RECV_F`` (activations)
and ``SEND_B``/``RECV_B`` (gradients). Placement is one function of the schedule,
:func:`stage_rank` (and its inverse :func:`rank_stages`): stage ``s`` of ``S = pp * v`` lives
on rank ``s % pp`` (Megatron's interleaving: virtual stage k of rank r is ``s = k * pp + r``),
except for the V schedules (``schedule_v.py``), whose rank r holds stages r and ``2 pp - 1 - r``.
Two neighbouring stages on one rank (the turn of the V) hand over in memory: no action.

- ``afab``        GPipe (Huang et al. 2019): all forwards, then all backwards; m live activations.
                  Every rank posts the receive of the next micro-batch before the current
                  micro-batch's compute, each send and receive a group of its own, so transfers
                  overlap compute (``_afab_tables``; checked by ``simulate(latency=...)``).
- ``1f1b``        PipeDream-flush (Narayanan et al. 2021): p - r - 1 warm-up forwards, then one
                  forward / one backward, then cool-down; at most p live micro-batches.
- ``interleaved`` Megatron's interleaved 1F1B with v chunks per rank (needs m % p == 0); ideal
                  bubble (p - 1) / (v m + p - 1). Its exchanges are grouped as Megatron-Core
                  groups them: after each warm-up forward one group sends the output and
                  receives the next input; in the steady state, after one forward and one
                  backward, one group sends both results and receives the next input and output
                  gradient -- what the neighbours send in their own group of that iteration,
                  used when its chunk comes (m == p: all forwards first, as Megatron-Core) --
                  or, where :func:`simulate` finishes that sooner (every m > p at pp 2; v 2 at
                  some m up to pp 6), with its messages placed by time as the new schedules'
                  (``_interleaved_best``).
- ``zb``          ZB-H1 (Qi et al. 2023): 1F1B with each B split into I then a deferred W; rank
                  r, which idles r backward slots at the end of 1F1B, defers its W passes by r
                  micro-batches so they fill that bubble; the chain between stages runs through
                  I only; at most p live micro-batches per rank, as 1F1B's first stage.
- ``zbv``, ``dualpipev``       the V schedules: see ``schedule_v.py``.
- ``bfs``, ``interleaved-zb``  looped BFS and interleaved zero bubble: see ``schedule_bfs.py``.

Groups: a run of consecutive SEND/RECV actions in a table is one batched point-to-point group
(one ``batch_isend_irecv``, one handle), as the executor posts it; an action with
``new_group`` starts a new group even right after another point-to-point action
(:func:`group_end` is the one rule, for the executor and :func:`simulate` alike).

The new schedules' point-to-point actions are placed by :func:`timed_tables` from their compute
orders: the orders run with unit costs; every message gets the time its producer ends; each
rank's actions are sorted by time, messages at one time by one key for all ranks. Every rank
then posts its messages in one global order, each receive before the compute that needs it and
each send after the compute that made it, which cannot deadlock under NCCL's rule when every
message is a group of its own (the earliest unfinished message is at the head of both ranks'
streams, and no host waits for a later one); messages of one time share a group where
:func:`simulate` confirms that this too completes (else every message stays alone). Receives
that are a group of their own are then posted one compute early.

``simulate`` replays the tables with unit costs (F = 1, B = 2, I = W = 1, chunks / v) under
NCCL's rule for groups, the strictest of the backends: a rank's groups run one after another
(the communication stream), a group completes only when every send and receive in it is matched
by the peer's group having started, and a pair's messages match in the order they were posted
(no tags); posting a group never blocks the rank, a compute action waits for the group holding
its input (or, on its own rank, for the compute that made it). ``latency``: the time a group
takes once matched (0: transfers are free). It returns the ideal bubble fraction, or raises on
a deadlock or on a receive that would get another message than the table says. Ideal bubble
of AFAB and 1F1B: (p - 1) / (m + p - 1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..layout import SCHEDULES, V_SCHEDULES, schedule_problems
from .schedule_bfs import bfs_order, interleaved_zb_order
from .schedule_v import dualpipev_order, zbv_order

COMPUTE = ("F", "B", "I", "W")
Order = list[tuple[str, int, int]]


@dataclass(frozen=True)
class Action:
    op: str  # F B I W SEND_F RECV_F SEND_B RECV_B
    mb: int
    stage: int
    peer: int = -1  # pp rank on the other side of a send/recv
    # point-to-point: start a new group even right after another point-to-point action
    new_group: bool = False
    # B: overlapped with the F right before it (DualPipeV's paired step; overlapped_pairs)
    overlap: bool = False

    def __str__(self) -> str:
        peer = f"->{self.peer}" if self.op.startswith("SEND") else (
            f"<-{self.peer}" if self.op.startswith("RECV") else "")
        mark = "|" if self.new_group else ("+" if self.overlap else "")
        return f"{mark}{self.op}{self.mb}s{self.stage}{peer}"


def is_p2p(a: Action) -> bool:
    return a.op[:4] in ("SEND", "RECV")


def group_end(acts: list[Action], i: int) -> int:
    """End (exclusive) of the point-to-point group starting at ``acts[i]``: the run of
    consecutive SEND/RECV actions, cut before an action marked ``new_group``."""
    j = i + 1
    while j < len(acts) and is_p2p(acts[j]) and not acts[j].new_group:
        j += 1
    return j


def overlapped_pairs(acts: list[Action]) -> list[tuple[Action, Action]]:
    """(F, B) pairs of a rank's table run as one overlapped step (DualPipeV)."""
    return [(acts[i - 1], a) for i, a in enumerate(acts) if a.overlap]


# ---------------------------------------------------------------------- placement
def stage_rank(schedule: str, s: int, pp: int) -> int:
    """The pipeline rank holding stage ``s``: ``s % pp``; in a V (zbv, dualpipev) stage s for
    s < pp and ``2 pp - 1 - s`` otherwise."""
    if schedule in V_SCHEDULES:
        return s if s < pp else 2 * pp - 1 - s
    return s % pp


def rank_stages(schedule: str, r: int, pp: int, v: int) -> list[int]:
    """The stages rank ``r`` holds, in chunk order (the inverse of :func:`stage_rank`)."""
    return [s for s in range(pp * v) if stage_rank(schedule, s, pp) == r]


# ---------------------------------------------------------------------- compute orders
def _afab(pp: int, m: int, r: int) -> list[tuple[str, int, int]]:
    return [("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)]


def _one_f_one_b(pp: int, m: int, r: int, split: bool = False) -> list[tuple[str, int, int]]:
    warmup = min(pp - r - 1, m)
    out: list[tuple[str, int, int]] = [("F", i, r) for i in range(warmup)]
    back = 0
    pending_w: list[int] = []
    delay = r  # ZB-H1: rank r idles r backward slots at the end; its deferred W passes fill them

    def backward(i: int) -> None:
        if not split:
            out.append(("B", i, r))
            return
        out.append(("I", i, r))
        pending_w.append(i)
        if len(pending_w) > delay:
            out.append(("W", pending_w.pop(0), r))

    for i in range(warmup, m):  # steady state: one forward, one backward
        out.append(("F", i, r))
        backward(back)
        back += 1
    while back < m:  # cool-down
        backward(back)
        back += 1
    out += [("W", i, r) for i in pending_w]
    return out


def _interleaved_warmup(pp: int, m: int, v: int, r: int) -> int:
    """Forwards before rank r's first backward (Megatron-Core: all of them when m == pp)."""
    total = m * v
    return total if m == pp else min((pp - r - 1) * 2 + (v - 1) * pp, total)


def _interleaved(pp: int, m: int, v: int, r: int) -> list[tuple[str, int, int]]:
    total = m * v

    def fwd(k: int) -> tuple[str, int, int]:
        chunk = (k // pp) % v
        return ("F", (k // (pp * v)) * pp + k % pp, chunk * pp + r)

    def bwd(k: int) -> tuple[str, int, int]:
        chunk = v - 1 - (k // pp) % v
        return ("B", (k // (pp * v)) * pp + k % pp, chunk * pp + r)

    warmup = _interleaved_warmup(pp, m, v, r)
    out = [fwd(k) for k in range(warmup)]
    b = 0
    for k in range(warmup, total):
        out.append(fwd(k))
        out.append(bwd(b))
        b += 1
    out += [bwd(k) for k in range(b, total)]
    return out


def compute_order(schedule: str, pp: int, m: int, v: int, r: int) -> Order:
    """Rank ``r``'s compute actions in order, ``(op, micro-batch, stage)`` (``B+``: a backward
    overlapped with the forward before it)."""
    if schedule not in SCHEDULE_DEFS:
        raise ValueError(f"unknown schedule {schedule!r} (valid: {', '.join(SCHEDULES)})")
    return SCHEDULE_DEFS[schedule].order(pp, m, v, r)


def check_args(schedule: str, pp: int, m: int, v: int) -> None:
    """Raise ValueError naming the problem for an impossible (schedule, pp, m, v)."""
    problems = schedule_problems(schedule, pp, m, v)
    if problems:
        raise ValueError(problems[0])


def build_schedule(schedule: str, pp: int, m: int, v: int = 1) -> list[list[Action]]:
    """Every rank's actions, point-to-point included, for ``m`` micro-batches."""
    check_args(schedule, pp, m, v)
    return SCHEDULE_DEFS[schedule].build(schedule, pp, m, v)


def tables_from_order(schedule: str, pp: int, m: int, v: int = 1) -> list[list[Action]]:
    """Tables with each receive right before the compute that needs it and each send right
    after the compute that made it (1F1B, ZB; AFAB before its early receives). For
    interleaved these groups deadlock under NCCL's rule whenever m > pp (kept to show it:
    tests/test_schedules.py)."""
    n_stages = pp * v
    tables = []
    for r in range(pp):
        acts: list[Action] = []
        for op, mb, s in compute_order(schedule, pp, m, v, r):
            prev = stage_rank(schedule, s - 1, pp) if s > 0 else r
            nxt = stage_rank(schedule, s + 1, pp) if s < n_stages - 1 else r
            if op == "F":
                if prev != r:
                    acts.append(Action("RECV_F", mb, s, prev))
                acts.append(Action("F", mb, s))
                if nxt != r:
                    acts.append(Action("SEND_F", mb, s, nxt))
            elif op in ("B", "I"):
                if nxt != r:
                    acts.append(Action("RECV_B", mb, s, nxt))
                acts.append(Action(op, mb, s))
                if prev != r:
                    acts.append(Action("SEND_B", mb, s, prev))
            else:
                acts.append(Action(op, mb, s))
        tables.append(acts)
    return tables


def hoist_receives(tables: list[list[Action]], lookahead: int = 1) -> list[list[Action]]:
    """Post each receive that is a group of its own right after a compute up to ``lookahead``
    computes earlier (never past another point-to-point action), as a group of its own.

    A rank's groups keep their order and content, so the tables stay as deadlock-free as they
    were; the receive is in flight while those computes run instead of after them."""
    out = []
    for acts in tables:
        acts = list(acts)
        i = 0
        while i < len(acts):
            if not is_p2p(acts[i]):
                i += 1
                continue
            j = group_end(acts, i)
            if j - i == 1 and acts[i].op.startswith("RECV") and i > 0 and not is_p2p(acts[i - 1]):
                k, passed = i, 0
                while k > 0 and not is_p2p(acts[k - 1]) and passed < lookahead:
                    k -= 2 if acts[k - 1].overlap else 1  # (an overlapped pair as one)
                    passed += 1
                acts.insert(k, replace(acts.pop(i), new_group=True))  # (a compute follows it)
            i = j
        out.append(acts)
    return out


UNIT_COST = {"F": 1, "B": 2, "I": 1, "W": 1}


def _producer_deps(op: str, mb: int, s: int, n_stages: int) -> list[tuple[str, int, int]]:
    """Events a compute action needs: ("F", mb, s) the forward output of stage s, ("B", mb, s)
    the input gradient of stage s (its B or I), ("I", mb, s) its I (for W)."""
    if op == "F":
        return [("F", mb, s - 1)] if s > 0 else []
    if op in ("B", "I"):
        return [("F", mb, s)] + ([("B", mb, s + 1)] if s < n_stages - 1 else [])
    return [("I", mb, s)]


def timed_tables(orders: list[Order], owner: Callable[[int], int], n_stages: int,
                 lookahead: int = 1) -> list[list[Action]]:
    """Tables with the point-to-point actions of compute ``orders`` placed by time (see the
    module docstring); raises RuntimeError when the orders wait on each other in a cycle."""
    pp = len(orders)
    units: list[list[list[tuple[str, int, int, bool]]]] = []
    for order in orders:
        us: list[list[tuple[str, int, int, bool]]] = []
        for op, mb, s in order:
            if op == "B+":
                if not us or us[-1][0][0] != "F" or len(us[-1]) > 1:
                    raise ValueError(f"B+ of micro-batch {mb} does not follow a forward")
                us[-1].append(("B", mb, s, True))
            else:
                us.append([(op, mb, s, False)])
        units.append(us)
    # 1. run the orders with unit costs
    ready: dict[tuple[str, int, int], int] = {}
    starts: list[list[int]] = [[] for _ in range(pp)]
    ends: list[list[int]] = [[] for _ in range(pp)]
    pos, clock = [0] * pp, [0] * pp
    while any(pos[r] < len(units[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(units[r]):
                unit = units[r][pos[r]]
                need = [d for op, mb, s, _ in unit for d in _producer_deps(op, mb, s, n_stages)]
                if any(d not in ready for d in need):
                    break
                start = max([clock[r], *(ready[d] for d in need)])
                end = start + sum(UNIT_COST[op] for op, *_ in unit)
                for op, mb, s, _ in unit:
                    ready[("B" if op in ("B", "I") else op, mb, s)] = end
                    if op == "I":
                        ready[("I", mb, s)] = end
                starts[r].append(start)
                ends[r].append(end)
                clock[r], pos[r], moved = end, pos[r] + 1, True
        if not moved:
            waiting = {r: units[r][pos[r]][0][:3] for r in range(pp) if pos[r] < len(units[r])}
            raise RuntimeError(f"the compute orders wait on each other: {waiting}")
    # 2. the messages, at the time their producer ends, in one order for every rank
    items: list[list[tuple[tuple, object]]] = [[] for _ in range(pp)]
    for r in range(pp):
        for idx, unit in enumerate(units[r]):
            items[r].append(((starts[r][idx], 1, idx), unit))
            for op, mb, s, _ in unit:
                if op == "F" and s < n_stages - 1 and owner(s + 1) != r:
                    kind, to, there = "F", owner(s + 1), s + 1
                elif op in ("B", "I") and s > 0 and owner(s - 1) != r:
                    kind, to, there = "B", owner(s - 1), s - 1
                else:
                    continue
                key = (ends[r][idx], 0, kind, mb, s)
                items[r].append((key, Action(f"SEND_{kind}", mb, s, to)))
                items[to].append((key, Action(f"RECV_{kind}", mb, there, r)))
    for merge in (True, False):
        tables = []
        for r in range(pp):
            acts: list[Action] = []
            last_time = None
            for key, item in sorted(items[r], key=lambda kv: kv[0]):
                if isinstance(item, Action):
                    # a new group unless the previous action is a message of the same time
                    same = merge and acts and is_p2p(acts[-1]) and last_time == key[0]
                    acts.append(replace(item, new_group=not same))
                    last_time = key[0]
                else:
                    acts += [Action(op, mb, s, overlap=ov) for op, mb, s, ov in item]
                    last_time = None
            tables.append(acts)
        tables = hoist_receives(tables, lookahead)
        try:
            simulate(tables)
        except RuntimeError:
            if not merge:
                raise
            continue
        return tables
    raise AssertionError("unreachable")


def _afab_tables(pp: int, m: int) -> list[list[Action]]:
    """AFAB with early receives: each rank keeps the receive of the next micro-batch posted
    while it computes the current one (forwards: the input; backwards: the output gradient),
    every send and receive a group of its own. The stream of a middle rank runs
    ``RECV i+1, SEND i-1 ... SEND i, RECV i+2``: a send waits behind the receive posted before
    it, which the upstream rank matches as it finishes the same step, so in a pipeline of
    equal stages no rank waits between two forwards (or two backwards)."""
    tables = []
    for r in range(pp):
        acts: list[Action] = []
        for op, kind, src, dst in (("F", "F", r - 1, r + 1), ("B", "B", r + 1, r - 1)):
            has_src, has_dst = 0 <= src < pp, 0 <= dst < pp
            if has_src:
                acts.append(Action(f"RECV_{kind}", 0, r, src, new_group=True))
            for i in range(m):
                if has_src and i + 1 < m:
                    acts.append(Action(f"RECV_{kind}", i + 1, r, src, new_group=True))
                acts.append(Action(op, i, r))
                if has_dst:
                    acts.append(Action(f"SEND_{kind}", i, r, dst, new_group=True))
        tables.append(acts)
    return tables


def _interleaved_tables(pp: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B with Megatron-Core's grouping (see the module docstring).

    Each group's receives are written first without identity ("the next message from the
    previous / next rank"); they are then named by matching every pair's sends in order.
    """
    return _name_receives([_interleaved_rank(pp, m, v, r) for r in range(pp)])


def _interleaved_rank(pp: int, m: int, v: int, r: int) -> list[Action]:
    total = m * v
    first, last = r == 0, r == pp - 1
    warm = _interleaved_warmup(pp, m, v, r)
    all_warm = warm == total
    acts: list[Action] = []

    def chunk(k: int, forward: bool) -> int:
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    def compute(op: str, k: int) -> Action:
        return Action(op, (k // (pp * v)) * pp + k % pp, chunk(k, op == "F") * pp + r)

    def group(fk: int | None, bk: int | None, recv_prev: bool, recv_next: bool) -> None:
        if fk is not None and not (last and chunk(fk, True) == v - 1):
            f = compute("F", fk)
            acts.append(Action("SEND_F", f.mb, f.stage, (r + 1) % pp))
        if bk is not None and not (first and chunk(bk, False) == 0):
            b = compute("B", bk)
            acts.append(Action("SEND_B", b.mb, b.stage, (r - 1) % pp))
        if recv_prev:
            acts.append(Action("RECV_F", -1, -1, (r - 1) % pp))
        if recv_next:
            acts.append(Action("RECV_B", -1, -1, (r + 1) % pp))

    if not first:
        group(None, None, True, False)
    for k in range(warm):  # warm-up: send the output, receive the next input
        acts.append(compute("F", k))
        recv_prev = not (first and chunk(k + 1, True) == 0) and k != total - 1
        group(k, None, recv_prev, k == warm - 1 and not all_warm and not last)
    for k in range(total - warm):  # steady state: one forward, one backward, one group
        fk = k + warm
        acts += [compute("F", fk), compute("B", k)]
        # the first rank takes the last rank's output pp - 1 iterations late (and the last
        # rank the first rank's gradient): nothing comes when that was the last chunk
        recv_prev = not (first and chunk(fk - (pp - 1), True) == v - 1)
        recv_next = not (last and chunk(k - (pp - 1), False) == 0)
        group(fk, k, recv_prev and k != total - warm - 1, recv_next)
    if all_warm and not last:
        group(None, None, False, True)
    for k in range(total - warm, total):  # cool-down: send the gradient, receive the next
        acts.append(compute("B", k))
        recv_next = not (last and chunk(k + 1, False) == v - 1) and k != total - 1
        group(None, k, False, recv_next)
    return acts


def _name_receives(tables: list[list[Action]]) -> list[list[Action]]:
    """Give each anonymous receive the identity of the send it matches (per pair and kind, in
    order); :func:`simulate` checks that the pair's order across kinds agrees too."""
    queues: dict[tuple[int, int, str], list[Action]] = {}
    for r, acts in enumerate(tables):
        for a in acts:
            if a.op.startswith("SEND"):
                queues.setdefault((r, a.peer, a.op[-1]), []).append(a)
    out = []
    for r, acts in enumerate(tables):
        named = []
        for a in acts:
            if a.op.startswith("RECV") and a.mb < 0:
                queue = queues.get((a.peer, r, a.op[-1]))
                if not queue:
                    raise RuntimeError(f"rank {r}: {a.op} from rank {a.peer} matches no send")
                sent = queue.pop(0)
                a = Action(a.op, sent.mb, sent.stage + (1 if a.op == "RECV_F" else -1), a.peer)
            named.append(a)
        out.append(named)
    if any(queues.values()):
        raise RuntimeError("a send of the interleaved tables matches no receive")
    return out


# ---------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class ScheduleDef:
    """One schedule: rank r's compute order ``order(pp, m, v, r)``, its tables
    ``build(name, pp, m, v)`` and whether its backward is split into I and W (``split``: the
    executor captures the linear layers' inputs and output gradients; a ``B`` in such a table
    runs as I then W)."""

    order: Callable[[int, int, int, int], Order]
    build: Callable[[str, int, int, int], list[list[Action]]]
    split: bool = False


def _timed(name: str, pp: int, m: int, v: int) -> list[list[Action]]:
    orders = [compute_order(name, pp, m, v, r) for r in range(pp)]
    return timed_tables(orders, lambda s: stage_rank(name, s, pp), pp * v)


# what a point-to-point group takes once matched, in forwards of one chunk, when the two
# groupings of interleaved 1F1B are compared (``_interleaved_best``): transfers that are not
# free, as on any network, but shorter than the compute they should hide behind
GROUPING_LATENCY = 0.1


def _interleaved_best(pp: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B's tables: Megatron-Core's grouping (``_interleaved_tables``: a
    forward's output is sent with the next backward's gradient, after both) or the messages
    placed by time (``timed_tables``: each sent as soon as it is made), whichever
    :func:`simulate` finishes sooner with transfers of :data:`GROUPING_LATENCY`; Megatron-
    Core's on a tie. Sending each output as soon as it is made wins at every m > pp at pp 2
    (the neighbour waits for it) and at v = 2 for some m up to pp 6; batching four messages
    in one group wins where more chunks queue more groups (pp 4, v >= 3). Both are
    deadlock-free under NCCL's rule."""
    if _timed_interleaved_faster(pp, m, v):
        return _timed("interleaved", pp, m, v)
    return _interleaved_tables(pp, m, v)


@functools.lru_cache(maxsize=256)
def _timed_interleaved_faster(pp: int, m: int, v: int) -> bool:
    if m == pp:  # all forwards first: nothing to send earlier
        return False
    timed = _timed("interleaved", pp, m, v)
    megatron = _interleaved_tables(pp, m, v)
    return (simulate(timed, v, GROUPING_LATENCY)["time"]
            < simulate(megatron, v, GROUPING_LATENCY)["time"] - 1e-6)  # (not on rounding)


SCHEDULE_DEFS: dict[str, ScheduleDef] = {
    "afab": ScheduleDef(lambda pp, m, v, r: _afab(pp, m, r),
                        lambda _n, pp, m, v: _afab_tables(pp, m)),
    "1f1b": ScheduleDef(lambda pp, m, v, r: _one_f_one_b(pp, m, r), tables_from_order),
    "interleaved": ScheduleDef(_interleaved, lambda _n, pp, m, v: _interleaved_best(pp, m, v)),
    "zb": ScheduleDef(lambda pp, m, v, r: _one_f_one_b(pp, m, r, split=True), tables_from_order,
                      split=True),
    "zbv": ScheduleDef(lambda pp, m, v, r: zbv_order(pp, m, r), _timed, split=True),
    "dualpipev": ScheduleDef(lambda pp, m, v, r: dualpipev_order(pp, m, r), _timed, split=True),
    "bfs": ScheduleDef(bfs_order, _timed),
    "interleaved-zb": ScheduleDef(interleaved_zb_order, _timed, split=True),
}
assert set(SCHEDULE_DEFS) == set(SCHEDULES), "every schedule of layout.SCHEDULES registered"


# ---------------------------------------------------------------------- simulation
COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass
class _Group:
    """One posted point-to-point group of a rank during :func:`simulate`."""

    rank: int
    ops: list[tuple[Action, tuple[int, int], int]]  # action, (sender, receiver), index on pair
    posted: float
    start: float | None = None
    done: float | None = None


def _message(a: Action, rank: int) -> tuple[str, int, int, int]:
    """(kind, micro-batch, sending stage, sending rank) of the message a SEND/RECV moves."""
    if a.op.startswith("SEND"):
        return a.op[-1], a.mb, a.stage, rank
    return a.op[-1], a.mb, a.stage - 1 if a.op == "RECV_F" else a.stage + 1, a.peer


def simulate(tables: list[list[Action]], v: int = 1, latency: float = 0.0) -> dict:
    """Replay the tables (see module docstring). Returns per-rank intervals and the bubble."""
    pp = len(tables)
    n_stages = max((a.stage for acts in tables for a in acts), default=0) + 1
    owner: dict[int, int] = {}  # stage -> the rank computing it
    for r, acts in enumerate(tables):
        for a in acts:
            if a.op in COMPUTE:
                owner.setdefault(a.stage, r)
    pos, clock = [0] * pp, [0.0] * pp
    groups: list[list[_Group]] = [[] for _ in range(pp)]
    current = [0] * pp  # first group of each rank that has not completed
    holder: dict[tuple[int, str, int, int], _Group] = {}  # (rank, kind, mb, stage) -> group
    posted_on_pair: dict[tuple[int, int, str], int] = {}  # ((sender, receiver), side) -> count
    by_slot: dict[tuple[tuple[int, int], str, int], tuple[_Group, Action]] = {}
    done: set[tuple[str, int, int]] = set()
    intervals: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    live, peak_live = [0] * pp, [0] * pp

    def post(r: int, run: list[Action]) -> None:
        g = _Group(r, [], clock[r])
        for a in run:
            pair = (r, a.peer) if a.op.startswith("SEND") else (a.peer, r)
            side = "send" if a.op.startswith("SEND") else "recv"
            idx = posted_on_pair.get((*pair, side), 0)
            posted_on_pair[(*pair, side)] = idx + 1
            g.ops.append((a, pair, idx))
            by_slot[(pair, side, idx)] = (g, a)
            if side == "recv":
                holder[(r, a.op[-1], a.mb, a.stage)] = g
        groups[r].append(g)

    def needs(a: Action, r: int) -> tuple[str, int, int] | None:
        """The received message a compute waits for (None: none, or made on this rank)."""
        if a.op == "F" and a.stage > 0:
            need, src, made = ("F", a.mb, a.stage), a.stage - 1, (("F", a.mb, a.stage - 1),)
        elif a.op in ("B", "I") and a.stage < n_stages - 1:
            need, src = ("B", a.mb, a.stage), a.stage + 1
            made = (("B", a.mb, src), ("I", a.mb, src))
        else:
            return None
        if owner.get(src) != r:
            return need
        if not any(x in done for x in made):
            raise RuntimeError(f"rank {r}: {a} before the compute that makes its input")
        return None

    def run_host(r: int) -> bool:
        moved = False
        acts = tables[r]
        while pos[r] < len(acts):
            a = acts[pos[r]]
            if is_p2p(a):
                end = group_end(acts, pos[r])
                post(r, acts[pos[r]:end])
                pos[r], moved = end, True
                continue
            if a.op == "W" and ("I", a.mb, a.stage) not in done:
                raise RuntimeError(f"rank {r}: {a} before its I pass")
            if a.op in ("B", "I") and ("F", a.mb, a.stage) not in done:
                raise RuntimeError(f"rank {r}: {a} before its forward")
            need = needs(a, r)
            if need is not None:
                g = holder.get((r, *need))
                if g is None:
                    what = "input" if need[0] == "F" else "output gradient"
                    raise RuntimeError(f"rank {r}: {a} before its {what} arrived")
                if g.done is None:
                    return moved  # waits for the group holding its input
                clock[r] = max(clock[r], g.done)
            end = clock[r] + COST[a.op] / v
            intervals[r].append((a, clock[r], end))
            clock[r] = end
            done.add((a.op, a.mb, a.stage))
            live[r] += 1 if a.op == "F" else (-1 if a.op in ("B", "W") else 0)
            peak_live[r] = max(peak_live[r], live[r])
            pos[r] += 1
            moved = True
        return moved

    def complete_groups() -> bool:
        moved = False
        changed = True
        while changed:
            changed = False
            for r in range(pp):
                while current[r] < len(groups[r]) and groups[r][current[r]].done is not None:
                    current[r] += 1
                if current[r] < len(groups[r]):
                    g = groups[r][current[r]]
                    before = groups[r][current[r] - 1].done if current[r] else 0.0
                    g.start = max(g.posted, before or 0.0)
            for r in range(pp):
                if current[r] >= len(groups[r]):
                    continue
                g = groups[r][current[r]]
                finish = g.start
                for a, pair, idx in g.ops:
                    other = by_slot.get((pair, "recv" if a.op.startswith("SEND") else "send", idx))
                    if other is None or other[0].start is None:
                        break  # the peer has not started the group holding the other side
                    og, oa = other
                    if _message(a, r) != _message(oa, og.rank):
                        raise RuntimeError(f"rank {r}: {a} would match {oa} of rank {og.rank}")
                    finish = max(finish, og.start)
                else:
                    g.done, changed, moved = finish + latency, True, True
        return moved

    while True:
        moved = any([run_host(r) for r in range(pp)])
        moved = complete_groups() or moved
        if all(pos[r] == len(tables[r]) and current[r] == len(groups[r]) for r in range(pp)):
            break
        if not moved:
            stuck = {r: str(tables[r][pos[r]]) if pos[r] < len(tables[r]) else (
                "end: group " + " ".join(str(a) for a, _, _ in groups[r][current[r]].ops))
                for r in range(pp) if pos[r] < len(tables[r]) or current[r] < len(groups[r])}
            raise RuntimeError(f"deadlock: ranks wait on {stuck}")
    total = max([*clock, *(g.done or 0.0 for gs in groups for g in gs)])
    busy = [sum(e - s for _, s, e in iv) for iv in intervals]
    return {"time": total, "busy": busy, "intervals": intervals, "peak_live": peak_live,
            "bubble": 1.0 - sum(busy) / (pp * total)}


def ideal_bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    return simulate(build_schedule(schedule, pp, m, v), v)["bubble"]


def format_table(tables: list[list[Action]]) -> str:
    """Human-readable per-rank action lists."""
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts)
                     for r, acts in enumerate(tables))
