"""FP8 training (``precision.dtype=fp8``) against one process under fp8, on CPU.

- meshlm's float8 linear is torchao's ``Float8Linear`` bit for bit (both recipes, forward and
  both gradients): the same casts, scales and scaled matmuls;
- the scales agree across tensor-parallel shards: with the amax reduced over tp, a
  column-parallel shard computes exactly the columns of the one-process output (and its weight
  gradient rows), a row-parallel shard's partial sums add up to it; without the reduction
  (each shard its own scale) they do not;
- in one spawned world of 2, every layout under fp8 gives the one-process fp8 losses and final
  weights: tp 2, tp 2 + sp, dp 2, ZeRO-3, pp 2 zero-bubble (eager and compiled), pp 2 1F1B
  with full recomputation, cp 2 (ring and zigzag), ep 2 (MoE), DiLoCo islands, compiled
  tp + sp, in both recipes -- with ``precision.fp8_rest=fp32``, so that the float8 casts are
  the only rounding beyond fp32's. Losses agree to < 1e-4 at each of 5 steps (to 1e-6 where the
  layout adds in the one-process order); the bounds and why they differ are at ``LAYOUTS``.
  Under the default bf16 rest, dp 2 and ZeRO-3 stay exact; tp and pp carry bf16's own layout
  differences (partial sums, activations sent in bf16), which float8 amplifies
  (``docs/precision.md``);
- checkpoints hold fp32 weights whatever the precision: a run saved in fp8 resumes exactly in
  fp8 and resumes in bf16, and the reverse; the Hugging Face export of an fp8 run has the
  names, dtypes and shapes of a bf16 run's;
- ``print(model)`` names the precision and shows the float8 linears; a bad recipe or a missing
  torchao is one line before any worker starts;
- fp8 tracks bf16: 200 steps of ``tiny`` end within 2 % of bf16's validation loss (200 steps of
  ``small`` are ``benchmarks/fp8.py``: on an AVX2-only CPU bf16 runs 20x below fp32).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from meshlm.config import ConfigError, load_config
from meshlm.testing import final_weights, max_relative_difference, run_world, train_runs
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

pytest.importorskip("torchao")

from meshlm.parallel.float8 import Float8Linear, make_plan, require_torchao  # noqa: E402

STEPS = 5
SGD_SYNC = ["--train.optimizer=sgd", "--train.lr=0.05", "--train.min_lr=0.005",
            "--diloco.inner_steps=1", "--diloco.outer_lr=1", "--diloco.outer_momentum=0",
            "--train.grad_clip=0"]
FP32_REST = ["--precision.dtype=fp8", "--precision.fp8_rest=fp32"]
ROWWISE = [*FP32_REST, "--precision.fp8_recipe=rowwise"]
BF16_REST = ["--precision.dtype=fp8", "--precision.fp8_rest=bf16"]
# reference name -> its arguments (one process)
REFERENCES = {
    "fp8": FP32_REST,
    "fp8-moe": [*FP32_REST, "--model.preset=tiny-moe"],
    "fp8-sgd": [*FP32_REST, *SGD_SYNC],
    "fp8-compiled": [*FP32_REST, "--train.compile=true"],
    "rowwise": ROWWISE,
    "bf16-rest": BF16_REST,
    # ZeRO's references: no clipping (the reason is at LAYOUTS)
    "fp8-noclip": [*FP32_REST, "--train.grad_clip=0"],
    "rowwise-noclip": [*ROWWISE, "--train.grad_clip=0"],
    "bf16-rest-noclip": [*BF16_REST, "--train.grad_clip=0"],
}
NOCLIP = ["--train.grad_clip=0"]
TP2, PP2_ZB = ["--parallel.tp=2"], ["--parallel.pp=2", "--parallel.pp_schedule=zb"]
# (name, reference, arguments, bound on the relative loss difference at each step, bound on
# the final weights' per-tensor relative difference or None); a world of 2. Layouts that add
# the same products in the one-process order match to fp32 rounding. Where the order differs
# (tp's partial sums, ring attention's blocks, experts on another rank, islands' averages),
# the inputs of the next float8 cast differ by fp32 rounding, and an element at a float8
# rounding boundary flips (e4m3 has 3 mantissa bits, e5m2 2): tensorwise scales, not rounded
# to powers of two, move with the tensor's max and flip more of them than rowwise ones; the
# losses still agree to 1e-4, the weights to a few 1e-3. A token whose top-k routing is a near
# tie may go to another expert once its input flips (routing is discrete): ep is held to its
# losses. Under a bf16 rest, bf16's own rounding of those sums is what float8 amplifies.
# ZeRO adds the squared gradient norm shard by shard, so with clipping on, its clip scale (and
# through it every update) differs from one process's by fp32 rounding, ~1e-7; every step then
# casts the weights to bf16 or float8, and an element that lies within that much of a rounding
# midpoint flips by a whole bf16 (2^-8) or float8 (2^-3) step. How many flip depends on the
# weights, which depend on the CPU's matmul kernels (one AVX-512 CPU: one flip, 6.9e-6 in the
# loss). Without clipping ZeRO runs the one-process arithmetic element for element, so its
# rows train unclipped and are held to fp32 rounding on every CPU (sharded clipping itself is
# checked in fp32 in test_data_parallel).
LAYOUTS = [
    ("tp2", "fp8", [*FP32_REST, *TP2], 1e-4, 1e-2),
    ("tp2-sp", "fp8", [*FP32_REST, *TP2, "--parallel.sp=true"], 1e-4, 1e-2),
    ("dp2", "fp8", [*FP32_REST, "--parallel.dp=2"], 1e-6, 1e-6),
    ("zero3", "fp8-noclip", [*FP32_REST, *NOCLIP, "--parallel.dp=2", "--parallel.zero=3"],
     1e-6, 1e-6),
    ("pp2-zb", "fp8", [*FP32_REST, *PP2_ZB], 1e-6, 1e-6),
    ("pp2-1f1b-full", "fp8", [*FP32_REST, "--parallel.pp=2", "--parallel.pp_schedule=1f1b",
                              "--train.recompute=full"], 1e-6, 1e-6),
    ("cp2", "fp8", [*FP32_REST, "--parallel.cp=2"], 1e-4, 1e-3),
    ("cp2-zigzag", "fp8", [*FP32_REST, "--parallel.cp=2", "--parallel.cp_attention=zigzag"],
     1e-4, 1e-3),
    ("ep2", "fp8-moe", [*FP32_REST, "--model.preset=tiny-moe", "--parallel.dp=2",
                        "--parallel.ep=2"], 1e-3, None),
    ("islands2", "fp8-sgd", [*FP32_REST, *SGD_SYNC, "--parallel.islands=2"], 1e-4, 1e-2),
    ("tp2-sp-compiled", "fp8-compiled", [*FP32_REST, *TP2, "--parallel.sp=true",
                                         "--train.compile=true"], 1e-4, 1e-2),
    ("pp2-zb-compiled", "fp8-compiled", [*FP32_REST, *PP2_ZB, "--train.compile=true"],
     1e-6, 1e-6),
    ("rowwise-tp2-sp", "rowwise", [*ROWWISE, *TP2, "--parallel.sp=true"], 1e-4, 1e-4),
    ("rowwise-zero3", "rowwise-noclip", [*ROWWISE, *NOCLIP, "--parallel.dp=2",
                                         "--parallel.zero=3"], 1e-6, 1e-6),
    ("rowwise-pp2-zb", "rowwise", [*ROWWISE, *PP2_ZB], 1e-6, 1e-6),
    ("rowwise-cp2", "rowwise", [*ROWWISE, "--parallel.cp=2"], 1e-4, 1e-4),
    ("bf16-rest-dp2", "bf16-rest", [*BF16_REST, "--parallel.dp=2"], 1e-6, 1e-6),
    ("bf16-rest-zero3", "bf16-rest-noclip", [*BF16_REST, *NOCLIP, "--parallel.dp=2",
                                             "--parallel.zero=3"], 1e-6, 1e-6),
    # bf16 partial sums (tp) and bf16 activations between stages (pp), amplified by float8
    ("bf16-rest-pp2-zb", "bf16-rest", [*BF16_REST, *PP2_ZB], 1e-3, None),
    ("bf16-rest-tp2", "bf16-rest", [*BF16_REST, *TP2], 1e-3, None),
]


def base_args(corpus: Path, cache: Path) -> list[str]:
    return ["--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
            "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
            "--train.global_batch=8", "--train.micro_batch=4", "--train.warmup_steps=2",
            "--train.eval_every=0", "--run.sample_tokens=0", "--train.peak_flops=1e10"]


# ---------------------------------------------------------------------- the linear itself
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_linear_is_torchaos(recipe: str, dtype: torch.dtype) -> None:
    f8 = require_torchao()
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=False)
    config = f8.Float8LinearConfig.from_recipe_name(recipe)  # (CPU: torchao's emulation)
    ref = f8.convert_to_float8_training(nn.Sequential(copy.deepcopy(lin)),
                                        config=dataclasses.replace(config, emulate=True))[0]
    mine = Float8Linear(copy.deepcopy(lin), make_plan(recipe))
    x = torch.randn(2, 16, 64, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), mine(xb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    assert type(ref).__name__ == "Float8Linear" and yb.dtype == dtype
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    assert torch.equal(ref.weight.grad, mine.weight.grad)
    assert mine.weight.grad.dtype == torch.float32  # the master weight's gradient
    # float8 for real: a few percent from the fp32 product, not fp32's 1e-7
    exact = x.float() @ lin.weight.detach().t()
    rel = ((yb.float() - exact).norm() / exact.norm()).item()
    assert 1e-3 < rel < 0.1, rel


def _shard_body(recipe: str) -> dict[str, object]:
    """On each of 2 ranks: the float8 casts of every operand of a linear, whole (one process)
    and as this rank's column- (N) or row-parallel (K) shard, with and without the tp
    reduction of the amax; then the sharded linears themselves against the whole one."""
    from meshlm.distributed import traceable
    from meshlm.distributed.comm import Comm
    from meshlm.distributed.mesh import Mesh
    from meshlm.layout import Layout
    from meshlm.parallel.float8 import cast

    comm = Comm(Mesh(Layout(tp=2)))
    r, key = comm.rank("tp"), traceable.key_of(comm)
    torch.manual_seed(0)
    m, n, k = 16, 32, 64
    weight = torch.randn(n, k) * torch.linspace(0.1, 3.0, n).unsqueeze(1)  # rows of unequal max
    weight = weight * torch.linspace(0.2, 2.0, k)  # and columns
    x, dy = torch.randn(2, m // 2, k), torch.randn(2, m // 2, n)
    full = {"x": (x.reshape(m, k), "MK"), "w": (weight.t(), "KN"), "dy": (dy.reshape(m, n), "MN"),
            "w_dx": (weight.t(), "KN"), "dy_dw": (dy.reshape(m, n), "MN"),
            "x_dw": (x.reshape(m, k), "MK")}
    out: dict[str, object] = {"scales_equal": [], "scales_differ_locally": []}
    whole = make_plan(recipe)
    for dim, size in (("N", n), ("K", k)):
        part = slice(r * size // 2, (r + 1) * size // 2)
        for op, (t, dims) in full.items():
            if dim not in dims:
                continue
            axis = dims.index(dim)
            cut = tuple(part if i == axis else slice(None) for i in range(2))
            ref = cast(t, op, whole)
            ref_scale = ref._scale[cut] if ref._scale.ndim and ref._scale.shape[axis] > 1 \
                else ref._scale
            got = cast(t[cut], op, make_plan(recipe, ((dim, ("tp",)),), key))
            alone = cast(t[cut], op, whole)
            same = torch.equal(got._scale, ref_scale) and torch.equal(
                got._data.view(torch.uint8), ref._data[cut].view(torch.uint8))
            out["scales_equal"].append((dim, op, same))
            out["scales_differ_locally"].append(
                (dim, op, not torch.equal(alone._scale, ref_scale)))

    def run(w: torch.Tensor, inp: torch.Tensor, grad: torch.Tensor, sharded: tuple
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight = nn.Parameter(w.clone())
        f8 = Float8Linear(lin, make_plan(recipe, sharded, key if sharded else 0))
        xi = inp.clone().requires_grad_()
        y = f8(xi)
        y.backward(grad)
        return y.detach(), xi.grad, f8.weight.grad

    y_ref, dx_ref, dw_ref = run(weight, x, dy, ())
    cols, ks = slice(r * n // 2, (r + 1) * n // 2), slice(r * k // 2, (r + 1) * k // 2)
    y, dx, dw = run(weight[cols], x, dy[..., cols], (("N", ("tp",)),))
    comm.all_reduce(dx, "tp")  # the column-parallel input gradient is a partial sum
    out["col_exact"] = torch.equal(y, y_ref[..., cols]) and torch.equal(dw, dw_ref[cols])
    out["col_dx"] = ((dx - dx_ref).norm() / dx_ref.norm()).item()
    y, dx, dw = run(weight[:, ks], x[..., ks], dy, (("K", ("tp",)),))
    comm.all_reduce(y, "tp")  # the row-parallel output is a partial sum
    out["row_exact"] = torch.equal(dx, dx_ref[..., ks]) and torch.equal(dw, dw_ref[:, ks])
    out["row_y"] = ((y - y_ref).norm() / y_ref.norm()).item()
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scales_agree_across_tensor_parallel_shards(recipe: str) -> None:
    """Every operand whose scale spans a sharded dim: the reduced scale and the float8 bytes
    of the shard are the one-process ones (sliced); local scales would differ on some rank.
    Then the linears: exactly sharded results are bit for bit the one-process ones; partial
    sums add up to them to fp32 rounding."""
    ranks = run_world(2, _shard_body, recipe)
    spans = {("N", "w"), ("N", "dy"), ("N", "w_dx"), ("N", "dy_dw"),
             ("K", "x"), ("K", "w"), ("K", "w_dx"), ("K", "x_dw")}  # tensorwise: all that hold it
    if recipe == "rowwise":  # only the operands whose row scale runs along the sharded dim
        spans = {("N", "dy"), ("N", "w_dx"), ("K", "x"), ("K", "w")}
    for got in ranks:
        assert all(same for _, _, same in got["scales_equal"]), got["scales_equal"]
        assert len(got["scales_equal"]) == 8
        assert got["col_exact"] and got["row_exact"], got
        assert got["col_dx"] < 1e-6 and got["row_y"] < 1e-6, got
    differ = {(d, op) for g in ranks for d, op, yes in g["scales_differ_locally"] if yes}
    assert differ == spans, differ


# ---------------------------------------------------------------------- layouts
@pytest.fixture(scope="module")
def world(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Every layout in one world of 2; the one-process references in this process."""
    root = tmp_path_factory.mktemp("fp8")
    base = base_args(corpus_dir, cache_dir)
    refs = {}
    for key, extra in REFERENCES.items():
        refs[key] = root / f"ref-{key}"
        train(load_config(None, base + extra + [f"--run.dir={refs[key]}"]),
              log=lambda _m: None, progress=False)
    runs = [[*args, f"--run.dir={root / name}"] for name, _, args, *_ in LAYOUTS]
    results = run_world(2, train_runs, base, runs)[0]
    losses = dict(zip([name for name, *_ in LAYOUTS], results, strict=True))
    return root, refs, losses


