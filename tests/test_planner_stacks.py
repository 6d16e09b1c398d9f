"""Software stacks (``meshlm.planner.stacks``) and FP8 as the stacks run it
(``precision_cost.PrecisionCost.cast_traffic``, ``Workload.fp8_*``): torch-free arithmetic.

Communication: none. Memory: none to speak of.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshlm.layout import Layout
from meshlm.models.presets import PRESETS
from meshlm.planner import ModelSpec, Workload
from meshlm.planner.hardware import CATALOGUE
from meshlm.planner.stacks import FP8_CASTS, FP8_RECIPE_SCALING, STACKS, workload_options
from meshlm.planner.timing import head_compute, layer_compute, step_time
from meshlm.precision_cost import PRECISION

H100 = CATALOGUE["h100-sxm"]
LO = Layout(dp=8, zero=1, micro_batch=1)


def _work(cfg=PRESETS["llama3-8b"], **kw) -> Workload:  # noqa: ANN001
    return Workload(ModelSpec(cfg), 8192, 64, states="mixed", profile="megatron", **kw)


def test_every_stack_is_stated_and_named_values_are_checked() -> None:
    assert {"megatron", "megatron-te", "torchtitan", "torchtitan-compile", "nanotron",
            "llm-foundry", "meshlm", "in-house"} <= set(STACKS)
    for stack in STACKS.values():
        assert stack.doc and stack.kernels in ("eager", "fused")
        assert stack.fp8_casts in FP8_CASTS
        opts = workload_options(stack, "bf16")
        assert not _work(**opts).problems()
    with pytest.raises(ValueError, match="stack 'jax' is not one of"):
        STACKS["jax"]
    with pytest.raises(ValueError, match="fp8_recipe 'per-channel' is not one of"):
        workload_options(STACKS["torchtitan"], "fp8", fp8_recipe="per-channel")
    assert _work(fp8_casts="sometimes").problems() and _work(fp8_recipe="mx").problems()
    # Megatron reduces bf16 gradients in fp32 and fp16 ones in fp16; torchtitan always fp32
    assert workload_options(STACKS["megatron"], "bf16 mixed")["fp32_grad_reduce"]
    assert not workload_options(STACKS["megatron"], "fp16 mixed")["fp32_grad_reduce"]
    assert workload_options(STACKS["torchtitan"], "fp16")["fp32_grad_reduce"]
    assert workload_options(STACKS["torchtitan"], "fp8", fp8_recipe="rowwise")[
        "fp8_recipe"] == "rowwise"
    assert set(FP8_RECIPE_SCALING.values()) <= {"tensorwise", "rowwise", "blockwise"}


def test_cast_traffic_counts_each_operand_by_how_the_casts_run() -> None:
    """Separate cast kernels, tensorwise: per element of x (m x k) and dy (m x n) an amax read
    (2 bytes), the cast (read 2, write 1) and the transposed copy (read 1, write 1) = 7; the
    16-bit weight likewise 7 per element; rowwise / blockwise cast each operand once per
    orientation: 2 x (2 + 2 + 1) = 10. Fused casts move nothing of their own; bf16 has no
    casts."""
    fp8 = PRECISION["fp8"].with_rest("bf16")
    m, k, n = 8192.0, 4096.0, 14336.0
    assert fp8.cast_traffic("separate", "tensorwise", m, k, n) == 7 * (m * k + m * n + k * n)
    assert fp8.cast_traffic("separate", "rowwise", m, k, n) == 10 * (m * k + m * n + k * n)
    assert fp8.cast_traffic("separate", "blockwise", m, k, n, weights=4) == (
        10 * (m * k + m * n) + 10 * 4 * k * n)
    assert fp8.cast_traffic("fused", "tensorwise", m, k, n) == 0
    assert PRECISION["bf16"].cast_traffic("separate", "tensorwise", m, k, n) == 0


def _adds_traffic(before: Workload, after: Workload, per_linear) -> None:  # noqa: ANN001
    """``after``'s layer moves ``per_linear(k, n)`` more bytes per linear of llama3-8b's
    block (8192 tokens) than ``before``'s, at eager kernels' bandwidth, and no more GEMM."""
    rates = H100.rates()
    a = layer_compute(before, LO, H100, rates, False)
    b = layer_compute(after, LO, H100, rates, False)
    assert a["gemm"] == b["gemm"]
    cfg = PRESETS["llama3-8b"]
    h, f, kv = cfg.dim, cfg.ffn_hidden, cfg.n_kv_heads * cfg.dim // cfg.n_heads
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)]
    traffic = sum(per_linear(k, n) for k, n in linears)
    bw = rates.bandwidth(8192 * h * 2) * rates.eager_scale  # eager kernels (the default)
    assert b["memory-bound"] - a["memory-bound"] == pytest.approx(traffic / bw, rel=1e-9)
    assert step_time(after, LO, H100).step > step_time(before, LO, H100).step


def test_separate_casts_add_their_traffic_to_the_memory_bound_time() -> None:
    fused = _work(dtype="fp8")
    _adds_traffic(fused, dataclasses.replace(fused, fp8_casts="separate"),
                  lambda k, n: fused.precision.cast_traffic("separate", "tensorwise", 8192,
                                                            k, n))


def test_rowwise_backward_gemms_rescale_in_a_pass_of_their_own() -> None:
    """torchao's rowwise scaling runs each float8 linear's two backward GEMMs as cuBLAS's
    tensorwise kernel with unit scales, then scales the output in a kernel of its own: dx
    (m x k) and dW (k x n) read and written once more in bf16, 4 bytes per element. Only the
    stacks that run torchao's GEMMs, and only under rowwise scaling."""
    for name in ("torchtitan", "torchtitan-compile", "meshlm"):
        assert workload_options(STACKS[name], "fp8", fp8_recipe="rowwise")["fp8_rescale"]
        assert not workload_options(STACKS[name], "fp8", fp8_recipe="current")["fp8_rescale"]
        assert not workload_options(STACKS[name], "bf16", fp8_recipe="rowwise",
                                    fp8=False)["fp8_rescale"]
    assert not workload_options(STACKS["megatron-te"], "fp8", fp8_recipe="blockwise")[
        "fp8_rescale"]  # Transformer Engine scales inside its GEMMs
    plain = _work(dtype="fp8", fp8_recipe="rowwise")
    _adds_traffic(plain, dataclasses.replace(plain, fp8_rescale=True),
                  lambda k, n: 4 * (8192 * k + k * n))
    bf16 = _work(dtype="bf16")  # no float8 linears: nothing to rescale
    rates = H100.rates()
    assert layer_compute(dataclasses.replace(bf16, fp8_rescale=True), LO, H100, rates,
                         False) == layer_compute(bf16, LO, H100, rates, False)


