"""The executor's host time between computes and the transfer time in the schedule model
(``parallel/schedule_cost.py``): ``replay_tables`` runs the action tables as the executor
does, and with NCCL's posted order it is ``schedules.simulate`` exactly; ``bubble`` with both
terms 0 is the closed form, and each compute pays the overhead once (so a schedule with v
chunks per rank pays it v times per micro-batch). Single process, torch-free; seconds."""

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
