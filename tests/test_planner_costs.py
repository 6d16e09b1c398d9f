"""The planner composes the techniques' declared costs (``parallel/*_cost.py``,
``precision_cost.py``): the registries
hold the config's names, the descriptions import without torch, the planner's breakdown is the
sum of what they declare, and a technique registered from outside changes the planner's answer
without a planner file knowing it. Single process, fast."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from meshlm import dtypes, layout
from meshlm.models.presets import PRESETS
from meshlm.parallel.context_cost import CONTEXT
from meshlm.parallel.offload_cost import OFFLOAD
from meshlm.parallel.recompute_cost import RECOMPUTE, RecomputeCost
from meshlm.parallel.schedule_cost import SCHEDULES
from meshlm.parallel.tensor_cost import TENSOR
from meshlm.parallel.zero_cost import ZERO, ZeroCost
from meshlm.planner import Layout, ModelSpec, Workload, comm_volumes, get_accelerator, memory
from meshlm.planner.memory import fp8_casts, in_flight, shard_ranks, stage_params
from meshlm.planner.workload import STATES
from meshlm.precision_cost import (
    COMPUTE,
    PRECISION,
    STATE_MODES,
    ComputeDtype,
    PrecisionCost,
    StatesCost,
)

H100 = get_accelerator("h100-sxm")
WORK = Workload(ModelSpec(PRESETS["tiny"]), 256, 64)


def test_registries_hold_the_config_names() -> None:
    assert set(ZERO) == set(layout.ZERO_STAGES)
    assert set(SCHEDULES) == set(layout.SCHEDULES)
    assert list(RECOMPUTE) == list(layout.RECOMPUTE)  # least to most recomputation
    assert set(OFFLOAD) == set(layout.OFFLOADS)
    assert set(CONTEXT) == set(layout.CP_MODES)
    assert set(TENSOR) == {False, True}
    assert tuple(PRECISION) == dtypes.PRECISIONS
    assert set(dtypes.FP8_REST) <= set(COMPUTE) == set(dtypes.AUTOCAST_NAMES)
    assert set(STATE_MODES) == set(STATES)
    assert PRECISION["fp8"].recipes == dtypes.FP8_RECIPES
    with pytest.raises(ValueError, match="precision 'fp4' is not one of fp32, bf16, fp16, fp8"):
        PRECISION["fp4"]
    with pytest.raises(ValueError, match="ZeRO stage 7 is not one of 0, 1, 2, 3"):
        ZERO[7]
    with pytest.raises(ValueError, match="described twice"):
        ZERO.register(ZERO[1])


def test_descriptions_import_without_torch() -> None:
    code = ("import sys; import meshlm.parallel.zero_cost, meshlm.parallel.schedule_cost, "
            "meshlm.parallel.recompute_cost, meshlm.parallel.offload_cost, "
            "meshlm.parallel.context_cost, meshlm.parallel.tensor_cost, meshlm.precision_cost, "
            "meshlm.planner.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_states_buffers_and_volumes_are_the_stage_s(zero: int) -> None:
    lo = Layout(dp=4, zero=zero)
    b = memory(WORK, lo, H100)
    p = stage_params(WORK, lo, 0)
    w, g, o = STATE_MODES[WORK.states].bytes
    declared = ZERO[zero].states(p.dense, p.expert, shard_ranks(lo), shard_ranks(lo),
                                 (w, g, o))
    assert {k: b.items[k] for k in declared} == declared
    assert b.items["buffers"] == ZERO[zero].buffers(p.total, p.layer_unit, p.root_unit, w, g)
    m = lo.micro_batches(WORK.global_batch)
    cols = ZERO[zero].collectives(p.total * g, p.total, p.dense - p.root_unit, p.root_unit, w,
                                  m, 4)
    dp = {k: v for k, v in comm_volumes(WORK, lo).items() if k.endswith("/dp")}
    clip = {"all_reduce/dp": 8.0} if zero else {}
    summed: dict[str, float] = dict.fromkeys(clip, 0.0)
    for c in cols:
        summed[f"{c.op}/dp"] = summed.get(f"{c.op}/dp", 0.0) + c.nbytes * c.calls
    assert dp == {k: v + clip.get(k, 0.0) for k, v in summed.items()}


@pytest.mark.parametrize("schedule", sorted(layout.SCHEDULES))
def test_micro_batches_in_flight_are_the_schedule_s(schedule: str) -> None:
    lo = Layout(pp=4, dp=2, pp_schedule=schedule, pp_virtual=2 if schedule == "interleaved"
                else 1)
    for stage in range(4):
        assert in_flight(lo, 8, stage) == SCHEDULES[schedule].in_flight(4, lo.pp_virtual, 8,
                                                                         stage)


def test_a_new_zero_like_stage_changes_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A made-up stage that shards the gradients only, registered from the test: the planner
    holds and sends what it declares, no planner file edited."""
    fake = ZeroCost(9, "gradients sharded only", frozenset({"grads"}))
    monkeypatch.setitem(ZERO, 9, fake)
    base, lo = Layout(dp=4, zero=0), Layout(dp=4, zero=9)
    before, after = memory(WORK, base, H100), memory(WORK, lo, H100)
    assert after.items["grads"] == pytest.approx(before.items["grads"] / 4)
    assert after.items["params"] == before.items["params"]
    assert after.items["optim"] == before.items["optim"]  # whole, though it owns 1 / N ...
    assert after.checkpoint_host == pytest.approx(before.checkpoint_host / 4)  # ... of them
    assert after.total < before.total
    volumes = comm_volumes(WORK, lo)
    assert "reduce_scatter/dp" in volumes and "all_reduce/dp" in volumes  # + the clip norm
    assert "reduce_scatter/dp" not in comm_volumes(WORK, base)


