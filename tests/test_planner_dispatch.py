"""Expert parallelism's all-to-all across nodes (``meshlm.planner.dispatch``,
``timing.collective_time``, ``timing.moe_events``): torch-free arithmetic, checked against
hand-worked values.

Communication: none (the planner's arithmetic). Memory: none to speak of.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshlm.layout import Layout
from meshlm.models.presets import PRESETS
from meshlm.planner import ModelSpec, Workload
from meshlm.planner.dispatch import EP_DISPATCHES, nodes_touched, shares
from meshlm.planner.hardware import CATALOGUE
from meshlm.planner.search import evaluate
from meshlm.planner.timing import collective_time, comm_events, step_time

H100 = CATALOGUE["h100-sxm"]
NVLINK = H100.intra_bw * H100.intra_eff
NET = H100.inter_bw * H100.inter_eff


def _ep_events(work: Workload, lo: Layout) -> list:
    return [e for e in comm_events(work, lo) if e.op == "all_to_all"]


def test_all_to_all_inside_a_node_is_unchanged_and_across_nodes_splits_its_pieces() -> None:
    nbytes = 2.0**30
    # inside one node: the ring formula, (n - 1) / n of the buffer at NVLink's rate
    inside = collective_time(H100, "all_to_all", nbytes, 8, 1)
    assert inside == pytest.approx(H100.coll_latency + 7 * H100.intra_step_latency
                                   + 7 / 8 * nbytes / NVLINK)
    # 16 ranks on 2 nodes: 7 pieces on NVLink and 8 over the network at once; the network's
    # half is the longer transfer
    two = collective_time(H100, "all_to_all", nbytes, 16, 1)
    assert two == pytest.approx(H100.coll_latency + 15 * H100.inter_step_latency
                                + max(7 / 16 * nbytes / NVLINK, 8 / 16 * nbytes / NET))
    # the same group spread one rank per node (stride 8): every piece crosses the network
    spread = collective_time(H100, "all_to_all", nbytes, 16, 8)
    assert spread == pytest.approx(H100.coll_latency + 15 * H100.inter_step_latency
                                   + 15 / 16 * nbytes / NET)
    assert two < spread
    # other collectives across nodes keep the ring formula
    ag = collective_time(H100, "all_gather", nbytes, 16, 1)
    assert ag == pytest.approx(H100.coll_latency + 15 * H100.inter_step_latency
                               + 15 / 16 * nbytes / NET)


def test_dispatch_shares_worked_by_hand() -> None:
    cfg = PRESETS["qwen3-30b-a3b"]  # top-8 of 128 experts, no group limit
    assert cfg.moe_topk == 8 and cfg.moe_n_group == 1
    assert shares("all-to-all", cfg, 16, 8) == pytest.approx((8 / 16, 7 / 16))
    # node-dedup over 2 nodes: a token's 8 copies touch 2 (1 - 2^-8) nodes, half of them the
    # other node's; the network carries those of its 8 copies
    net, nvlink = shares("node-dedup", cfg, 16, 8)
    assert net == pytest.approx(2 * (1 - 0.5**8) * 0.5 / 8)
    assert nvlink == pytest.approx(15 / 16)
    # DeepSeek-V3's group-limited routing: its 8 groups are the 8 nodes of ep 64, and a token
    # goes to at most 4 of them -- 3.5 remote on average (7 of 8 nodes are remote)
    v3 = PRESETS["deepseek-v3"]
    assert (v3.moe_n_group, v3.moe_topk_group, v3.moe_topk) == (8, 4, 8)
    assert nodes_touched(8, 8) == pytest.approx(8 * (1 - (7 / 8) ** 8))  # 5.25 without it
    assert shares("node-dedup", v3, 64, 8)[0] == pytest.approx(4 * 7 / 8 / 8)
    # groups that are not the nodes do not cap it
    assert shares("node-dedup", v3, 32, 8)[0] == pytest.approx(
        4 * (1 - (3 / 4) ** 8) * 3 / 4 / 8)
    with pytest.raises(ValueError, match="ep dispatch 'nvshmem' is not one of"):
        EP_DISPATCHES["nvshmem"]
    work = Workload(ModelSpec(cfg), 4096, 64, ep_dispatch="nvshmem")
    assert any("ep_dispatch 'nvshmem'" in p for p in work.problems())


def test_moe_step_pays_the_network_share_of_its_dispatcher() -> None:
    """Qwen3-30B-A3B over ep 16 (two nodes): the exposed all-to-all time is the network's
    share at its rate, and node-dedup's is the smaller by the ratio of the shares."""
    cfg = PRESETS["qwen3-30b-a3b"]
    lo = Layout(dp=16, ep=16, zero=1, micro_batch=1)
    plain = Workload(ModelSpec(cfg), 4096, 64, states="mixed", profile="megatron")
    dedup = dataclasses.replace(plain, ep_dispatch="node-dedup")
    times = {}
    for name, work in (("all-to-all", plain), ("node-dedup", dedup)):
        plan = evaluate(work, lo, H100, lo.world_size)
        assert not plan.problems
        times[name] = plan.time.items["comm: ep"]
        ev = _ep_events(work, lo)
        assert len(ev) == 1 and ev[0].group == 16 and ev[0].stride == 1
        net = shares(name, cfg, 16, 8)[0]
        per_call = (H100.coll_latency + 15 * H100.inter_step_latency
                    + max(shares(name, cfg, 16, 8)[1] * ev[0].nbytes / NVLINK,
                          net * ev[0].nbytes / NET))
        # beside it only the dropless split sizes' all-gather (int64 per rank and expert)
        rest = sum(collective_time(H100, e.op, e.nbytes, e.group, e.stride) * e.calls
                   for e in comm_events(work, lo) if e.name == "ep" and e.op != "all_to_all")
        assert times[name] == pytest.approx(per_call * ev[0].calls + rest, rel=1e-9)
        times[name] -= rest
    assert times["node-dedup"] < times["all-to-all"] / 3


