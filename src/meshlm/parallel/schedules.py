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
                  bubble (p - 1) / (v m + p - 1).
- ``zb``          ZB-H1 (Qi et al. 2023): 1F1B with each B split into I then a deferred W; rank
                  r, which idles r backward slots at the end of 1F1B, defers its W passes by r
                  micro-batches so they fill that bubble; the chain between stages runs through
                  I only; at most p live micro-batches per rank, as 1F1B's first stage.

``simulate`` replays the tables with unit costs (F = 1, B = 2, I = W = 1, chunks / v), with
sends non-blocking and receives blocking -- the executor's semantics -- and returns the ideal
bubble fraction, or raises on a deadlock. Ideal bubble of AFAB and 1F1B: (p - 1) / (m + p - 1).
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


def _interleaved(pp: int, m: int, v: int, r: int) -> list[tuple[str, int, int]]:
    total = m * v

    def fwd(k: int) -> tuple[str, int, int]:
        chunk = (k // pp) % v
        return ("F", (k // (pp * v)) * pp + k % pp, chunk * pp + r)

    def bwd(k: int) -> tuple[str, int, int]:
        chunk = v - 1 - (k // pp) % v
        return ("B", (k // (pp * v)) * pp + k % pp, chunk * pp + r)

    warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
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


# ---------------------------------------------------------------------- simulation
COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def simulate(tables: list[list[Action]], v: int = 1) -> dict:
    """Replay the tables (see module docstring). Returns per-rank intervals and the bubble."""
    pp = len(tables)
    pos = [0] * pp
    clock = [0.0] * pp
    sent: dict[tuple[str, int, int], float] = {}  # (kind, mb, from_stage) -> time available
    done: dict[tuple[str, int, int], float] = {}
    received: set[tuple[str, int, int]] = set()  # (kind, mb, stage) received by stage's rank
    n_stages = max((a.stage for acts in tables for a in acts), default=0) + 1
    intervals: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    live, peak_live = [0] * pp, [0] * pp
    while any(pos[r] < len(tables[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(tables[r]):
                a = tables[r][pos[r]]
                start = clock[r]
                if a.op == "RECV_F":
                    key = ("F", a.mb, a.stage - 1)
                elif a.op == "RECV_B":
                    key = ("B", a.mb, a.stage + 1)
                else:
                    key = None
                if key is not None:
                    if key not in sent:
                        break  # blocked on a receive
                    clock[r] = max(clock[r], sent[key])
                    received.add((a.op[-1], a.mb, a.stage))
                    pos[r] += 1
                    progressed = True
                    continue
                if a.op == "SEND_F":
                    sent[("F", a.mb, a.stage)] = clock[r]
                elif a.op == "SEND_B":
                    sent[("B", a.mb, a.stage)] = clock[r]
                else:
                    if a.op == "W" and ("I", a.mb, a.stage) not in done:
                        raise RuntimeError(f"rank {r}: {a} before its I pass")
                    if a.op in ("B", "I") and ("F", a.mb, a.stage) not in done:
                        raise RuntimeError(f"rank {r}: {a} before its forward")
                    if a.op == "F" and a.stage > 0 and ("F", a.mb, a.stage) not in received:
                        raise RuntimeError(f"rank {r}: {a} before its input arrived")
                    if (a.op in ("B", "I") and a.stage < n_stages - 1
                            and ("B", a.mb, a.stage) not in received):
                        raise RuntimeError(f"rank {r}: {a} before its output gradient arrived")
                    end = start + COST[a.op] / v
                    intervals[r].append((a, start, end))
                    clock[r] = end
                    done[(a.op, a.mb, a.stage)] = end
                    live[r] += 1 if a.op == "F" else (-1 if a.op in ("B", "W") else 0)
                    peak_live[r] = max(peak_live[r], live[r])
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(tables[r][pos[r]]) for r in range(pp) if pos[r] < len(tables[r])}
            raise RuntimeError(f"deadlock: ranks wait on {stuck}")
    total = max(clock)
    busy = [sum(e - s for _, s, e in iv) for iv in intervals]
    return {"time": total, "busy": busy, "intervals": intervals, "peak_live": peak_live,
            "bubble": 1.0 - sum(busy) / (pp * total)}


def ideal_bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    return simulate(build_schedule(schedule, pp, m, v), v)["bubble"]


def format_table(tables: list[list[Action]]) -> str:
    """Human-readable per-rank action lists."""
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts)
                     for r, acts in enumerate(tables))