def test_what_stays_in_16_bit_under_fp8() -> None:
    """The head runs in the rest dtype for every stack; a MoE layer's routed experts run in
    float8 only where the stack's grouped linears do (fp8_experts), faster there."""
    rates = H100.rates()
    bf16, fp8 = _work(dtype="bf16"), _work(dtype="fp8")
    head = [head_compute(w, LO, H100, rates, False, True)["head gemm"] for w in (bf16, fp8)]
    assert head[0] == head[1]
    moe = PRESETS["mixtral-8x7b"]
    lo = Layout(dp=8, ep=8, zero=1, micro_batch=1)
    plain = _work(moe, dtype="fp8")
    grouped = dataclasses.replace(plain, fp8_experts=True)
    g = [layer_compute(w, lo, H100, rates, True)["gemm"] for w in (plain, grouped)]
    assert g[1] < 0.8 * g[0]
    bf16_moe = layer_compute(_work(moe, dtype="bf16"), lo, H100, rates, True)["gemm"]
    dense_part = layer_compute(plain, lo, H100, rates, True)["gemm"]
    assert dense_part < bf16_moe  # attention's linears in float8 even with 16-bit experts


def test_dualpipe_hides_expert_all_to_alls_behind_the_computation() -> None:
    """``ep_overlap`` (a DualPipe row): the expert all-to-alls hide behind the step's
    computation; without it they are exposed whole."""
    from meshlm.planner import evaluate

    moe = PRESETS["mixtral-8x7b"]
    lo = Layout(dp=8, ep=8, zero=1, micro_batch=1)
    hw = CATALOGUE["h100-sxm"].with_(gpus_per_node=4)  # ep 8 spans two nodes
    plain = _work(moe, dtype="bf16")
    paired = dataclasses.replace(plain, ep_overlap=True)
    a, b = (evaluate(w, lo, hw, lo.world_size).time for w in (plain, paired))
    assert a.comm["ep"] == b.comm["ep"] > 0  # the same bytes, before overlap
    assert a.items["comm: ep"] == pytest.approx(a.comm["ep"])
    assert a.comm["ep"] < a.items["compute: gemm"]  # the computation can hide all of it
    # what stays exposed is the dropless split-size all-gather (a few bytes), not the
    # all-to-alls
    assert b.items["comm: ep"] < 0.05 * a.items["comm: ep"]
    assert b.step == pytest.approx(a.step - (a.items["comm: ep"] - b.items["comm: ep"]))


