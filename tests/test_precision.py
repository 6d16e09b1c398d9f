"""Mixed precision in every layout: fp16 dynamic loss scaling, bf16 tracking fp32, bf16
gradient reductions.

fp16 with ZeRO-1/2/3 (dp = 2), tp = 2 and pp = 2: an inf written into one rank's gradients
(rank 1, after the reduction, so no other rank holds it) skips step 2 on every rank -- rank 0's
metrics record the skip -- halves the loss scale, and leaves the weights as step 1 left them;
the next step trains again. The scaler's rules (back off on overflow, grow after the window)
and its checkpointed state are checked alone. bf16 tracks fp32 within 2 % over 50 steps of
``tiny``. ``precision.grad_reduce_dtype=bf16`` halves the gradient bytes of DDP's all-reduce and
ZeRO's reduce-scatter (comm log) and trains within 1 % of fp32 reductions.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.loading import load_model
from meshlm.config import load_config
from meshlm.precision import LossScaler, Precision, overflow_flag, rank_device
from meshlm.testing import max_relative_difference, run_world
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

VOCAB, SEQ = 509, 32


def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        f"--data.vocab_size={VOCAB}", f"--data.seq_len={SEQ}", "--train.global_batch=4",
        "--train.warmup_steps=1", "--train.eval_every=0", "--run.sample_tokens=0",
        "--train.peak_flops=1e10",
    ]


def test_loss_scaler_rules() -> None:
    s = LossScaler(scale=1024.0, window=3)
    g = [torch.tensor([2048.0, -1024.0]), torch.tensor([512.0])]
    assert not s.unscale_and_check(g, lambda flag: None)
    assert g[0].tolist() == [2.0, -1.0] and g[1].tolist() == [0.5]
    for _ in range(3):
        s.update(False)
    assert s.scale == 2048.0 and s.good_steps == 0  # grown after the window
    assert s.unscale_and_check([torch.tensor([float("nan")])], lambda flag: None)
    s.update(True)
    assert s.scale == 1024.0 and s.skipped == 1
    other = LossScaler()
    other.load_state_dict(s.state_dict())
    assert other.state_dict() == s.state_dict()

    def someone_overflowed(flag: torch.Tensor) -> None:  # another rank saw an inf
        flag.fill_(1.0)

    assert s.unscale_and_check([torch.tensor([1.0])], someone_overflowed)


def test_overflow_flag_is_on_the_rank_device_without_gradients() -> None:
    """A rank with no gradients (or only gradients elsewhere) still hands a flag on its own
    device to the all-reduce: ``meta`` stands in for the rank's GPU here."""
    meta = torch.device("meta")
    assert overflow_flag([], 0.5, meta).device == meta
    g = [torch.tensor([4.0, float("inf")])]  # host gradients, flag on the "device"
    flag = overflow_flag(g, 0.5, meta)
    assert flag.device == meta and flag.shape == (1,) and flag.dtype == torch.float32
    assert g[0][0].item() == 2.0  # unscaled in place where they are
    cpu = torch.device("cpu")
    assert overflow_flag([], 0.5, cpu).item() == 0.0
    assert overflow_flag([torch.tensor([float("nan")])], 0.5, cpu).item() > 0
    assert overflow_flag([torch.tensor([1.0])], 0.5, cpu).item() == 0.0

    seen: list[torch.device] = []
    scaler = LossScaler(scale=2.0, device=meta)

    def all_reduce(flag: torch.Tensor) -> None:  # where the collective gets its tensor
        seen.append(flag.device)
        raise StopIteration

    with pytest.raises(StopIteration):
        scaler.unscale_and_check([], all_reduce)
    assert seen == [meta]