def test_folded_experts_keep_an_ep_group_of_a_node_on_nvlink() -> None:
    """Megatron-Core's expert ranks are consecutive (ep innermost with expert tp 1): tp 2 x
    ep 8 keeps the ep group inside one 8-GPU node, where meshlm's mesh (ep inside dp, tp
    apart) spreads it over two."""
    cfg = PRESETS["qwen3-30b-a3b"]
    lo = Layout(dp=8, tp=2, sp=True, ep=8, zero=1, micro_batch=1)
    meshlm = Workload(ModelSpec(cfg), 4096, 64, states="mixed", profile="megatron")
    folded = dataclasses.replace(meshlm, experts_over_tp=True)
    (a,), (b,) = _ep_events(meshlm, lo), _ep_events(folded, lo)
    assert (a.stride, b.stride) == (2, 1)
    ta = collective_time(H100, "all_to_all", a.nbytes, 8, a.stride)
    tb = collective_time(H100, "all_to_all", b.nbytes, 8, b.stride)
    assert tb == pytest.approx(H100.coll_latency + 7 * H100.intra_step_latency
                               + 7 / 8 * b.nbytes / NVLINK)
    assert ta > 4 * tb  # half its pieces over the network


def test_overlapped_all_to_alls_hide_behind_the_paired_computation() -> None:
    """``ep_overlap`` (DualPipe, Megatron's 1F1B all-to-all overlap): the all-to-alls hide
    behind the other micro-batch's whole computation, not only its GEMMs -- exposed is what
    exceeds the step's compute (t_micro x micro-batches), and the split sizes' all-gather
    stays exposed."""
    cfg = PRESETS["qwen3-30b-a3b"]
    lo = Layout(dp=16, ep=16, zero=1, micro_batch=1)
    plain = Workload(ModelSpec(cfg), 4096, 64, states="mixed", profile="megatron",
                     ep_dispatch="node-dedup")
    over = dataclasses.replace(plain, ep_overlap=True)
    events = [e for e in comm_events(over, lo) if e.name == "ep"]
    assert [e.overlap for e in events if e.op == "all_to_all"] == ["compute"]

    def seconds(ev) -> float:  # noqa: ANN001
        return collective_time(H100, ev.op, ev.nbytes, ev.group, ev.stride, 1,
                               ev.shares) * ev.calls

    a2a = sum(seconds(e) for e in events if e.op == "all_to_all")
    rest = sum(seconds(e) for e in events if e.op != "all_to_all")
    t, t0 = step_time(over, lo, H100), step_time(plain, lo, H100)
    cover = t.t_micro * t.micro_batches
    gemm = t.items["compute: gemm"]
    assert gemm < a2a < cover  # more than the GEMMs could hide, less than the computation
    assert t.items["comm: ep"] == pytest.approx(max(0.0, a2a - cover) + rest)
    assert t0.items["comm: ep"] == pytest.approx(a2a + rest)
