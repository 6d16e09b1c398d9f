"""The executor's host time between computes and the transfer time in the schedule model
(``parallel/schedule_cost.py``): ``replay_tables`` runs the action tables as the executor
does, and with NCCL's posted order it is ``schedules.simulate`` exactly; ``bubble`` with both
terms 0 is the closed form, and each compute pays the overhead once (so a schedule with v
chunks per rank pays it v times per micro-batch); a posting cost per send or receive adds
exactly the posted ops on the critical path (worked by hand on 2-stage 1F1B), a rank's late
start only where it delays the path, and the replay with each action's own costs given one by
one is the replay with the constants. Single process, torch-free; seconds."""

from __future__ import annotations

import pytest

from meshlm import layout
from meshlm.parallel import schedules
from meshlm.parallel.schedule_cost import SCHEDULES, replay_tables

SPLITS = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (0.8, 1.4, 0.6)]


def chunks(name: str) -> int:
    return 2 if name in (*layout.V_SCHEDULES, *layout.LOOPED_SCHEDULES) else 1


@pytest.mark.parametrize("name", layout.SCHEDULES)
def test_ordered_replay_is_simulate(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's rule: the tables replayed with each stage's costs give simulate's step and each
    rank's compute, with and without a transfer time, p = 2 and 4, every m to 2p + 1."""
    v = chunks(name)
    for split in SPLITS:
        f, i, w = split
        for op, cost in (("F", f), ("B", i + w), ("I", i), ("W", w)):
            monkeypatch.setitem(schedules.COST, op, cost)
        for p in (2, 4):
            for m in range(1, 2 * p + 2):
                if layout.schedule_problems(name, p, m, v):
                    continue
                for latency in (0.0, 0.3):
                    sim = schedules.simulate(schedules.build_schedule(name, p, m, v), v, latency)
                    time, busy = replay_tables(name, p, v, m, [tuple(x / v for x in split)]
                                               * (p * v), latency, ordered=True)
                    assert time == pytest.approx(sim["time"], abs=1e-9), (p, m, split, latency)
                    assert busy == pytest.approx(sim["busy"], abs=1e-9)


@pytest.mark.parametrize("name", layout.SCHEDULES)
def test_host_terms(name: str) -> None:
    """Both terms 0: the closed form (or the replay) as before; a positive overhead adds at
    least (m v - 1) overheads to the busiest rank's idle time, a transfer time adds idle
    time, and the gloo replay is never slower than NCCL's ordered one."""
    cost, v, p = SCHEDULES[name], chunks(name), 4
    m = 2 * p
    t = 3.0
    free = cost.bubble((p - 1) * t, v, p, m)
    assert cost.bubble((p - 1) * t, v, p, m, overhead=1e-12) == pytest.approx(free, abs=1e-6)
    o = 0.01
    with_o = cost.bubble((p - 1) * t, v, p, m, overhead=o)
    assert with_o >= free + (m * v - 1) * o - 1e-9
    assert cost.bubble((p - 1) * t, v, p, m, latency=0.05) > free
    stages = [(1.0 / v, 1.0 / v, 1.0 / v)] * (p * v)
    gloo = replay_tables(name, p, v, m, stages, 0.05, o)[0]
    assert gloo <= replay_tables(name, p, v, m, stages, 0.05, o, ordered=True)[0] + 1e-9


def test_extrapolated_beyond_the_replayed_rounds() -> None:
    """Beyond REPLAY_ROUNDS p micro-batches the idle time with host terms grows linearly."""
    cost = SCHEDULES["1f1b"]
    p, o = 2, 0.01
    idle = [cost.bubble(3.0, 1, p, m, overhead=o) for m in (12, 14, 16)]
    assert idle[2] - idle[1] == pytest.approx(idle[1] - idle[0], rel=1e-6)
    assert idle[0] > cost.bubble(3.0, 1, p, 12)


STAGES = [(1.0, 1.0, 1.0)] * 2  # 1F1B, p = 2: forward 1, backward 2 on either stage


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_posting_cost_on_the_critical_path(m: int) -> None:
    """A host cost c per posted send or receive on 2-stage 1F1B (forward 1, backward 2,
    transfers free): the step is (m + 1) 3 + 2 m c. By hand: the path runs F0 on rank 0,
    its send (c), then on rank 1 each micro-batch's F and B and the group after it -- the
    gradient's send and the next activation's receive (2c), the last send alone (c) -- and
    B of the last micro-batch on rank 0; rank 1's first receive is posted before F0 ends."""
    c = 0.01
    time, busy = replay_tables("1f1b", 2, 1, m, STAGES, post=c)
    assert time == pytest.approx((m + 1) * 3 + 2 * m * c, abs=1e-12)
    assert busy == pytest.approx([3.0 * m] * 2, abs=1e-12)
    # the planner's form: the busiest rank's idle time, the same replay
    idle = SCHEDULES["1f1b"].bubble(3.0, 1, 2, m, (1.0, 1.0, 1.0), [3.0, 3.0], post=c,
                                    ordered=False)
    assert idle == pytest.approx(3 + 2 * m * c, abs=1e-12)


def test_starts() -> None:
    """By hand, 1F1B, p = 2, m = 2 (forward 1, backward 2; step 9): rank 1 entering the
    step at 2.5 starts F0 then instead of at 1 (the step 1.5 later); entering at 0.5, before
    F0's activation arrives at 1, changes nothing."""
    assert replay_tables("1f1b", 2, 1, 2, STAGES)[0] == pytest.approx(9.0)
    assert replay_tables("1f1b", 2, 1, 2, STAGES, starts=(0.0, 2.5))[0] == pytest.approx(10.5)
    assert replay_tables("1f1b", 2, 1, 2, STAGES, starts=(0.0, 0.5))[0] == pytest.approx(9.0)


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zbv", "dualpipev"])
def test_own_costs_replay_as_the_constants(name: str) -> None:
    """``each`` and ``delivery`` giving every action and message the constants' values
    replay the same step as the constants; giving None falls back to them."""
    v, p, m = chunks(name), 4, 8
    stages = [(0.3, 0.4, 0.2)] * (p * v)
    kw = {"latency": 0.05, "overhead": 0.01, "post": 0.02, "starts": (0.0, 0.01, 0.03, 0.02)}
    ref = replay_tables(name, p, v, m, stages, **kw)

    def each(r: int, a: schedules.Action) -> float:
        if schedules.is_p2p(a):
            return 0.02
        f, i, w = stages[a.stage]
        return {"F": f, "B": i + w, "I": i, "W": w}[a.op]

    own = replay_tables(name, p, v, m, stages, **kw, each=each,
                        delivery=lambda a: 0.05)
    none = replay_tables(name, p, v, m, stages, **kw, each=lambda r, a: None,
                         delivery=lambda a: None)
    for got in (own, none):
        assert got[0] == pytest.approx(ref[0], abs=1e-12)
        assert got[1] == pytest.approx(ref[1], abs=1e-12)
