"""Extension points: the attention kernel, activation recomputation, compile and the precision
name are registered choices applied in one place (``parallel.extensions.apply_choices``).

``print(model)`` shows them; applying them one by one in any order gives the same model (the
same modules, runners and gradients, bit for bit); the pipeline's activations and their
gradients travel between stages in the compute dtype (half the bytes under bf16).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import permutations
from pathlib import Path

import pytest
import torch

from meshlm.config import load_config
from meshlm.models import build_model, get_preset
from meshlm.models.llama import EagerAttention, Transformer
from meshlm.models.moe import MoE
from meshlm.parallel.extensions import apply_choices, base_kernel
from meshlm.parallel.pipeline import compute_dtype
from meshlm.parallel.registry import ATTENTION, PRECISION, RECOMPUTE
from meshlm.precision import DTYPES, Precision
from meshlm.testing import run_world
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train


def _model(preset: str = "tiny", **changes: object) -> Transformer:
    return build_model(replace(get_preset(preset), **changes), seed=0)


def _structure(model: Transformer) -> list:
    """What the choices decide: the printed model and the type of each runner."""
    runners = [(type(b.run_layer).__name__, type(b.run_ffn).__name__)
               for b in model.layers.values()]
    return [repr(model), runners, type(model.run_head).__name__]


def test_registries_name_every_choice() -> None:
    # one list of attention kernels; context parallelism's modes compose around any of them
    from meshlm.layout import CP_MODES
    from meshlm.models.attention_spec import SPECS

    assert {"sdpa", "eager"} <= set(ATTENTION.names())
    assert set(ATTENTION.names()) == set(SPECS)  # each kernel has the planner's description
    assert not set(CP_MODES) & set(ATTENTION.names())
    # each runtime registry covers exactly the names declared once, torch-free, in layout.py /
    # dtypes.py (config validation and `meshlm plan` read those; nothing else repeats them)
    from meshlm import dtypes, layout

    assert RECOMPUTE.names() == layout.RECOMPUTE  # (least to most recomputation)
    assert PRECISION.names() == dtypes.PRECISIONS
    assert {n: PRECISION[n].dtype for n in PRECISION.names() if n != "fp8"} == DTYPES
    assert PRECISION["fp8"].float8 and not any(PRECISION[n].float8 for n in DTYPES)


def test_print_shows_the_choices() -> None:
    model = _model()
    assert "recompute" not in repr(model)  # nothing applied: nothing named
    apply_choices(model, recompute="selective", compiled=True, precision="bf16")
    text = repr(model)
    assert text.splitlines()[1].strip() == (
        "attention=sdpa, recompute=selective, compiled=True, precision=bf16")
    assert text.count("attention=sdpa, recompute=selective, compiled=True\n") == \
        model.cfg.n_layers
    assert text.count("(kernel): Checkpointed(") == model.cfg.n_layers


def test_moe_layers_show_their_own_recompute() -> None:
    """op-level recomputation is selective on MoE layers (data-dependent matmul shapes)."""
    model = _model("tiny-moe", moe_first_dense=1)
    apply_choices(model, recompute="op")
    kinds = set()
    for block in model.layers.values():
        moe = isinstance(block.feed_forward, MoE)
        kinds.add(moe)
        assert f"recompute={'selective' if moe else 'op'}" in repr(block).splitlines()[1]
        assert (block.run_layer is None) == moe
    assert kinds == {True, False}


def test_unknown_choice_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="recompute mode 'some' is not one of none, selective"):
        apply_choices(_model(), recompute="some")
    with pytest.raises(ValueError, match="needs context parallelism"):
        apply_choices(_model(), context="zigzag")
    with pytest.raises(ValueError, match="attention kernel 'zigzag' is not one of sdpa, eager"):
        apply_choices(_model(), attention="zigzag")


CHANGES = [("attention", "eager"), ("recompute", "selective"), ("compiled", True)]


def test_any_order_gives_the_same_model() -> None:
    all_at_once = _model()
    apply_choices(all_at_once, **dict(CHANGES))
    want = _structure(all_at_once)
    assert "Checkpointed(\n          (inner): EagerAttention()" in want[0]
    for order in permutations(CHANGES):
        model = _model()
        for key, value in order:
            apply_choices(model, **{key: value})
        assert _structure(model) == want, order
    # choosing again replaces: back to the defaults is the model given the defaults
    apply_choices(all_at_once, attention="sdpa", recompute="none", compiled=False)
    defaults = _model()
    apply_choices(defaults)
    assert _structure(all_at_once) == _structure(defaults)


def _grads(model: Transformer) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids).float().logsumexp(-1).mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_any_order_gives_the_same_gradients() -> None:
    changes = [("attention", "eager"), ("recompute", "full")]
    runs = []
    for order in permutations(changes):
        model = _model()
        for key, value in order:
            apply_choices(model, **{key: value})
        assert isinstance(base_kernel(model.layers["0"].attention.kernel), EagerAttention)
        runs.append(_grads(model))
    plain = _model()
    apply_choices(plain, attention="eager")
    runs.append(_grads(plain))  # (recomputation changes no gradient)
    for got in runs[1:]:
        for name, g in runs[0].items():
            assert torch.equal(got[name], g), name


def test_eager_attention_matches_sdpa() -> None:
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    sdpa, eager = _model(), _model()
    apply_choices(eager, attention="eager")
    torch.testing.assert_close(eager(ids), sdpa(ids), rtol=1e-5, atol=1e-5)


def test_attention_core_stays_settable() -> None:
    """``Attention.core`` is the kernel: a function set there runs; deleting restores SDPA."""
    model = _model()
    att = model.layers["0"].attention
    calls = []

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append(q.shape)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)

    att.core = core
    model(torch.zeros(1, 8, dtype=torch.long))
    assert calls == [(1, model.cfg.n_heads, 8, model.cfg.hd)]
    del att.core
    assert base_kernel(att.kernel).name == "sdpa"


@pytest.mark.parametrize("name", list(DTYPES))
def test_executor_learns_the_compute_dtype_from_autocast(name: str) -> None:
    assert compute_dtype(Precision(name, "cpu").autocast, torch.device("cpu")) == DTYPES[name]


def _cp_models() -> list[list]:
    """Spawned body (cp = 2): the structure of a context-parallel model given its choices all
    at once, and one by one in each order."""
    from meshlm.distributed.comm import Comm
    from meshlm.distributed.mesh import Mesh
    from meshlm.layout import Layout
    from meshlm.parallel.context import ContextParallel

    comm = Comm(Mesh(Layout(cp=2, cp_attention="zigzag")))
    cp = ContextParallel(comm, "zigzag")
    changes = [("attention", "eager"), ("context", "zigzag"), ("recompute", "selective"),
               ("compiled", True)]
    out = []
    for order in [changes, *permutations(changes)]:
        model = _model()
        if order is changes:
            apply_choices(model, cp=cp, **dict(changes))
        else:
            for key, value in order:
                apply_choices(model, cp=cp, **{key: value})
        out.append(_structure(model))
    return out


def test_context_parallel_kernel_in_any_order() -> None:
    structures = run_world(2, _cp_models)[0]
    text = structures[0][0]
    assert "attention=eager, context=zigzag, recompute=selective, compiled=True" in text
    # the ring around the model's kernel, kept out of compiled graphs, then recomputed (the
    # fixed order of extensions.py)
    assert ("(kernel): Checkpointed(\n          (inner): Uncompiled(\n"
            "            (inner): ContextParallelAttention(\n"
            "              zigzag, cp=2\n"
            "              (inner): EagerAttention()") in text
    assert all(s == structures[0] for s in structures)


def _train_each(base: list[str], runs: list[list[str]]) -> list[dict[int, float]]:
    return [train(load_config(None, base + r), log=lambda _m: None, progress=False).losses
            for r in runs]


def test_pipeline_activations_travel_in_the_compute_dtype(corpus_dir: Path, cache_dir: Path,
                                                          tmp_path: Path) -> None:
    base = ["--model.preset=tiny", f"--data.path={corpus_dir}", f"--data.cache_dir={cache_dir}",
            "--data.vocab_size=512", "--data.seq_len=32", "--train.steps=2",
            "--train.global_batch=4", "--train.micro_batch=2", "--train.warmup_steps=1",
            "--train.eval_every=0", "--run.sample_tokens=0", "--train.peak_flops=1e10",
            "--parallel.pp=2", "--parallel.pp_schedule=1f1b"]
    dtypes = ("fp32", "bf16", "fp16")
    runs = [[f"--precision.dtype={d}", f"--run.dir={tmp_path / d}"] for d in dtypes]
    losses = run_world(2, _train_each, base, runs)[0]
    sent = {d: read_metrics(tmp_path / d / "metrics.jsonl")[-1]["comm_bytes"] for d in dtypes}
    assert sent["fp32"]["send/pp"] % (2 * 32 * 64 * 4) == 0, sent["fp32"]  # whole activations
    for d in ("bf16", "fp16"):
        assert sent[d]["send/pp"] * 2 == sent["fp32"]["send/pp"], (d, sent[d])
        assert sent[d]["recv/pp"] * 2 == sent["fp32"]["recv/pp"], (d, sent[d])
    for fp32, half in zip(losses[0].values(), losses[1].values(), strict=True):
        assert abs(half - fp32) / fp32 < 2e-2