def _reference_losses(ref: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(ref / "metrics.jsonl")}


@pytest.mark.parametrize("name", [name for name, *_ in LAYOUTS])
def test_layout_matches_one_process_under_fp8(name: str, world) -> None:  # noqa: ANN001
    root, refs, losses = world
    _, key, _, bound, weight_bound = next(entry for entry in LAYOUTS if entry[0] == name)
    ref = _reference_losses(refs[key])
    got = losses[name]
    if key == "fp8-sgd":  # DiLoCo: rank 0's loss is its island's; the mean is outer_loss
        got = {r["step"]: r["outer_loss"] for r in read_metrics(root / name / "metrics.jsonl")}
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), name
    worst = max(abs(got[s] - ref[s]) / ref[s] for s in ref)
    assert worst < bound, (name, worst)
    if weight_bound is not None:
        weights, tensor = max_relative_difference(final_weights(root / name),
                                                  final_weights(refs[key]))
        assert weights < weight_bound, (name, tensor, weights)


def test_fp8_is_not_the_fp32_run(world, corpus_dir: Path, cache_dir: Path,  # noqa: ANN001
                                 tmp_path: Path) -> None:
    """The float8 linears really run: fp8 with an fp32 rest is not fp32 (the parity above
    would hold trivially if nothing were converted)."""
    _, refs, _ = world
    train(load_config(None, base_args(corpus_dir, cache_dir) + [f"--run.dir={tmp_path}"]),
          log=lambda _m: None, progress=False)
    fp32, fp8 = _reference_losses(tmp_path), _reference_losses(refs["fp8"])
    worst = max(abs(fp8[s] - fp32[s]) / fp32[s] for s in fp32)
    assert 1e-5 < worst < 1e-2, worst


