"""The planner's ``fp8`` (``precision.dtype=fp8``, profile ``meshlm``) against meshlm's own float8
training: the saved activations and 16-bit weight copies of the real model, the transient
float8 casts of one linear, and the plan's memory and GEMM rate on a GPU.

Communication: none (one process, CPU). Memory: tiny models and one small linear; bf16 work
is kept to a few thousand tokens x features (bf16 matmuls are slow on AVX2 CPUs).
"""

from __future__ import annotations

import weakref

import pytest
import torch

from meshlm.layout import Layout
from meshlm.models.config import ModelConfig
from meshlm.models.llama import build_model
from meshlm.models.presets import PRESETS
from meshlm.parallel.float8 import RECIPES, Float8Linear, make_plan, torchao_available
from meshlm.planner import ModelSpec, Workload, get_accelerator, memory
from meshlm.planner.hardware import CATALOGUE
from meshlm.planner.memory import fp8_casts, fp8_linear_peak
from meshlm.planner.timing import head_compute, layer_compute, step_time

pytestmark = pytest.mark.skipif(not torchao_available(), reason="fp8 needs torchao")

H100 = CATALOGUE["h100-sxm"]
# a small shape beside ``tiny``: wider, MLP not a multiple of the head width, tied embeddings
SMALL = PRESETS["small"].with_(n_layers=2, vocab_size=1024)


def weight_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """The matmul weights' matrices in bf16 (a stacked expert tensor: one per expert)."""
    out = []
    for p in model.parameters():
        if p.ndim >= 2:
            out += list(p.detach().to(torch.bfloat16).reshape(-1, *p.shape[-2:]))
    return out