def test_the_flag_device_follows_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 on CUDA: the current device (init_worker set it); on CPU the CPU."""
    assert Precision("fp16", "cpu").scaler.device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert rank_device("cuda") == torch.device("cuda", 3)
    assert Precision("fp16", "cuda").scaler.device == torch.device("cuda", 3)
    assert Precision("fp16", "cuda", device=torch.device("meta")).scaler.device.type == "meta"
    assert Precision("bf16", "cuda").scaler is None


def runs_with_env(base: list[str], runs: list[tuple[dict[str, str], list[str]]]
                  ) -> list[dict[int, float]]:
    """Train each run with its environment variables set (a spawned-world body)."""
    out = []
    for env, args in runs:
        os.environ.update(env)
        try:
            out.append(train(load_config(None, base + args), log=lambda _m: None,
                             progress=False).losses)
        finally:
            for k in env:
                os.environ.pop(k, None)
    return out


LAYOUTS = {
    "zero1": ["--parallel.dp=2", "--parallel.zero=1", "--train.micro_batch=2"],
    "zero2": ["--parallel.dp=2", "--parallel.zero=2", "--train.micro_batch=2"],
    "zero3": ["--parallel.dp=2", "--parallel.zero=3", "--train.micro_batch=2"],
    "tp2": ["--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=2"],
    "pp2": ["--parallel.pp=2", "--train.micro_batch=1"],
}


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(corpus_dir: Path, cache_dir: Path,
                                                             tmp_path: Path) -> None:
    base = base_args(corpus_dir, cache_dir) + [
        "--precision.dtype=fp16", "--train.steps=3", "--train.checkpoint_every=1",
        "--precision.loss_scale=1024"]
    poison = {"MESHLM_FAULT_INF_GRAD": "2:1"}  # step 2, rank 1
    runs = [(poison, args + [f"--run.dir={tmp_path / name}"]) for name, args in LAYOUTS.items()]
    reduce_runs = {  # bf16 gradient reductions against fp32 ones (fp32 compute)
        f"{engine}-{dtype}": ["--parallel.dp=2", f"--parallel.zero={zero}",
                              "--train.micro_batch=2", f"--precision.grad_reduce_dtype={dtype}",
                              "--precision.dtype=fp32", "--train.steps=8",
                              "--train.checkpoint_every=0"]
        for engine, zero in (("ddp", 0), ("zero2", 2)) for dtype in ("fp32", "bf16")}
    runs += [({}, args + [f"--run.dir={tmp_path / name}"]) for name, args in reduce_runs.items()]
    results = run_world(2, runs_with_env, base, runs)[0]
    for name in LAYOUTS:
        recs = read_metrics(tmp_path / name / "metrics.jsonl")  # written by rank 0
        assert [r["skipped"] for r in recs] == [False, True, False], name
        assert [r["loss_scale"] for r in recs] == [1024.0, 512.0, 512.0], name
        assert recs[1]["grad_norm"] is None and recs[2]["grad_norm"] > 0, name
        assert recs[-1]["skipped_steps"] == 1, name
        ckpt = tmp_path / name / "checkpoints"
        w1, w2, w3 = ({n: p.detach() for n, p in load_model(ckpt / f"step_{s:07d}")
                       .named_parameters()} for s in (1, 2, 3))
        assert max_relative_difference(w2, w1)[0] == 0.0, name  # the skipped step: unchanged
        assert max_relative_difference(w3, w2)[0] > 0.0, name  # the next one trains
    # the loss scale reaches every backward root (a pipeline's last stage and aux losses
    # too): unscaled step-1 gradient norms agree across the layouts
    norms = [read_metrics(tmp_path / n / "metrics.jsonl")[0]["grad_norm"] for n in LAYOUTS]
    assert max(norms) / min(norms) < 1.02, norms
    losses = dict(zip(list(LAYOUTS) + list(reduce_runs), results, strict=True))
    for engine, op in (("ddp", "all_reduce/dp"), ("zero2", "reduce_scatter/dp")):
        full = read_metrics(tmp_path / f"{engine}-fp32" / "metrics.jsonl")[-1]["comm_bytes"]
        half = read_metrics(tmp_path / f"{engine}-bf16" / "metrics.jsonl")[-1]["comm_bytes"]
        assert half[op] * 2 == full[op], (engine, half, full)
        for step, loss in losses[f"{engine}-fp32"].items():
            assert abs(losses[f"{engine}-bf16"][step] - loss) / loss < 1e-2, (engine, step)


def test_bf16_tracks_fp32_over_50_steps(corpus_dir: Path, cache_dir: Path,
                                         tmp_path: Path) -> None:
    base = base_args(corpus_dir, cache_dir) + ["--train.steps=50", "--train.micro_batch=4",
                                              "--train.lr=3e-3", "--train.warmup_steps=5"]
    curves = {d: train(load_config(None, base + [f"--precision.dtype={d}",
                                                 f"--run.dir={tmp_path / d}"]),
                       log=lambda _m: None, progress=False).losses for d in ("fp32", "bf16")}
    assert curves["fp32"][50] < curves["fp32"][1] - 0.5  # it learned something
    for step, loss in curves["fp32"].items():
        assert abs(curves["bf16"][step] - loss) / loss < 0.02, (step, curves["bf16"][step], loss)
