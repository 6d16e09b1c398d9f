"""Pipeline schedule tables, checked without running a model."""

from __future__ import annotations

import itertools

import pytest

from meshlm.layout import LOOPED_SCHEDULES, V_SCHEDULES, schedule_problems
from meshlm.parallel.pipeline import partition_layers
from meshlm.parallel.schedules import (
    SCHEDULE_DEFS,
    SCHEDULES,
    build_schedule,
    simulate,
    stage_rank,
)


def chunks(schedule: str) -> int:
    """Chunks per rank of the cases below: 2 for the V and the looped schedules."""
    return 2 if schedule in (*V_SCHEDULES, *LOOPED_SCHEDULES) else 1


CASES = [(s, pp, m, chunks(s))
         for s, pp, m in itertools.product(SCHEDULES, (2, 3, 4, 8), (1, 2, 4, 8, 12, 16))
         if not schedule_problems(s, pp, m, chunks(s))]


@pytest.mark.parametrize("schedule,pp,m,v", CASES)
def test_tables_are_complete_ordered_and_matched(schedule: str, pp: int, m: int, v: int) -> None:
    tables = build_schedule(schedule, pp, m, v)
    n_stages = pp * v
    computes: dict[str, set] = {op: set() for op in "FBIW"}
    sends, recvs = set(), set()
    for r, acts in enumerate(tables):
        seen: set = set()
        for a in acts:
            if a.op in "FBIW":
                assert stage_rank(schedule, a.stage, pp) == r  # the schedule's placement
                computes[a.op].add((a.mb, a.stage))
                if a.op in ("B", "I"):
                    assert ("F", a.mb, a.stage) in seen, f"rank {r}: {a} before its forward"
                if a.op == "W":
                    assert ("I", a.mb, a.stage) in seen, f"rank {r}: {a} before its I"
                seen.add((a.op, a.mb, a.stage))
            elif a.op.startswith("SEND"):
                sends.add((a.op[-1], a.mb, a.stage, r, a.peer))
            else:
                recvs.add((a.op[-1], a.mb, a.stage, r, a.peer))
    every = {(mb, s) for mb in range(m) for s in range(n_stages)}
    assert computes["F"] == every
    if schedule in ("zb", "zbv", "interleaved-zb"):
        assert computes["I"] == every and computes["W"] == every and not computes["B"]
    elif schedule == "dualpipev":  # full backwards, and the later ones split
        assert computes["B"] | computes["I"] == every and not computes["B"] & computes["I"]
        assert computes["W"] == computes["I"] != set()
    else:
        assert computes["B"] == every and not computes["I"] and not computes["W"]
    # each compute exactly once
    assert sum(a.op in "FBIW" for acts in tables for a in acts) == sum(map(len, computes.values()))
    # every send has exactly one matching receive on the peer, for the neighbouring stage
    matched = {("F", mb, s + 1, peer, r) for (_, mb, s, r, peer) in sends if _ == "F"} | {
        ("B", mb, s - 1, peer, r) for (_, mb, s, r, peer) in sends if _ == "B"}
    assert matched == recvs
    # a boundary between two ranks moves each micro-batch once each way (none at a V's turn)
    crossing = sum(stage_rank(schedule, s, pp) != stage_rank(schedule, s + 1, pp)
                   for s in range(n_stages - 1))
    assert len(sends) == len(recvs) == 2 * m * crossing


@pytest.mark.parametrize("schedule,pp,m,v", CASES)
def test_no_deadlock_and_ideal_bubble(schedule: str, pp: int, m: int, v: int) -> None:
    result = simulate(build_schedule(schedule, pp, m, v), v)  # raises on a deadlock
    bubble = result["bubble"]
    if schedule in ("afab", "1f1b"):
        assert bubble == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    elif schedule in ("interleaved", "bfs"):
        assert bubble == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)
    elif schedule in ("zbv", "interleaved-zb") and m >= 2 * pp:
        # near zero bubble with F = I = W: the idle time of a rank is the others' micro-batch
        # times 3 (p - 1) split into 6 (ZB-V) or 3 v parts (1F1B: not split)
        idle = 3 * (pp - 1) / (6 if schedule == "zbv" else 3 * v)
        assert bubble == pytest.approx(idle / (3 * m + idle), abs=1e-12)
    elif schedule == "dualpipev":  # (its overlapped pairs run one after the other here)
        idle = 3 * (pp - 1) / 3
        assert bubble == pytest.approx(idle / (3 * m + idle), abs=1e-12)
    else:
        one_f_one_b = simulate(build_schedule("1f1b", pp, m, 1))["bubble"]
        assert bubble < one_f_one_b  # zero bubble fills the cool-down with W passes
    peak = result["peak_live"]
    if schedule == "afab":
        assert peak[0] == m
    if schedule in ("1f1b", "zb"):
        assert max(peak) <= pp and peak[0] == min(pp, m)


