"""MoE parallel folding in the planner (``Layout.ep_over_tp``): an expert group folded over
tp x dp x cp, as Megatron-Core runs it with expert tensor parallelism 1 -- the layout rule, the
experts' copies (ZeRO shards and gradient reduction), the all-to-all's group and rows, the
``--layout`` key, and the published rows it lets the planner predict -- with Megatron-Core's
pipeline split that counts the embedding and the loss as layers (``pp_split``). Torch-free
arithmetic.

Communication: none (the planner's arithmetic). Memory: none to speak of.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest

from meshlm.config import ConfigError, load_config
from meshlm.layout import Layout
from meshlm.models.presets import PRESETS
from meshlm.planner import ModelSpec, Workload
from meshlm.planner.memory import expert_copies, stage_params, state_bytes
from meshlm.planner.timing import comm_events
from meshlm.planner.train_args import layout_items, meshlm_ep, train_gaps
from meshlm.planner.workload import parse_layout

ROOT = Path(__file__).resolve().parents[1]
CFG = PRESETS["qwen3-30b-a3b"]  # 128 routed experts, top-8
# Qwen3-235B's Megatron-Bridge layout on 256 H100s: tp 2, pp 8, dp 16, ep 32 (> dp x cp)
FOLDED = Layout(tp=2, sp=True, pp=8, dp=16, ep=32, ep_over_tp=True, zero=1,
                pp_schedule="interleaved", pp_virtual=4)


def _work(**kw) -> Workload:  # noqa: ANN003
    return Workload(ModelSpec(CFG), 4096, 1024, states="mixed", profile="megatron", **kw)


def test_the_rule_reads_tp_dp_cp_when_the_expert_group_folds() -> None:
    plain = dataclasses.replace(FOLDED, ep_over_tp=False)
    assert any("ep=32 must divide dp * cp = 16" in p for p in plain.problems())
    assert not FOLDED.problems()
    assert "ep_over_tp" in FOLDED.describe() and "ep_over_tp" not in plain.describe()
    too_big = dataclasses.replace(FOLDED, ep=64)
    assert any("ep=64 must divide tp * dp * cp = 32" in p for p in too_big.problems())
    # a group that fits dp x cp may fold too (Megatron-Core's order puts ep innermost)
    assert not dataclasses.replace(FOLDED, ep=8).problems()


def test_an_experts_copies_are_tp_dp_cp_over_ep() -> None:
    assert expert_copies(FOLDED, 16) == 1  # 2 x 16 / 32
    assert expert_copies(dataclasses.replace(FOLDED, ep=8), 16) == 4  # 2 x 16 / 8
    assert expert_copies(dataclasses.replace(FOLDED, ep=8, ep_over_tp=False), 16) == 2
    # ZeRO-1 shards the expert moments over those copies: folding ep = 8 over tp 2 halves a
    # rank's share of them against the same ep inside dp (2 copies -> 4); the experts a rank
    # holds (E / ep, whole) are the same either way
    work = _work()
    fold = dataclasses.replace(FOLDED, ep=8)
    inside = dataclasses.replace(fold, ep_over_tp=False)
    p_fold, p_inside = stage_params(work, fold, 0), stage_params(work, inside, 0)
    assert p_fold.expert == p_inside.expert > 0
    o = work.state_cost.bytes[2]  # optimizer bytes per parameter
    for lo, copies in ((fold, 4), (inside, 2)):
        optim = state_bytes(work, lo, stage_params(work, lo, 0))["optim"]
        assert optim == pytest.approx(o * p_fold.dense / 16 + o * p_fold.expert / copies)


def test_the_groups_and_the_routed_rows_of_a_folded_layout() -> None:
    work = _work()
    events = comm_events(work, FOLDED)
    a2a = [e for e in events if e.op == "all_to_all"]
    assert a2a and all(e.group == 32 and e.stride == 1 for e in a2a)  # consecutive ranks
    plain = dataclasses.replace(FOLDED, ep=16, ep_over_tp=False)  # the same experts, inside dp
    a2a_plain = [e for e in comm_events(work, plain) if e.op == "all_to_all"]
    assert all(e.group == 16 and e.stride == 2 for e in a2a_plain)  # tp apart
    # each tp rank dispatches its own 1 / tp of the rows (meshlm's mesh replicates them)
    assert sum(e.nbytes for e in a2a) == pytest.approx(sum(e.nbytes for e in a2a_plain) / 2)
    # no rank holds a copy of another's experts (tp x dp / ep = 1): no expert gradient
    # reduction; at ep = 8 the 4 copies are ep apart
    assert not [e for e in events if e.axis.startswith("edp")]
    edp = [e for e in comm_events(work, dataclasses.replace(FOLDED, ep=8))
           if e.axis.startswith("edp")]
    assert edp and all(e.group == 4 and e.stride == 8 for e in edp)


def test_the_layout_key_and_what_meshlm_cannot_run() -> None:
    lo = parse_layout("tp=2,sp,pp=8,dp=16,ep=32,ep_over_tp,zero=1,schedule=interleaved,vpp=4")
    assert lo == FOLDED
    assert any(g.startswith("ep_over_tp: meshlm places the expert group inside dp x cp")
               and g.endswith("ep=16 for the plan's 32") for g in train_gaps(_work(), lo))
    # the train line runs what meshlm can: ep 16 inside dp 16, a layout its rules accept
    items = dict(layout_items(lo))
    assert items["parallel.ep"] == 16
    assert meshlm_ep(dataclasses.replace(lo, ep=8)) == 8
    assert not dataclasses.replace(lo, ep=16, ep_over_tp=False).problems()
    cfg = load_config(None, [])
    with pytest.raises(ConfigError, match="an expert group folded over tp is not a config key"):
        cfg.with_layout(lo)


def test_published_rows_with_ep_beyond_dp_are_predicted_folded(import_benchmark) -> None:  # noqa: ANN001
    bench = import_benchmark("planner_vs_published")
    with (ROOT / "benchmarks" / "data" / "published_runs.csv").open(newline="") as f:
        raws = list(csv.DictReader(f))
    folded = [i for i, r in enumerate(raws)
              if (r.get("ep") or "").isdigit() and int(r["ep"]) > 1
              and int(r.get("dp") or 0) * int(r.get("cp") or 1) % int(r["ep"])]
    assert len(folded) >= 8  # Qwen3-235B on 256 H100s, tp 2 dp 16 ep 32
    predicted = 0
    for i in folded:
        row = bench.build_row(i, raws[i])
        assert row.layout.ep_over_tp and row.work.experts_over_tp
        assert any("folds over tp x dp x cp" in r for r in row.rules)
        plan = bench.predict(row)
        assert not any("ep=" in p for p in plan.problems)  # (others: e.g. 96 stages, 94 layers)
        predicted += not plan.problems
    assert predicted >= 8


def test_a_pipeline_split_that_counts_the_embedding_and_the_loss(import_benchmark) -> None:  # noqa: ANN001
    """``pp_split = embedding+loss`` (Megatron-Core's account-for-embedding / loss in the
    pipeline split): the first and the last stage hold one decoder layer fewer -- none, for
    Qwen3-235B's 94 layers over pp 32 x vpp 3 = 96 stages, which an even split cannot fill."""
    from meshlm.layout import partition_layers

    bench = import_benchmark("planner_vs_published")
    with (ROOT / "benchmarks" / "data" / "published_runs.csv").open(newline="") as f:
        raws = list(csv.DictReader(f))
    split = [i for i, r in enumerate(raws) if r.get("pp_split") == "embedding+loss"]
    assert split
    seen_empty = False
    for i in split:
        row = bench.build_row(i, raws[i])
        lo = row.layout
        if lo.pp == 1:
            assert not lo.pp_layers  # (nothing to split)
            continue
        counts = [int(c) for c in lo.pp_layers.split(",")]
        stages = lo.pp * lo.pp_virtual
        u = (row.work.model.config.n_layers + 2) // stages
        assert counts == [u - 1] + [u] * (stages - 2) + [u - 1]
        seen_empty |= counts[0] == 0
        plan = bench.predict(row)
        assert not plan.problems and plan.time.step > 0
        if u > 1:  # where an even split can fill the stages it is the same split
            even = [len(s) for s in partition_layers(row.work.model.config.n_layers, stages)]
            assert counts == even
    assert seen_empty
    # without the column the 96-stage row is refused, as before
    raw = next(dict(raws[i], pp_split="") for i in split if raws[i]["pp"] == "32")
    assert any("96 stages exceed" in p for p in bench.predict(bench.build_row(0, raw)).problems)
