"""The planner's pipeline schedules (``parallel/schedule_cost.py``) against meshlm's own action
tables (``parallel/schedules.py``): the micro-batches each rank holds at its peak, the idle time
per step (the bubble) for unequal forward / input-gradient / weight-gradient times, the sends
per micro-batch and the placement -- and the search offering the schedules. Single process,
torch-free tables; a few seconds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshlm import layout
from meshlm.models.presets import PRESETS
from meshlm.parallel import schedules
from meshlm.parallel.schedule_cost import EQUAL, REPLAY_ROUNDS, SCHEDULES, replay
from meshlm.planner import Layout, ModelSpec, Workload, get_accelerator, parse_layout
from meshlm.planner.memory import last_rank, stage_layers
from meshlm.planner.search import SIMPLER, base_layouts, search

# chunks per rank each schedule is checked with
CHUNKS = {"afab": (1,), "1f1b": (1,), "zb": (1,), "interleaved": (2, 3), "bfs": (2, 3),
          "interleaved-zb": (2, 3), "zbv": (2,), "dualpipev": (2,)}
# (f, i, w): equal, a heavy input gradient, a heavy weight gradient, a light forward
SPLITS = [EQUAL, (1.0, 1.5, 0.5), (1.0, 0.7, 1.3), (0.8, 1.4, 0.6)]
CLOSED = ("afab", "1f1b", "interleaved", "bfs", "zb")  # closed forms, exact for every split


def cases(name: str, pps: tuple[int, ...] = (2, 4, 8)) -> list[tuple[int, int, int]]:
    """(p, m, v) the schedule can run: m from 1 to 3p + 1 (ZB-V, DualPipeV: to 4p)."""
    out = []
    for v in CHUNKS[name]:
        for p in pps:
            top = 4 * p if name in layout.V_SCHEDULES else 3 * p + 1
            out += [(p, m, v) for m in range(1, top + 1)
                    if not layout.schedule_problems(name, p, m, v)]
    return out


def simulated(monkeypatch: pytest.MonkeyPatch, name: str, p: int, m: int, v: int,
              split: tuple[float, float, float]) -> dict:
    f, i, w = split
    for op, cost in (("F", f), ("B", i + w), ("I", i), ("W", w)):
        monkeypatch.setitem(schedules.COST, op, cost)
    return schedules.simulate(schedules.build_schedule(name, p, m, v), v)


def test_every_schedule_is_described() -> None:
    assert set(SCHEDULES) == set(layout.SCHEDULES) == set(schedules.SCHEDULE_DEFS)


@pytest.mark.parametrize("name", layout.SCHEDULES)
def test_held_is_the_tables_peak(name: str) -> None:
    """Each rank's most live micro-batches (chunks / v, counted from F to the last backward
    pass, as the executor's ``peak_live``) -- exactly, for p = 2, 4, 8 and every m."""
    for p, m, v in cases(name):
        peak = schedules.simulate(schedules.build_schedule(name, p, m, v), v)["peak_live"]
        assert [SCHEDULES[name].in_flight(p, v, m, r) for r in range(p)] == [
            x / v for x in peak], (p, m, v)