def test_broken_tables_are_detected() -> None:
    r0, r1 = build_schedule("1f1b", 2, 1)  # r0: F SEND_F RECV_B B; r1: RECV_F F B SEND_B
    assert [a.op for a in r0] == ["F", "SEND_F", "RECV_B", "B"]
    # rank 0 waits for a gradient before sending the activation that produces it
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate([[r0[2], r0[0], r0[1], r0[3]], r1])
    # rank 1 computes a forward without receiving its input
    with pytest.raises(RuntimeError, match="before its input arrived"):
        simulate([r0, r1[1:]])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="divisible"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="pp_virtual"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("gpipe", 2, 4)


def test_partition() -> None:
    assert partition_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # 5 layers over 4 stages: the extra layer goes to a middle stage (the ends hold the
    # embedding and the head)
    assert [len(s) for s in partition_layers(5, 4)] == [1, 2, 1, 1]
    assert partition_layers(5, 2, "2,3") == [[0, 1], [2, 3, 4]]
    with pytest.raises(ValueError, match="summing to model.n_layers=5"):
        partition_layers(5, 2, "2,2")


def _all_valid_cases() -> list[tuple[str, int, int, int]]:
    """Every schedule for pp <= 8 and m <= 4 pp the config allows (looped: v 2-4)."""
    cases = []
    for s, pp in itertools.product(SCHEDULES, range(2, 9)):
        for m in range(1, 4 * pp + 1):
            for v in (1, 2, 3, 4):
                if not schedule_problems(s, pp, m, v):
                    cases.append((s, pp, m, v))
    return cases


def test_every_schedule_passes_nccl_group_rule() -> None:
    """simulate() applies NCCL's rule (groups in order, complete only when matched, pairs
    match in posting order): no table deadlocks or receives the wrong message."""
    cases = _all_valid_cases()
    assert len(cases) > 1000 and {c[0] for c in cases} == set(SCHEDULE_DEFS)
    for schedule, pp, m, v in cases:
        simulate(build_schedule(schedule, pp, m, v), v)  # raises on a deadlock or mismatch


def test_ungrouped_interleaved_tables_deadlock_under_nccl_rule() -> None:
    """Interleaved with each receive right before its compute (the tables gloo forgave)
    deadlocks under NCCL's rule whenever m > pp; Megatron-Core's grouping does not."""
    from meshlm.parallel.schedules import tables_from_order

    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(tables_from_order("interleaved", 2, 4, 2), 2)
    simulate(tables_from_order("interleaved", 2, 2, 2), 2)  # m == pp: no steady state
    simulate(build_schedule("interleaved", 2, 4, 2), 2)


def test_interleaved_takes_the_grouping_that_simulates_sooner() -> None:
    """Interleaved 1F1B's tables are Megatron-Core's grouping or the messages placed by time,
    whichever simulate() finishes sooner with transfers of GROUPING_LATENCY: the timed ones at
    pp 2 (each output sent as soon as it is made), Megatron-Core's where more chunks would
    queue more groups (pp 4, v 4) and at m == pp; the same compute order either way."""
    from meshlm.parallel.schedules import (
        GROUPING_LATENCY,
        _interleaved_tables,
        _timed,
    )

    def time(t: list, v: int) -> float:
        return simulate(t, v, GROUPING_LATENCY)["time"]

    def compute(t: list) -> list:
        return [[(a.op, a.mb, a.stage) for a in acts if a.op in ("F", "B")] for acts in t]

    for pp, m, v, timed in ((2, 8, 2, True), (2, 4, 3, True), (4, 16, 4, False),
                            (2, 2, 2, False)):
        built = build_schedule("interleaved", pp, m, v)
        megatron = _interleaved_tables(pp, m, v)
        assert compute(built) == compute(megatron)
        assert (built != megatron) == timed, (pp, m, v)
        if timed:
            assert built == _timed("interleaved", pp, m, v)
            assert time(built, v) < time(megatron, v)
        elif m > pp:
            assert time(_timed("interleaved", pp, m, v), v) >= time(megatron, v)


def test_interleaved_groups_pair_sends_with_receives() -> None:
    """Megatron-Core's grouping, steady state: one group per forward + backward, holding both
    sends and both receives."""
    from meshlm.parallel.schedules import _interleaved_tables

    tables = _interleaved_tables(4, 8, 2)
    acts = tables[1]
    groups, run = [], []
    for a in acts + [None]:
        if a is not None and a.op[:4] in ("SEND", "RECV"):
            run.append(a.op)
        elif run:
            groups.append(sorted(run))
            run = []
    assert ["RECV_B", "RECV_F", "SEND_B", "SEND_F"] in groups


def test_messages_out_of_order_on_a_pair_are_detected() -> None:
    """pp 2: F and B travel the same pair; a receiver expecting them in another order than
    the sender posts them would get the wrong tensor (same shape: silent on hardware)."""
    from meshlm.parallel.schedules import _interleaved_tables

    tables = _interleaved_tables(2, 4, 2)
    r1 = list(tables[1])
    i = next(i for i, a in enumerate(r1) if a.op == "SEND_F" and i + 1 < len(r1)
             and r1[i + 1].op == "SEND_B")
    r1[i], r1[i + 1] = r1[i + 1], r1[i]
    with pytest.raises(RuntimeError, match="would match"):
        simulate([tables[0], r1], 2)
