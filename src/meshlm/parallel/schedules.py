"""Pipeline schedules as data: each is a pure function from (pp, micro-batches, virtual stages)
to every rank's ordered list of actions.

Actions: ``F`` forward, ``B`` backward, ``I`` backward for inputs, ``W`` backward for weights
(zero bubble splits B into I + W), and the point-to-point ``SEND_F``/``RECV_F`` (activations)
and ``SEND_B``/``RECV_B`` (gradients). Stage ``s`` of ``S = pp * v`` lives on rank ``s % pp``
(Megatron's interleaving), so virtual stage k of rank r is ``s = k * pp + r``.

- ``afab``        GPipe (Huang et al. 2019): all forwards, then all backwards; m live activations.
- ``1f1b``        PipeDream-flush (Narayanan et al. 2021): p - r - 1 warm-up forwards, then one
                  forward / one backward, then cool-down; at most p live micro-batches.
- ``interleaved`` Megatron's interleaved 1F1B with v chunks per rank (needs m % p == 0); ideal
                  bubble (p - 1) / (v m + p - 1). Its exchanges are grouped as Megatron-Core
                  groups them: after each warm-up forward one group sends the output and
                  receives the next input; in the steady state, after one forward and one
                  backward, one group sends both results and receives the next input and output
                  gradient -- what the neighbours send in their own group of that iteration,
                  used when its chunk comes (m == p: all forwards first, as Megatron-Core).
- ``zb``          ZB-H1 (Qi et al. 2023): 1F1B with each B split into I then a deferred W; rank
                  r, which idles r backward slots at the end of 1F1B, defers its W passes by r
                  micro-batches so they fill that bubble; the chain between stages runs through
                  I only; at most p live micro-batches per rank, as 1F1B's first stage.

Groups: a run of consecutive SEND/RECV actions in a table is one batched point-to-point group
(one ``batch_isend_irecv``, one handle), as the executor posts it.

``simulate`` replays the tables with unit costs (F = 1, B = 2, I = W = 1, chunks / v) under
NCCL's rule for groups, the strictest of the backends: a rank's groups run one after another
(the communication stream), a group completes only when every send and receive in it is matched
by the peer's group having started, and a pair's messages match in the order they were posted
(no tags); posting a group never blocks the rank, a compute action waits for the group holding
its input. It returns the ideal bubble fraction, or raises on a deadlock or on a receive that
would get another message than the table says. Ideal bubble of AFAB and 1F1B:
(p - 1) / (m + p - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import SCHEDULES, schedule_problems

COMPUTE = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Action:
    op: str  # F B I W SEND_F RECV_F SEND_B RECV_B
    mb: int
    stage: int
    peer: int = -1  # pp rank on the other side of a send/recv

    def __str__(self) -> str:
        peer = f"->{self.peer}" if self.op.startswith("SEND") else (
            f"<-{self.peer}" if self.op.startswith("RECV") else "")
        return f"{self.op}{self.mb}s{self.stage}{peer}"


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


def compute_order(schedule: str, pp: int, m: int, v: int, r: int) -> list[tuple[str, int, int]]:
    if schedule == "afab":
        return _afab(pp, m, r)
    if schedule == "1f1b":
        return _one_f_one_b(pp, m, r)
    if schedule == "zb":
        return _one_f_one_b(pp, m, r, split=True)
    if schedule == "interleaved":
        return _interleaved(pp, m, v, r)
    raise ValueError(f"unknown schedule {schedule!r} (valid: {', '.join(SCHEDULES)})")


def check_args(schedule: str, pp: int, m: int, v: int) -> None:
    """Raise ValueError naming the problem for an impossible (schedule, pp, m, v)."""
    problems = schedule_problems(schedule, pp, m, v)
    if problems:
        raise ValueError(problems[0])


def build_schedule(schedule: str, pp: int, m: int, v: int = 1) -> list[list[Action]]:
    """Every rank's actions, point-to-point included, for ``m`` micro-batches."""
    check_args(schedule, pp, m, v)
    if schedule == "interleaved":
        return _interleaved_tables(pp, m, v)
    return tables_from_order(schedule, pp, m, v)


def tables_from_order(schedule: str, pp: int, m: int, v: int = 1) -> list[list[Action]]:
    """Tables with each receive right before the compute that needs it and each send right
    after the compute that made it (AFAB, 1F1B, ZB). For interleaved these groups deadlock
    under NCCL's rule whenever m > pp (kept to show it: tests/test_schedules.py)."""
    n_stages = pp * v
    tables = []
    for r in range(pp):
        acts: list[Action] = []
        for op, mb, s in compute_order(schedule, pp, m, v, r):
            if op == "F":
                if s > 0:
                    acts.append(Action("RECV_F", mb, s, (s - 1) % pp))
                acts.append(Action("F", mb, s))
                if s < n_stages - 1:
                    acts.append(Action("SEND_F", mb, s, (s + 1) % pp))
            elif op in ("B", "I"):
                if s < n_stages - 1:
                    acts.append(Action("RECV_B", mb, s, (s + 1) % pp))
                acts.append(Action(op, mb, s))
                if s > 0:
                    acts.append(Action("SEND_B", mb, s, (s - 1) % pp))
            else:
                acts.append(Action(op, mb, s))
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


def simulate(tables: list[list[Action]], v: int = 1) -> dict:
    """Replay the tables (see module docstring). Returns per-rank intervals and the bubble."""
    pp = len(tables)
    n_stages = max((a.stage for acts in tables for a in acts), default=0) + 1
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

    def needs(a: Action) -> tuple[str, int, int] | None:
        if a.op == "F" and a.stage > 0:
            return ("F", a.mb, a.stage)
        if a.op in ("B", "I") and a.stage < n_stages - 1:
            return ("B", a.mb, a.stage)
        return None

    def run_host(r: int) -> bool:
        moved = False
        acts = tables[r]
        while pos[r] < len(acts):
            a = acts[pos[r]]
            if a.op[:4] in ("SEND", "RECV"):
                end = pos[r]
                while end < len(acts) and acts[end].op[:4] in ("SEND", "RECV"):
                    end += 1
                post(r, acts[pos[r]:end])
                pos[r], moved = end, True
                continue
            if a.op == "W" and ("I", a.mb, a.stage) not in done:
                raise RuntimeError(f"rank {r}: {a} before its I pass")
            if a.op in ("B", "I") and ("F", a.mb, a.stage) not in done:
                raise RuntimeError(f"rank {r}: {a} before its forward")
            need = needs(a)
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
                    g.done, changed, moved = finish, True, True
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
