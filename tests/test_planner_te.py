"""What a Transformer Engine stack keeps and overlaps (``planner/stacks.py``): FP8 runs' saved
linear inputs and primary weights in float8, dropout-free models' activations, an interleaved
schedule's p2p overlapped with compute -- torch-free arithmetic, checked against hand counts.

Communication: none (the planner's arithmetic). Memory: none to speak of.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshlm.layout import Layout
from meshlm.models.presets import PRESETS
from meshlm.planner import ModelSpec, Workload
from meshlm.planner.hardware import CATALOGUE
from meshlm.planner.memory import layer_activations, memory, stage_params, state_bytes
from meshlm.planner.stacks import STACKS, workload_options
from meshlm.planner.timing import comm_events, step_time

H100 = CATALOGUE["h100-sxm"]
CFG = PRESETS["llama3-8b"]
LO = Layout(tp=4, sp=True, pp=4, dp=2, zero=1, micro_batch=1, pp_schedule="interleaved",
            pp_virtual=2)


def _work(**kw) -> Workload:  # noqa: ANN003
    return Workload(ModelSpec(CFG), 8192, 64, states="mixed", profile="megatron", **kw)


def test_megatron_te_states_what_it_keeps_in_float8_and_overlaps() -> None:
    te = STACKS["megatron-te"]
    assert te.fp8_saved_inputs and te.fp8_params and te.pp_overlap
    assert not STACKS["torchtitan"].fp8_saved_inputs  # torchao saves the 16-bit input
    opts = workload_options(te, "fp8 mixed")
    assert opts["fp8_saved_inputs"] and opts["fp8_params"] and opts["pp_overlap"]
    assert opts["fp8_param_gather"]  # FP8 primary weights are gathered as they are held
    off = workload_options(te, "fp8 mixed", fp8=False, overlap=False)
    assert not (off["fp8_saved_inputs"] or off["fp8_params"] or off["pp_overlap"]
                or off["fp8_param_gather"])
    # torchao gathers in float8 only where the run switches it on (a column of the run)
    assert not workload_options(STACKS["torchtitan"], "fp8")["fp8_param_gather"]


def test_saved_inputs_in_float8_halve_exactly_the_linear_inputs() -> None:
    """Per token (tp 4, sequence parallel): the LN outputs (2 h, split over tp), the output
    projection's input (h / tp) and the second MLP linear's input (f / tp) drop from two
    bytes to one; everything else is unchanged. A bf16 run is unchanged by the flag."""
    h, f, t = CFG.dim, CFG.ffn_hidden, LO.tp
    tokens = 8192
    plain = layer_activations(_work(dtype="fp8"), LO)
    te = layer_activations(_work(dtype="fp8", fp8_saved_inputs=True), LO)
    saved = {k: (plain[k] - te[k]) / tokens for k in plain}
    assert saved["region inputs"] == pytest.approx(2 * h / t)
    assert saved["attention out"] == pytest.approx(h / t)  # n_heads x head dim = h
    assert saved["mlp"] == pytest.approx(f / t)
    assert all(v == 0 for k, v in saved.items()
               if k not in ("region inputs", "attention out", "mlp"))
    bf16 = _work(dtype="bf16")
    assert layer_activations(dataclasses.replace(bf16, fp8_saved_inputs=True), LO) == \
        layer_activations(bf16, LO)


def test_no_dropout_saves_no_masks() -> None:
    h, t = CFG.dim, LO.tp
    with_masks = layer_activations(_work(), LO)
    without = layer_activations(_work(dropout=False), LO)
    assert with_masks["dropout masks"] == pytest.approx(2 * h / t * 8192)
    assert "dropout masks" not in without
    assert {k: v for k, v in with_masks.items() if k != "dropout masks"} == without
    # materialised scores: softmax output, dropout mask and dropout output (5 bytes per
    # score) without flash attention; the softmax output alone (2) without dropout
    eager = layer_activations(_work(flash=False), LO)["scores"]
    assert layer_activations(_work(flash=False, dropout=False), LO)["scores"] == \
        pytest.approx(eager * 2 / 5)


def test_fp8_primary_weights_hold_the_block_linears_in_one_byte() -> None:
    """ZeRO-1 keeps whole weights on every rank: the decoder-block linears' share of them
    drops from 2 bytes to 1; embeddings, norms, grads and optimizer states stay."""
    base = _work(dtype="fp8")
    fp8w = dataclasses.replace(base, fp8_params=True)
    p = stage_params(base, LO, 0)
    a, b = state_bytes(base, LO, p), state_bytes(fp8w, LO, p)
    assert a["params"] - b["params"] == pytest.approx(p.block_linear)
    assert (a["grads"], a["optim"]) == (b["grads"], b["optim"])
    # ZeRO-3 shards the weights: the saving is the rank's shard of them
    z3 = Layout(**{**LO.as_dict(), "zero": 3})
    a3, b3 = state_bytes(base, z3, p), state_bytes(fp8w, z3, p)
    assert a3["params"] - b3["params"] == pytest.approx(p.block_linear / (LO.dp * LO.cp))
    # only with float8 linears
    bf16 = _work(dtype="bf16")
    assert state_bytes(dataclasses.replace(bf16, fp8_params=True), LO, p) == \
        state_bytes(bf16, LO, p)
    assert memory(fp8w, LO, H100).total < memory(base, LO, H100).total


def test_interleaved_p2p_overlap_hides_the_sends_behind_the_gemms() -> None:
    work = _work()
    hidden = dataclasses.replace(work, pp_overlap=True)
    sends = {w.pp_overlap: [e for e in comm_events(w, LO) if e.op == "send"]
             for w in (work, hidden)}
    assert [e.overlap for e in sends[False]] == ["exposed"]
    assert [e.overlap for e in sends[True]] == ["gemm"]
    exposed, overlapped = step_time(work, LO, H100), step_time(hidden, LO, H100)
    assert exposed.items["comm: pp"] > 0
    assert overlapped.items.get("comm: pp", 0.0) < exposed.items["comm: pp"]
    assert overlapped.step < exposed.step
    # plain 1F1B keeps its sends on the critical path (Megatron-Core overlaps the
    # interleaved schedule's only)
    one = Layout(**{**LO.as_dict(), "pp_schedule": "1f1b", "pp_virtual": 1})
    assert [e.overlap for e in comm_events(hidden, one) if e.op == "send"] == ["exposed"]


def _tp_bytes(work: Workload, lo: Layout, op: str, stage: int = 1) -> float:
    return sum(e.nbytes * e.calls for e in comm_events(work, lo, stage) if e.axis == "tp"
               and e.op == op)


def test_float8_tp_gathers_carry_one_byte_in_the_blocks_only() -> None:
    """Transformer Engine (any tensorwise or block scaling) and torchao (tensorwise only)
    all-gather the float8 linears' inputs: on a middle stage (no lookups, no head) of a
    sequence-parallel layout each block's four all-gathers per forward + backward halve,
    hand count ``4 layers m tokens h`` bytes, while the reduce-scatters stay 16-bit; a bf16
    run, a rowwise torchao run and tensor parallelism without SP are unchanged."""
    te, titan = STACKS["megatron-te"], STACKS["torchtitan-compile"]
    assert workload_options(te, "fp8 mixed", fp8_recipe="mxfp8")["fp8_tp_gather"]
    assert workload_options(titan, "fp8", fp8_recipe="current")["fp8_tp_gather"]
    assert not workload_options(titan, "fp8", fp8_recipe="rowwise")["fp8_tp_gather"]
    assert not workload_options(te, "fp8 mixed", fp8=False)["fp8_tp_gather"]
    assert not STACKS["meshlm"].fp8_tp_gather  # meshlm gathers in the compute dtype
    lo = Layout(tp=4, sp=True, pp=4, dp=2, zero=1, micro_batch=1)
    plain, narrow = _work(dtype="fp8"), _work(dtype="fp8", fp8_tp_gather=True)
    m = lo.micro_batches(64)
    layers = CFG.n_layers // lo.pp
    tokens = lo.micro_batch * 8192
    saved = _tp_bytes(plain, lo, "all_gather") - _tp_bytes(narrow, lo, "all_gather")
    assert saved == pytest.approx(4 * layers * m * tokens * CFG.dim * (2 - 1))
    assert _tp_bytes(narrow, lo, "reduce_scatter") == _tp_bytes(plain, lo, "reduce_scatter")
    bf16 = _work(dtype="bf16")
    assert _tp_bytes(dataclasses.replace(bf16, fp8_tp_gather=True), lo, "all_gather") == \
        _tp_bytes(bf16, lo, "all_gather")
    no_sp = dataclasses.replace(lo, sp=False)
    assert comm_events(narrow, no_sp, 1) == comm_events(plain, no_sp, 1)
    # the first stage's embedding output and the last stage's head input still gather in
    # 16 bits: the same saving there; the number of all-gathers is unchanged
    for stage in (0, lo.pp - 1):
        there = (_tp_bytes(plain, lo, "all_gather", stage)
                 - _tp_bytes(narrow, lo, "all_gather", stage))
        assert there == pytest.approx(saved)
        assert _tp_bytes(plain, lo, "all_gather", stage) > _tp_bytes(plain, lo, "all_gather")

        def calls(w: Workload, st: int = stage) -> float:
            return sum(e.calls for e in comm_events(w, lo, st) if e.axis == "tp"
                       and e.op == "all_gather")
        assert calls(narrow) == calls(plain)
    # full recomputation runs each block's forward again: its two gathers too (1.5x)
    full = dataclasses.replace(lo, recompute="full")
    again = _tp_bytes(plain, full, "all_gather") - _tp_bytes(narrow, full, "all_gather")
    assert again == pytest.approx(1.5 * saved)


def test_fp8_primary_weights_are_gathered_in_one_byte() -> None:
    """The distributed optimizer's parameter all-gather moves the block linears' float8
    weights (Megatron-Core's fp8_param_gather with FP8 primary weights): hand count, the
    gathered bytes drop by exactly the stage's block-linear weights (one byte each, from
    two); the gradient reduce-scatter and a bf16 run are unchanged."""
    lo = Layout(tp=2, sp=True, pp=2, dp=8, zero=1, micro_batch=1)

    def dp_bytes(work: Workload, op: str) -> float:
        return sum(e.nbytes * e.calls for e in comm_events(work, lo, 1) if e.name == "dp"
                   and e.op == op)

    plain, te = _work(dtype="fp8"), _work(dtype="fp8", fp8_param_gather=True)
    block = stage_params(te, lo, 1).block_linear
    assert block > 0
    assert dp_bytes(plain, "all_gather") - dp_bytes(te, "all_gather") == pytest.approx(block)
    assert dp_bytes(te, "reduce_scatter") == dp_bytes(plain, "reduce_scatter")
    # holding the weights in float8 is memory's business; the gather is its own switch
    assert comm_events(_work(dtype="fp8", fp8_params=True), lo, 1) == \
        comm_events(plain, lo, 1)
    bf16 = _work(dtype="bf16")
    assert comm_events(dataclasses.replace(bf16, fp8_param_gather=True), lo, 1) == \
        comm_events(bf16, lo, 1)
    # ZeRO-3 gathers each layer's weights twice per micro-batch (forward, backward): the
    # block linears save one byte each time
    z3 = dataclasses.replace(lo, zero=3)
    m = z3.micro_batches(64)

    def z3_bytes(work: Workload) -> float:
        return sum(e.nbytes * e.calls for e in comm_events(work, z3, 1) if e.name == "dp"
                   and e.op == "all_gather")

    assert z3_bytes(plain) - z3_bytes(te) == pytest.approx(2 * block * m)


def test_an_older_flash_kernel_takes_twice_the_attention_time() -> None:
    """``Workload.flash_kernel``: FlashAttention 1.x (``flash1``) runs attention at half
    FlashAttention-2's rate (Dao 2023), so a micro-batch's attention time doubles exactly;
    the GEMMs, memory-bound work and communication are unchanged; an unknown kernel is a
    problem the workload names."""
    lo = Layout(tp=2, sp=True, dp=4, zero=1, micro_batch=1)
    new, old = _work(dtype="bf16"), _work(dtype="bf16", flash_kernel="flash1")
    a, b = step_time(new, lo, H100).items, step_time(old, lo, H100).items
    assert b["compute: attention"] == pytest.approx(2 * a["compute: attention"])
    for k in a:
        if k != "compute: attention" and k.startswith("compute"):
            assert b[k] == pytest.approx(a[k]), k
    assert comm_events(old, lo, 0) == comm_events(new, lo, 0)
    assert any("flash_kernel 'flash3'" in p
               for p in _work(dtype="bf16", flash_kernel="flash3").problems())


def test_float8_saved_inputs_cut_the_memory_bound_traffic_by_a_hand_count() -> None:
    """The eager memory-bound traffic of a stack that keeps the linears' inputs in float8
    (Transformer Engine): each linear's input copy, the output projection's input and the
    second MLP linear's input move one byte a value instead of two; nothing else changes,
    and neither a bf16 run nor an FP8 run without the flag moves."""
    from meshlm.planner.timing import eager_saved

    lo = Layout(tp=2, sp=True, dp=4, zero=1, micro_batch=1)
    plain, te = _work(dtype="fp8"), _work(dtype="fp8", fp8_saved_inputs=True)
    items = layer_activations(dataclasses.replace(plain, profile="meshlm"), lo)
    tokens = 8192
    expected = (sum(items.values()) - (items["region inputs"] + items["attention out"]) / 2
                - CFG.ffn_hidden / lo.tp * tokens)
    assert eager_saved(te, lo, False) == pytest.approx(expected)
    assert eager_saved(te, lo, False) < eager_saved(plain, lo, False)
    bf16 = _work(dtype="bf16")
    assert eager_saved(dataclasses.replace(bf16, fp8_saved_inputs=True), lo, False) == \
        eager_saved(bf16, lo, False)