def test_a_new_recompute_mode_changes_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mode that drops the MLP's saved tensors as well as the attention core's."""
    fake = RecomputeCost("mlp", "attention core and MLP recomputed",
                         drops=("scores", "attention mask", "mlp"))
    monkeypatch.setitem(RECOMPUTE, "mlp", fake)
    lo = Layout(dp=2)
    sel = memory(WORK, replace(lo, recompute="selective"), H100).items["activations"]
    assert memory(WORK, replace(lo, recompute="mlp"), H100).items["activations"] < sel


@pytest.mark.parametrize("states", ["fp32", "mixed"])
@pytest.mark.parametrize("zero", [0, 3])
def test_state_bytes_are_the_precision_s(states: str, zero: int) -> None:
    """Per rank, weights / gradients / optimizer states hold the states mode's bytes per
    parameter (whole without ZeRO, 1 / N of each under ZeRO-3)."""
    work = replace(WORK, states=states)
    lo = Layout(dp=4, zero=zero)
    b, p = memory(work, lo, H100), stage_params(work, lo, 0)
    n = 4 if zero == 3 else 1
    declared = STATE_MODES[states].bytes
    assert [b.items[k] for k in ("params", "grads", "optim")] == [
        pytest.approx(p.total * per / n) for per in declared]


@pytest.mark.parametrize("dtype, rest", [("fp32", "bf16"), ("bf16", "bf16"), ("fp8", "bf16"),
                                         ("fp8", "fp32")])
def test_weight_copies_and_casts_are_the_precision_s(dtype: str, rest: str) -> None:
    work = replace(WORK, dtype=dtype, fp8_rest=rest)
    lo = Layout(dp=2)
    precision = PRECISION[dtype].with_rest(rest)
    p = stage_params(work, lo, 0)
    b = memory(work, lo, H100)
    assert b.items["weight copies"] == precision.weight_copies(p.matmul, p.block_linear)
    assert (fp8_casts(work, lo, 0) > 0) == precision.float8_linears


def test_a_new_precision_changes_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A made-up precision -- float8 linears with 1-byte activations -- and a made-up states
    mode (8-bit AdamW moments), registered from the test: the planner's bytes follow what they
    declare, no planner file edited."""
    monkeypatch.setitem(COMPUTE, "e4m3", ComputeDtype("e4m3", 1, 11.0))
    monkeypatch.setitem(PRECISION, "fp8-acts", PrecisionCost(
        "fp8-acts", "float8 linears, 1-byte activations", "fp8", "e4m3", "bf16",
        float8_linears=True))
    monkeypatch.setitem(STATE_MODES, "adam8", StatesCost(
        "adam8", "fp32 weights and gradients, 8-bit moments", 4, 4, 2, True))
    lo = Layout(dp=2)
    fp8 = replace(WORK, dtype="fp8")
    made_up = replace(fp8, dtype="fp8-acts", states="adam8")
    assert not made_up.problems()
    before, after = memory(fp8, lo, H100), memory(made_up, lo, H100)
    p = stage_params(made_up, lo, 0)
    assert after.items["activations"] < before.items["activations"]
    assert after.items["weight copies"] == pytest.approx(before.items["weight copies"] / 2)
    assert after.items["weight copies"] == 1 * (p.matmul - p.block_linear)
    assert after.items["optim"] == pytest.approx(before.items["optim"] / 4)
    assert after.items["params"] == before.items["params"]
    assert after.total < before.total