# ---------------------------------------------------------------------- checkpoints
def _resume_from_step_2(run: Path, into: Path, base: list[str], extra: list[str]
                        ) -> dict[int, float]:
    """Copy ``run``, drop its step-4 checkpoint and train to step 4 again from step 2."""
    shutil.copytree(run, into)
    shutil.rmtree(into / "checkpoints" / "step_0000004")
    train(load_config(None, base + extra + [f"--run.dir={into}", "--run.resume=auto"]),
          log=lambda _m: None, progress=False)
    return {r["step"]: r["loss"] for r in read_metrics(into / "metrics.jsonl") if r["step"] > 2}


def test_checkpoints_hold_fp32_and_resume_across_precisions(
        corpus_dir: Path, cache_dir: Path, tmp_path: Path) -> None:
    base = [*base_args(corpus_dir, cache_dir), "--train.steps=4", "--train.checkpoint_every=2"]
    fp8, bf16 = ["--precision.dtype=fp8"], ["--precision.dtype=bf16"]
    runs = {"fp8": fp8, "bf16": bf16}
    losses = {}
    for name, extra in runs.items():
        train(load_config(None, base + extra + [f"--run.dir={tmp_path / name}"]),
              log=lambda _m: None, progress=False)
        losses[name] = _reference_losses(tmp_path / name)
    weights = {name: final_weights(tmp_path / name) for name in runs}
    assert weights["fp8"].keys() == weights["bf16"].keys()
    assert {t.dtype for w in weights.values() for t in w.values()} == {torch.float32}
    # the same precision again: exact
    again = _resume_from_step_2(tmp_path / "fp8", tmp_path / "fp8-again", base, fp8)
    assert again == {s: losses["fp8"][s] for s in (3, 4)}
    # the other precision: it resumes (steps 3, 4 from the step-2 weights and moments) and
    # differs only by the matmul precision
    for src, dst, extra in (("fp8", "to-bf16", bf16), ("bf16", "to-fp8", fp8)):
        got = _resume_from_step_2(tmp_path / src, tmp_path / dst, base, extra)
        assert sorted(got) == [3, 4], (dst, got)
        for s in (3, 4):
            assert got[s] != losses[src][s], (dst, s)  # (really the other precision)
            assert abs(got[s] - losses[src][s]) / losses[src][s] < 1e-2, (dst, s)

    # Hugging Face export: unchanged by the precision the run trained in
    from safetensors import safe_open

    from meshlm.cli import main as cli

    shapes = {}
    for name in runs:
        out = tmp_path / f"hf-{name}"
        assert cli(["convert", str(tmp_path / name), "--to-hf", str(out)]) in (0, None)
        found = {}
        for f in sorted(out.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                found.update({k: (st.get_tensor(k).dtype, tuple(st.get_tensor(k).shape))
                              for k in st.keys()})  # noqa: SIM118
        shapes[name] = found
    assert shapes["fp8"] == shapes["bf16"] and shapes["fp8"]


# ---------------------------------------------------------------------- the user's view
def test_print_model_names_fp8_and_its_linears(tiny_args: list[str]) -> None:
    from meshlm.models import build_model
    from meshlm.parallel.extensions import apply_choices

    cfg = load_config(None, tiny_args)
    model = build_model(cfg.model_config(512), 0)
    apply_choices(model, precision="fp8", fp8_recipe="rowwise")
    text = str(model)
    assert "precision=fp8, fp8_recipe=rowwise" in text
    assert text.count("Float8Linear(") == 7 * cfg.model_config(512).n_layers
    assert "fp8=rowwise" in text
    assert type(model.output) is nn.Linear  # the head stays in the autocast dtype
    apply_choices(model, precision="bf16")  # and back: plain linears holding the same weights
    assert "Float8Linear" not in str(model) and "fp8_recipe" not in str(model)


@pytest.mark.parametrize(("override", "message"), [
    ("--precision.fp8_recipe=blockwise",
     "precision.fp8_recipe='blockwise' is not one of tensorwise, rowwise"),
    ("--precision.fp8_rest=fp16", "precision.fp8_rest='fp16' is not one of bf16, fp32"),
])
def test_bad_fp8_settings_are_one_line(override: str, message: str,
                                       tiny_args: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [*tiny_args, "--precision.dtype=fp8", override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fp8_without_torchao_is_one_line(tiny_args: list[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        load_config(None, [*tiny_args, "--precision.dtype=fp8"])
    assert str(err.value) == ('precision.dtype=fp8 needs torchao, which is not installed '
                              '(pip install "meshlm[fp8]")')
    load_config(None, [*tiny_args, "--precision.dtype=bf16"])  # the others need nothing


# ---------------------------------------------------------------------- convergence
def test_fp8_tracks_bf16_over_200_steps(corpus_dir: Path, cache_dir: Path,
                                        tmp_path: Path) -> None:
    base = [*base_args(corpus_dir, cache_dir), "--train.steps=200", "--train.warmup_steps=20",
            "--train.eval_every=200", "--train.eval_batches=4", "--train.checkpoint_every=0"]
    val = {}
    for dtype in ("bf16", "fp8"):
        train(load_config(None, base + [f"--precision.dtype={dtype}",
                                        f"--run.dir={tmp_path / dtype}"]),
              log=lambda _m: None, progress=False)
        recs = read_metrics(tmp_path / dtype / "metrics.jsonl")
        val[dtype] = [r["val_loss"] for r in recs if r.get("val_loss") is not None][-1]
    first = read_metrics(tmp_path / "fp8" / "metrics.jsonl")[0]["loss"]
    assert val["fp8"] < 0.8 * first  # it learned
    assert abs(val["fp8"] - val["bf16"]) / val["bf16"] < 0.02, val
