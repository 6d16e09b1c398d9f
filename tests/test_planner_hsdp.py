"""Planner: hybrid sharding (HSDP, ``parallel.dp_shard``). ZeRO's states divided over the shard
group instead of dp, its collectives inside the shard group plus the gradient shard's
all-reduce across the replicas, the search's dp_shard candidates and ``meshlm plan``'s layout
text. With dp_shard = dp every prediction is today's. Single process, fast."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_planner import run_plan  # (the same CLI driver)

from meshlm.config import ConfigError
from meshlm.models.presets import PRESETS
from meshlm.planner import (
    CATALOGUE,
    Layout,
    ModelSpec,
    Workload,
    comm_volumes,
    memory,
    parse_layout,
    search,
    step_time,
)
from meshlm.planner.levers import levers
from meshlm.planner.memory import stage_params
from meshlm.planner.timing import comm_events

H100 = CATALOGUE["h100-sxm"]  # 8 GPUs per node
LLAMA = Workload(ModelSpec(PRESETS["llama3-8b"]), 4096, 64)
MOE = Workload(ModelSpec(PRESETS["mixtral-8x7b"]), 4096, 64)

SAME = [
    (LLAMA, Layout(dp=16, zero=1, micro_batch=1)),
    (LLAMA, Layout(dp=16, zero=2, micro_batch=2)),
    (LLAMA, Layout(dp=8, cp=2, zero=3, micro_batch=1)),
    (LLAMA, Layout(tp=2, sp=True, pp=2, dp=4, zero=1, micro_batch=1, pp_schedule="zb")),
    (LLAMA, Layout(dp=4, zero=1, micro_batch=2, islands=2)),
    (MOE, Layout(tp=2, dp=8, ep=4, zero=1, micro_batch=1)),
    (MOE, Layout(tp=2, dp=4, cp=2, ep=8, zero=3, micro_batch=1)),
]


@pytest.mark.parametrize("work, lo", SAME, ids=[lo.describe() for _, lo in SAME])
def test_dp_shard_equal_to_dp_is_todays_prediction(work: Workload, lo: Layout) -> None:
    same = dataclasses.replace(lo, dp_shard=lo.dp)
    assert not same.hybrid and same.describe() == lo.describe()
    a, b = memory(work, lo, H100), memory(work, same, H100)
    assert a.items == b.items and a.total == b.total
    ta, tb = step_time(work, lo, H100), step_time(work, same, H100)
    assert ta.items == tb.items and ta.comm == tb.comm and ta.volumes == tb.volumes
    assert ta.step == tb.step and ta.mfu == tb.mfu
    assert comm_volumes(work, lo) == comm_volumes(work, same)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hybrid_states_are_those_of_the_shard_group(zero: int) -> None:
    """dp=16 on 2 nodes of 8: shard groups of 8 hold 2x the ZeRO-sharded state of dp_shard=16
    (the plain layout), the rest is unchanged."""
    plain = Layout(dp=16, zero=zero, micro_batch=1)
    hsdp = dataclasses.replace(plain, dp_shard=8)
    assert hsdp.hybrid and hsdp.dp_rep == 2 and "dp_shard=8" in hsdp.describe()
    a, b = memory(LLAMA, plain, H100).items, memory(LLAMA, hsdp, H100).items
    psi = stage_params(LLAMA, plain, 0).total
    sharded = {"optim": 8} | ({"grads": 4} if zero >= 2 else {}) | (
        {"params": 4} if zero == 3 else {})  # fp32 states: (4, 4, 8) bytes per parameter
    for k in ("params", "grads", "optim"):
        if k in sharded:
            assert a[k] == pytest.approx(sharded[k] * psi / 16)
            assert b[k] == pytest.approx(2 * a[k])
        else:
            assert b[k] == a[k]
    assert b["activations"] == a["activations"] and b["buffers"] == a["buffers"]


def test_hybrid_with_cp_and_experts_shards_over_dp_shard_x_cp() -> None:
    """The shard group is dp_shard x cp; experts are sharded over dp_shard x cp / ep."""
    plain = Layout(tp=2, dp=4, cp=2, ep=4, zero=3, micro_batch=1)
    hsdp = dataclasses.replace(plain, dp_shard=2)
    p = stage_params(MOE, plain, 0)
    a = memory(MOE, plain, H100).items["params"]
    b = memory(MOE, hsdp, H100).items["params"]
    assert a == pytest.approx(4 * p.dense / 8 + 4 * p.expert / 2)
    assert b == pytest.approx(4 * p.dense / 4 + 4 * p.expert / 1)


def test_hybrid_gradients_cross_nodes_as_the_shard() -> None:
    """ZeRO-1, dp=16, dp_shard=8, tp=1 on 2 nodes of 8 GPUs: gradients reduce-scatter and
    weights all-gather inside a node (8 ranks, 1 apart); each rank's gradient shard, Ψ/8
    parameters x 4 bytes (fp32 gradients), is all-reduced with its one replica 8 ranks away,
    in the other node."""
    lo = Layout(dp=16, dp_shard=8, zero=1, micro_batch=1)
    psi = stage_params(LLAMA, lo, 0).total
    v = comm_volumes(LLAMA, lo)
    assert v["reduce_scatter/dp_shard"] == pytest.approx(4 * psi)
    assert v["all_gather/dp_shard"] == pytest.approx(4 * psi)
    assert v["all_reduce/dp_rep"] == pytest.approx(4 * psi / 8)
    assert not {"reduce_scatter/dp", "all_gather/dp"} & set(v)
    ev = {(e.op, e.axis): e for e in comm_events(LLAMA, lo)}
    rs, rep = ev["reduce_scatter", "dp_shard"], ev["all_reduce", "dp_rep"]
    assert (rs.group, rs.stride) == (8, 1) and rs.group * rs.stride <= H100.gpus_per_node
    assert (rep.group, rep.stride) == (2, 8) and rep.group * rep.stride > H100.gpus_per_node
    assert rep.calls == 1 and rep.overlap == "last_backward"  # bucket by bucket, like DDP's
    assert v["all_reduce/dp"] == 8  # the gradient norm, summed over all of dp
    # plain ZeRO over 16 ranks crosses the nodes with the whole gradient
    plain = comm_volumes(LLAMA, Layout(dp=16, zero=1, micro_batch=1))
    assert plain["reduce_scatter/dp"] == pytest.approx(4 * psi)


def test_hybrid_replica_reduction_hides_like_ddp_buckets_and_not_under_pipelining() -> None:
    """Beside the last backward without a pipeline (on GPUs); after the flush with one."""
    flat = step_time(LLAMA, Layout(dp=16, dp_shard=8, zero=1, micro_batch=1), H100)
    assert flat.items["comm: dp"] < flat.comm["dp"]
    piped = step_time(LLAMA, Layout(pp=2, dp=8, dp_shard=4, zero=1, micro_batch=1), H100)
    assert piped.items["comm: dp"] == pytest.approx(piped.comm["dp"])
    assert piped.volumes["all_reduce/dp_rep"] > 0


def test_hybrid_zero3_gathers_in_the_shard_group_and_reduces_once_per_step() -> None:
    lo = Layout(dp=8, cp=2, dp_shard=4, zero=3, micro_batch=1)  # shard group: 4 x 2 ranks
    psi = stage_params(LLAMA, lo, 0).total
    m = lo.micro_batches(LLAMA.global_batch)
    v = comm_volumes(LLAMA, lo)
    assert v["reduce_scatter/dp_shard_cp"] == pytest.approx(4 * psi * m)
    assert v["all_reduce/dp_rep"] == pytest.approx(4 * psi / 8)
    rep = next(e for e in comm_events(LLAMA, lo) if e.axis == "dp_rep")
    assert (rep.group, rep.stride) == (2, 8)


def test_hybrid_experts_reduce_their_shard_across_replicas() -> None:
    lo = Layout(tp=2, dp=8, ep=4, dp_shard=4, zero=1, micro_batch=1)  # edp_shard = 1
    p = stage_params(MOE, lo, 0)
    v = comm_volumes(MOE, lo)
    dense = p.total - p.expert
    assert v["reduce_scatter/dp_shard"] == pytest.approx(4 * dense)
    assert "reduce_scatter/edp_shard" not in v  # one copy of each expert per shard group
    assert v["all_reduce/dp_rep"] == pytest.approx(4 * dense / 4 + 4 * p.expert)


def test_search_picks_hybrid_when_the_network_is_slow() -> None:
    """An 8B model on 4 nodes whose network is 1/9 of NVLink (the H100 entry: 50 vs 450 GB/s
    per GPU): sharding inside a node and replicating across nodes beats the best plain layout,
    and the search finds it; its shard group lies inside a node."""
    assert H100.inter_bw * 9 <= H100.intra_bw
    work = Workload(ModelSpec(PRESETS["llama3-8b"]), 4096, 128)
    best = search(work, 32, H100, top=1)[0]
    plain = search(work, 32, H100, top=1, allowed=lambda lo: not lo.hybrid)[0]
    assert best.layout.hybrid and best.fits
    assert best.layout.tp * best.layout.shard_size * best.layout.cp <= H100.gpus_per_node
    assert best.tokens_per_s > plain.tokens_per_s
    assert "dp_shard=" in best.layout.describe()


def test_search_gains_only_options() -> None:
    """The search's plain layouts are today's; hybrid ones are added beside them."""
    work = Workload(ModelSpec(PRESETS["llama3-8b"]), 4096, 64)
    every = search(work, 16, H100, top=10_000)
    plain = search(work, 16, H100, top=10_000, allowed=lambda lo: not lo.hybrid)
    assert {p.layout for p in plain} <= {p.layout for p in every}
    assert any(p.layout.hybrid for p in every)
    assert all(p.layout.zero >= 1 for p in every if p.layout.hybrid)


def test_levers_offer_a_larger_shard_group() -> None:
    tight = dataclasses.replace(H100, memory=40 * 2**30)
    lo = Layout(dp=16, dp_shard=2, zero=3, micro_batch=1, recompute="full")
    found = levers(LLAMA, lo, tight, top=10)
    shard = [v for v in found if v.key == "parallel.dp_shard"]
    assert shard and all(lo.dp % int(v.value) == 0 for v in shard)


def test_plan_prices_a_hybrid_layout(capsys) -> None:  # noqa: ANN001
    hybrid = Layout(tp=2, sp=True, dp=8, dp_shard=4, cp=2, zero=2, micro_batch=2)
    assert parse_layout(hybrid.describe()) == hybrid
    argv = ["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-sxm",
            "--layout", "dp=16,dp_shard=8,zero=1,mbs=1"]
    code, out = run_plan(argv, capsys)
    assert code == 0 and "dp=16,dp_shard=8,zero=1" in out
    code, out = run_plan([*argv, "--json"], capsys)
    data = json.loads(out)
    assert data["dp_shard"] == 8 and data["comm_bytes_per_step"]["all_reduce/dp_rep"] > 0
    for bad in ("dp=16,dp_shard=5,zero=1", "dp=16,dp_shard=8,zero=0"):
        with pytest.raises(ConfigError) as e:
            run_plan(["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-sxm",
                      "--layout", bad], capsys)
        assert "dp_shard" in str(e.value) and "\n" not in str(e.value)