@pytest.mark.parametrize("name", layout.SCHEDULES)
def test_idle_time_is_the_tables(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle time per step = the simulated step less a rank's compute. Closed forms: exact for
    every split; the replayed schedules: exact at f = i = w, and never above ``simulate``
    (which also holds each rank's messages to the order it posts them, NCCL's rule)."""
    cost = SCHEDULES[name]
    for p, m, v in cases(name, (2, 4) if name not in CLOSED else (2, 4, 8)):
        for split in SPLITS:
            sim = simulated(monkeypatch, name, p, m, v, split)
            idle = sim["time"] - max(sim["busy"])
            if name in CLOSED or split == EQUAL:
                assert cost.idle(p, v, m, split) == pytest.approx(idle, abs=1e-9), (p, m, v,
                                                                                    split)
            else:
                assert cost.idle(p, v, m, split) <= idle + 1e-9, (p, m, v, split)
            if split == EQUAL:
                assert cost.fraction(p, v, m) == pytest.approx(sim["bubble"], abs=1e-12)


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "interleaved-zb"])
def test_equal_passes_give_the_published_fractions(name: str) -> None:
    """With f = i = w the idle time is a fixed share of (p - 1)(f + b) once m is large:
    1/6 for ZB-V, 1/3 for DualPipeV, 1/(3v) for interleaved zero bubble."""
    share = {"zbv": 1 / 6, "dualpipev": 1 / 3, "interleaved-zb": 1 / 6}[name]
    for p in (2, 4, 8):
        for m in (2 * p, 3 * p, 4 * p):
            assert SCHEDULES[name].idle(p, 2, m, EQUAL) == pytest.approx((p - 1) * 3 * share)


def test_long_steps_are_extrapolated_exactly() -> None:
    """Beyond REPLAY_ROUNDS x p micro-batches the idle time is extrapolated from two shorter
    replays: the same as replaying the whole step (it is linear in m there)."""
    for name in ("zbv", "dualpipev", "interleaved-zb"):
        for split in SPLITS:
            for m in (REPLAY_ROUNDS * 4 + 4, REPLAY_ROUNDS * 4 + 12):
                time, busy = replay(name, 4, 2, m, split)
                assert SCHEDULES[name].idle(4, 2, m, split) == pytest.approx(time - max(busy))


def test_the_bubble_scales_with_the_other_stages() -> None:
    """``bubble(others, ...)``: equal stages give the idle time itself; p = 1 none."""
    for name in layout.SCHEDULES:
        v = CHUNKS[name][0]
        for split in SPLITS:
            others = 3 * sum(split)  # p = 4, equal stages
            assert SCHEDULES[name].bubble(others, v, 4, 16, split) == pytest.approx(
                SCHEDULES[name].idle(4, v, 16, split))
        assert SCHEDULES[name].bubble(0.0, v, 1, 16) == 0.0


def test_unequal_ranks_are_replayed() -> None:
    """ZB-V, DualPipeV, interleaved zero bubble: ``bubble(..., ranks=...)`` replays each
    rank's own micro-batch time (its chunks sharing it): equal ranks give the idle time, and
    it is the replay of the tables with those stage costs."""
    for name in ("zbv", "dualpipev", "interleaved-zb"):
        cost = SCHEDULES[name]
        assert cost.replayed
        for split in SPLITS:
            t = sum(split)
            assert cost.bubble(3 * t, 2, 4, 8, split, [t] * 4) == pytest.approx(
                cost.idle(4, 2, 8, split))
            ranks = [2 * t, t, t, 1.5 * t]  # (ratios exact to 2 decimals: the cache's key)
            stages = [tuple(ranks[schedules.stage_rank(name, s, 4)] * x / sum(split) / 2
                            for x in split) for s in range(8)]
            time, busy = replay(name, 4, 2, 8, stages=stages)
            assert cost.bubble(0.0, 2, 4, 8, split, ranks) == pytest.approx(time - max(busy))


@pytest.mark.parametrize("name", layout.SCHEDULES)
def test_sends_and_placement_are_the_tables(name: str) -> None:
    """Sends per micro-batch = the tables' SEND actions / m; the stages each rank holds and
    the rank of the last stage = ``schedules.rank_stages`` / ``stage_rank``."""
    for p, m, v in cases(name, (2, 3, 4)):
        if m != max(2 * p, p * (m // p)):
            continue  # (one m per (p, v) is enough)
        tables = schedules.build_schedule(name, p, m, v)
        for r in range(p):
            sends = sum(a.op.startswith("SEND") for a in tables[r])
            recvs = sum(a.op.startswith("RECV") for a in tables[r])
            assert SCHEDULES[name].messages(p, v, r) == (sends / m, recvs / m), (p, v, r)
            assert list(SCHEDULES[name].stages(p, v, r)) == schedules.rank_stages(name, r, p, v)
        assert SCHEDULES[name].last_rank(p, v) == schedules.stage_rank(name, p * v - 1, p)


WORK = Workload(ModelSpec(replace(PRESETS["tiny"], n_layers=8)), 256, 64)
H100 = get_accelerator("h100-sxm")


def test_the_planner_places_a_v() -> None:
    """In a V rank 0 holds the embedding and the head: the planner's layers, memory and
    sends follow the placement."""
    n = WORK.model.config.n_layers
    zbv = Layout(pp=2, dp=4, pp_schedule="zbv", pp_virtual=2)
    inter = Layout(pp=2, dp=4, pp_schedule="interleaved", pp_virtual=2)
    stages = layout.partition_layers(n, 4)
    assert stage_layers(n, zbv, 0) == stages[0] + stages[3]
    assert stage_layers(n, inter, 0) == stages[0] + stages[2]
    assert (last_rank(zbv), last_rank(inter)) == (0, 1)
    from meshlm.planner import comm_volumes, memory

    # the turn of the V (stages 1 -> 2 on rank 1) needs no send: 2 per micro-batch there
    # against interleaving's 3 (stage 1 both ways, stage 3 back)
    assert comm_volumes(WORK, zbv, 1)["send/pp"] == pytest.approx(
        comm_volumes(WORK, inter, 1)["send/pp"] * 2 / 3)
    assert memory(WORK, zbv, H100).total > 0


def test_search_offers_the_new_schedules() -> None:
    """The search enumerates every schedule where the layers allow it, and ranks them; a plan
    lists them, and ``--layout schedule=zbv`` means two chunks per rank."""
    seen = {(lo.pp_schedule, lo.pp_virtual) for lo in base_layouts(WORK, 4, H100)}
    for name in layout.SCHEDULES:
        if name != "afab":
            assert any(s == name for s, _ in seen), name
    assert ("zbv", 2) in seen and ("dualpipev", 2) in seen and ("bfs", 4) in seen
    plans = search(WORK, 8, H100, top=10_000)
    assert {p.layout.pp_schedule for p in plans if p.layout.pp > 1} >= {
        "zbv", "bfs", "interleaved-zb"}
    assert set(SIMPLER) == set(layout.SCHEDULES)
    lo = parse_layout("pp=2,dp=2,schedule=zbv")
    assert (lo.pp_schedule, lo.pp_virtual) == ("zbv", 2)


def test_parallel_auto_accepts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """``parallel.auto`` searches what the trainer's rules allow: the new schedules pass its
    filter, and a layout of one (the fastest V here, picked in place of the overall best)
    becomes the config's."""
    from meshlm.config import load_config
    from meshlm.planner import cli

    cfg = load_config(None, ["--model.preset=tiny", "--model.n_layers=4", "--data.seq_len=64",
                             "--train.global_batch=16"])
    found: list = []

    def every_plan(*args: object, **kw: object) -> list:
        plans = search(*args, **{**kw, "top": 10_000})  # type: ignore[arg-type]
        found.extend(plans)
        return [p for p in plans if p.layout.pp_schedule == "zbv"][:1]

    monkeypatch.setattr(cli, "search", every_plan)
    lo = cli.auto_layout(cfg, 4)
    assert (lo.pp_schedule, lo.pp_virtual) == ("zbv", 2)
    assert cfg.with_layout(lo).parallel.pp_schedule == "zbv"
    assert {p.layout.pp_schedule for p in found} >= {"zbv", "dualpipev", "bfs",
                                                     "interleaved-zb"}


def test_paired_share_counts_the_tables_overlapped_pairs() -> None:
    """``paired``: the share of a rank's chunk passes that DualPipeV's table runs as
    overlapped F + B pairs (whose expert all-to-alls the executor hides); 0 elsewhere."""
    from meshlm.parallel.schedule_cost import SCHEDULES
    from meshlm.parallel.schedules import build_schedule, overlapped_pairs

    for p in (2, 3, 4, 5):
        for m in range(2 * p, 4 * p + 1):
            tables = build_schedule("dualpipev", p, m, 2)
            for r, acts in enumerate(tables):
                pairs = len(overlapped_pairs(acts))
                assert SCHEDULES["dualpipev"].paired(p, m, r) == pairs / (2 * m), (p, m, r)
                assert 0 < pairs < 2 * m
            for name in ("1f1b", "zbv", "interleaved"):
                assert SCHEDULES[name].paired(p, m, 0) == 0.0