def test_megatron_core_overlaps_dp_reductions_and_splits_routed_rows_over_tp() -> None:
    """``megatron-te`` (Megatron-Core): ZeRO-1 where a row states no stage, tp overlap
    available; ``dp_overlap`` hides a pipelined step's gradient reduce-scatter behind the last
    micro-batch's backward (without it the reduction waits for the flush: exposed whole) and
    ZeRO-1's parameter all-gather behind the forward; ``experts_over_tp`` has each tp rank
    compute and dispatch 1/tp of a MoE layer's routed rows."""
    from meshlm.planner import evaluate
    from meshlm.planner.stacks import layout_defaults

    te = STACKS["megatron-te"]
    assert layout_defaults(te) == {"zero": 1, "tp_overlap": True}
    assert layout_defaults(te, overlap=False) == {"zero": 0, "tp_overlap": False}
    assert layout_defaults(STACKS["torchtitan"]) == {"zero": 0, "tp_overlap": False}
    opts = workload_options(te, "bf16 mixed")
    assert opts["dp_overlap"] and opts["experts_over_tp"]
    assert not workload_options(te, "bf16 mixed", overlap=False)["dp_overlap"]
    assert not workload_options(STACKS["megatron"], "bf16 mixed")["dp_overlap"]

    lo = Layout(dp=8, pp=4, zero=1, micro_batch=1)
    plain = _work()
    mcore = dataclasses.replace(plain, dp_overlap=True)
    a, b = (evaluate(w, lo, H100, lo.world_size).time for w in (plain, mcore))
    assert a.comm["dp"] == b.comm["dp"] > 0  # the same bytes, before overlap
    assert a.items["comm: dp"] == pytest.approx(a.comm["dp"], rel=1e-9)  # after the flush
    assert b.items["comm: dp"] < 0.5 * a.items["comm: dp"]
    # ZeRO-2's reduce-scatter per micro-batch runs inside each backward, pipelined or not
    z2 = Layout(dp=8, pp=4, zero=2, micro_batch=1)
    c = evaluate(plain, z2, H100, z2.world_size).time
    assert c.items["comm: dp"] < c.comm["dp"]

    moe = _work(PRESETS["mixtral-8x7b"], dtype="bf16")
    split = dataclasses.replace(moe, experts_over_tp=True)
    lo = Layout(dp=8, tp=2, sp=True, ep=8, zero=1, micro_batch=1)
    hw = CATALOGUE["h100-sxm"].with_(gpus_per_node=16)
    x, y = (evaluate(w, lo, hw, lo.world_size).time for w in (moe, split))
    assert y.volumes["all_to_all/ep"] == pytest.approx(x.volumes["all_to_all/ep"] / 2)
    assert y.items["compute: gemm"] < x.items["compute: gemm"]