def is_copy(t: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether ``t`` is a 16-bit copy of a weight matrix, as is or transposed (as CPU
    autocast's linear saves it), or of a stack of expert matrices (the grouped experts cast
    theirs, ``models/moe.py``): compared by value, not by shape."""
    if t.dtype != torch.bfloat16 or t.ndim not in (2, 3):
        return False
    if t.ndim == 3:
        return all(is_copy(m, weights) for m in t)
    return any((t.shape == w.shape and torch.equal(t, w))
               or (t.shape == w.t().shape and torch.equal(t, w.t())) for w in weights)


def saved(cfg: ModelConfig, b: int, s: int, recipe: str | None, autocast: bool = True
          ) -> dict[str, int]:
    """Bytes the real model saves for backward in one forward + loss (``recipe``: float8
    decoder linears; None: plain ones): ``weight copies`` (16-bit copies of a matmul weight)
    and ``activations`` (every other saved storage but parameters and buffers)."""
    model = build_model(cfg, 0)
    if recipe is not None:
        from meshlm.parallel.extensions import apply_choices

        apply_choices(model, precision="fp8", fp8_recipe=recipe)
        assert any(isinstance(m, Float8Linear) for m in model.modules())
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    weights = weight_matrices(model)
    seen: dict[str, dict[int, int]] = {"weight copies": {}, "activations": {}}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            copy = is_copy(t, weights)
            seen["weight copies" if copy else "activations"][ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    return {k: sum(v.values()) for k, v in seen.items()}


def planned(cfg: ModelConfig, b: int, s: int, **kw: object) -> dict[str, float]:
    work = Workload(ModelSpec(cfg), s, b, states="fp32", **kw)
    return memory(work, Layout(micro_batch=b), get_accelerator("cpu")).items


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_profile_matches_saved_tensors_of_the_real_model(recipe: str) -> None:
    """Under fp8 (bf16 rest) meshlm saves the activations bf16 autocast saves -- each float8
    linear its own bf16 copy of its input -- and no 16-bit copy of a decoder-block linear's
    weight: only the LM head's."""
    b, s = 2, 24
    for cfg in (PRESETS["tiny"], SMALL):
        measured = saved(cfg, b, s, recipe)
        items = planned(cfg, b, s, dtype="fp8")
        assert items["activations"] == pytest.approx(measured["activations"], rel=0.01), cfg
        assert items["weight copies"] == pytest.approx(measured["weight copies"], rel=0.01)
        head = 2 * cfg.vocab_size * cfg.dim  # (tied: the embedding's copy, as the head)
        assert measured["weight copies"] == head


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_moe_copies_only_router_experts_and_head(recipe: str) -> None:
    """A MoE model: the stacked routed experts keep their bf16 copies, the router (fp32) and
    the attention and the shared expert (float8) none; the activations are bf16 autocast's."""
    cfg = PRESETS["tiny-moe"]
    b, s = 2, 24
    fp8, bf16 = saved(cfg, b, s, recipe), saved(cfg, b, s, None)
    items = planned(cfg, b, s, dtype="fp8")
    assert items["weight copies"] == pytest.approx(fp8["weight copies"], rel=0.01)
    per_layer = cfg.dim * cfg.moe_experts * 3 * cfg.moe_ffn_hidden
    assert fp8["weight copies"] == 2 * (cfg.n_layers * per_layer + cfg.vocab_size * cfg.dim)
    # bf16 autocast's activations, plus, under tensorwise, the two one-element scales (x's and
    # W's) each float8 linear keeps from forward for backward
    from meshlm.parallel.extensions import apply_choices

    model = build_model(cfg, 0, device="meta")
    apply_choices(model, precision="fp8", fp8_recipe=recipe)
    linears = sum(isinstance(m, Float8Linear) for m in model.modules())
    scales = 2 * 4 * linears if recipe == "tensorwise" else 0
    assert fp8["activations"] == bf16["activations"] + scales
    assert items["activations"] == planned(cfg, b, s, dtype="bf16")["activations"]


def test_fp8_with_fp32_rest_saves_what_fp32_saves() -> None:
    """``precision.fp8_rest=fp32`` (no autocast): the float8 linears save their fp32 inputs,
    one per region as fp32 linears do; no weight copies at all."""
    cfg, b, s = SMALL, 2, 32
    measured = saved(cfg, b, s, "tensorwise", autocast=False)
    items = planned(cfg, b, s, dtype="fp8", fp8_rest="fp32")
    assert items["activations"] == pytest.approx(measured["activations"], rel=0.01)
    assert measured["weight copies"] == items["weight copies"] == 0
    assert items["activations"] == planned(cfg, b, s, dtype="fp32")["activations"]
    assert Workload(ModelSpec(cfg), s, b, dtype="fp8", fp8_rest="fp16").problems()


class Live(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the storages allocated inside the mode and still alive, and their peak."""

    def __init__(self, held: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in held}
        self.live: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for x in torch.utils._pytree.tree_flatten(out)[0]:
            if type(x) is not torch.Tensor:  # (the float8 wrappers: their data is counted)
                continue
            st = x.untyped_storage()
            key = st.data_ptr()
            if key in self.known or key in self.live or not st.nbytes():
                continue
            self.live[key] = st.nbytes()
            self.peak = max(self.peak, sum(self.live.values()))
            weakref.finalize(st, self.live.pop, key, None)
        return out


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("k,n", [(256, 768), (768, 256)])
def test_fp8_casts_peak_as_counted(recipe: str, k: int, n: int) -> None:
    """One float8 linear's forward and backward peak at what ``fp8_linear_peak`` counts: a
    cast holds 9 bytes per element (scaled fp32, clamped fp32, float8) beside the float8 copy
    of the operand cast before it; outputs included."""
    m = 512
    lin = Float8Linear(torch.nn.Linear(k, n, bias=False), make_plan(recipe))
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    with Live([x, lin.weight]) as fwd:
        y = lin(x)
    with Live([x, dy, lin.weight, y]) as bwd:
        y.backward(dy)
    measured = max(fwd.peak, bwd.peak)
    assert fp8_linear_peak(m, k, n, 2) == pytest.approx(measured, rel=0.01)


def test_fp8_plan_drops_the_decoder_linears_weight_copies() -> None:
    """llama3-8b on an H100: the fp8 plan allocates less than the bf16 one by exactly the
    decoder-block linears' bf16 weight copies (2 bytes x their parameters, counted on the
    real model's Float8Linear modules); its activations are bf16's."""
    from meshlm.parallel.extensions import apply_choices

    cfg = PRESETS["llama3-8b"]
    model = build_model(cfg, 0, device="meta")
    apply_choices(model, precision="fp8", fp8_recipe="tensorwise")
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, Float8Linear))
    lo = Layout(dp=8, zero=1, micro_batch=1)
    plans = {d: memory(Workload(ModelSpec(cfg), 8192, 64, dtype=d), lo, H100)
             for d in ("bf16", "fp8")}
    bf16, fp8 = plans["bf16"], plans["fp8"]
    assert bf16.peak_phase == fp8.peak_phase == "backward"
    assert fp8.items["activations"] == bf16.items["activations"]
    assert bf16.items["weight copies"] - fp8.items["weight copies"] == 2 * linears
    assert bf16.allocated - fp8.allocated == pytest.approx(2 * linears)
    assert fp8.items["weight copies"] == 2 * cfg.vocab_size * cfg.dim  # the head's copy
    assert fp8.total < bf16.total


def test_fp8_casts_are_transient_beside_a_small_loss() -> None:
    """With the chunked loss the casts of the largest linear (llama3-8b's down projection:
    9 bytes per element of its 14336-wide input) are the backward's transient; the torch
    loss's logits outweigh them."""
    cfg = PRESETS["llama3-8b"]
    lo = Layout(dp=8, zero=1, micro_batch=1)
    chunked = Workload(ModelSpec(cfg), 8192, 64, dtype="fp8", loss="chunked")
    casts = fp8_casts(chunked, lo, 0)
    assert casts >= 9 * 8192 * cfg.ffn_hidden
    assert memory(chunked, lo, H100).items["transient"] == casts
    assert fp8_casts(Workload(ModelSpec(cfg), 8192, 64, dtype="bf16"), lo, 0) == 0
    torch_loss = memory(Workload(ModelSpec(cfg), 8192, 64, dtype="fp8"), lo, H100)
    assert torch_loss.items["transient"] > casts


def test_fp8_step_time_uses_the_fp8_gemm_rate() -> None:
    """The decoder-block linears run at the H100's float8 GEMM rate (peak_fp8 x its gemm_eff),
    the LM head in bf16 (meshlm does not convert it); the step is shorter than bf16's."""
    cfg = PRESETS["llama3-8b"]
    lo = Layout(dp=8, zero=1, micro_batch=1)
    rates = H100.rates()
    assert rates.gemm["fp8"] == pytest.approx(H100.peak["fp8"] * H100.gemm_eff["fp8"])
    assert rates.gemm["fp8"] > 1.5 * rates.gemm["bf16"]
    works = {d: Workload(ModelSpec(cfg), 8192, 64, dtype=d) for d in ("bf16", "fp8")}
    layer = {d: layer_compute(w, lo, H100, rates, False) for d, w in works.items()}
    assert layer["fp8"]["gemm"] == pytest.approx(
        layer["bf16"]["gemm"] * rates.gemm["bf16"] / rates.gemm["fp8"], rel=1e-6)
    head = {d: head_compute(w, lo, H100, rates, False, True) for d, w in works.items()}
    assert head["fp8"]["head gemm"] == head["bf16"]["head gemm"]
    assert step_time(works["fp8"], lo, H100).step < step_time(works["bf16"], lo, H100).step
