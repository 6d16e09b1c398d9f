"""The chunked fused head + loss (``train.loss = chunked``) against torch's cross-entropy.

Function level: loss, head-input gradient and head-weight gradient equal torch's (relative
< 1e-5) for chunk sizes that do and do not divide the tokens, a scaled backward, and a
vocabulary-parallel head over tp = 2 with a padded vocabulary (each rank's shard; the input
gradient's partial sums add up to torch's). Training: losses, gradient norms and weights of
``loss=chunked`` in one process, tp = 2 (with and without sp), pp = 2 (zero-bubble) and
dp = 2 ZeRO-3 equal the torch loss's one-process run; sampling still sees logits.

Memory: for a 32k vocabulary the peak resident memory of the loss's forward + backward is
lower than torch's by more than the size of the fp32 logits.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshlm.config import load_config
from meshlm.distributed.comm import Comm
from meshlm.distributed.mesh import Mesh
from meshlm.layout import Layout
from meshlm.parallel.loss import chunked_cross_entropy, cross_entropy
from meshlm.testing import final_weights, max_relative_difference, run_world, train_runs
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import pin_malloc_mmap_threshold, train

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 509, 32, 8, 4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _case(n: int, h: int, v: int, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * 0.2
    t = torch.randint(0, v, (n,), generator=g)
    return x, w, t


def _torch_reference(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, scale: float):  # noqa: ANN202
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = cross_entropy((x @ w.t()).unsqueeze(0), t.unsqueeze(0))
    (loss * scale).backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 64, 100, 1000])
def test_chunked_equals_torch(chunk: int) -> None:
    x, w, t = _case(300, 32, 777)
    ref_loss, ref_dx, ref_dw = _torch_reference(x, w, t, 2.5)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_cross_entropy(xx, ww, t, chunk)
    (loss * 2.5).backward()
    assert rel(loss.detach(), ref_loss) < 1e-6
    assert rel(xx.grad, ref_dx) < 1e-5 and rel(ww.grad, ref_dw) < 1e-5
    with torch.no_grad():  # evaluation: the loss only
        assert rel(chunked_cross_entropy(x, w, t, chunk), ref_loss) < 1e-6


def vocab_parallel_body() -> dict[str, float]:
    """tp = 2 ranks, vocabulary 777 padded to 778: rank r holds rows [389 r, 389 (r + 1))."""
    comm = Comm(Mesh(Layout(tp=2), "cpu"))
    r = comm.rank("tp")
    x, w, t = _case(200, 32, 777, seed=1)
    ref_loss, ref_dx, ref_dw = _torch_reference(x, w, t, 1.0)
    per = 389
    start, valid = r * per, min(per, 777 - r * per)
    shard = torch.zeros(per, 32)
    shard[:valid] = w[start:start + valid]
    xx, ww = x.clone().requires_grad_(), shard.requires_grad_()
    loss = chunked_cross_entropy(xx, ww, t, 48, start, valid, comm)
    loss.backward()
    dx = xx.grad.clone()
    dist.all_reduce(dx)  # the head input operator's backward sums the partial gradients
    return {"loss": rel(loss.detach(), ref_loss), "dx": rel(dx, ref_dx),
            "dw": rel(ww.grad[:valid], ref_dw[start:start + valid]),
            "pad": float(ww.grad[valid:].abs().sum())}


def test_chunked_vocab_parallel() -> None:
    for out in run_world(2, vocab_parallel_body):
        assert out["loss"] < 1e-6 and out["dx"] < 1e-5 and out["dw"] < 1e-5, out
        assert out["pad"] == 0.0


def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        f"--data.vocab_size={VOCAB}", f"--data.seq_len={SEQ}", f"--train.steps={STEPS}",
        f"--train.global_batch={GLOBAL_BATCH}", "--train.warmup_steps=1", "--train.eval_every=2",
        "--train.eval_batches=1", "--run.sample_tokens=0", "--train.peak_flops=1e10",
        "--train.grad_clip=0.5",
    ]


def test_chunked_loss_trains_like_torch_in_every_layout(corpus_dir: Path, cache_dir: Path,
                                                        tmp_path: Path) -> None:
    base = base_args(corpus_dir, cache_dir)
    ref_dir = tmp_path / "torch"
    ref = train(load_config(None, base + ["--train.micro_batch=8", f"--run.dir={ref_dir}"]),
                log=lambda _m: None, progress=False)
    chunked = ["--train.loss=chunked", "--train.loss_chunk=100"]
    one = train(load_config(None, base + chunked + [
        "--train.micro_batch=4", f"--run.dir={tmp_path / 'one'}", "--run.sample_tokens=8"]),
        log=lambda _m: None, progress=False)
    assert one.sample  # sampling switches the model back to logits
    layouts = {
        "tp2": ["--parallel.tp=2", "--train.micro_batch=8"],
        "tp2-sp": ["--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=4"],
        "pp2-zb": ["--parallel.pp=2", "--parallel.pp_schedule=zb", "--train.micro_batch=2"],
        "dp2-zero3": ["--parallel.dp=2", "--parallel.zero=3", "--train.micro_batch=4"],
    }
    runs = [chunked + args + [f"--run.dir={tmp_path / name}"] for name, args in layouts.items()]
    results = run_world(2, train_runs, base, runs)[0]
    ref_weights = final_weights(ref_dir)
    ref_norms = [r["grad_norm"] for r in read_metrics(ref_dir / "metrics.jsonl")]
    ref_val = [r["val_loss"] for r in read_metrics(ref_dir / "metrics.jsonl") if "val_loss" in r]
    for name, losses in [("one", one.losses), *zip(layouts, results, strict=True)]:
        run_dir = tmp_path / name
        for step, loss in ref.losses.items():
            assert abs(losses[step] - loss) / loss < 1e-5, (name, step)
        recs = read_metrics(run_dir / "metrics.jsonl")
        for got, want in zip([r["grad_norm"] for r in recs], ref_norms, strict=True):
            assert abs(got - want) / want < 1e-5, (name, got, want)
        val = [r["val_loss"] for r in recs if "val_loss" in r]
        assert len(val) == len(ref_val) and all(
            abs(a - b) / b < 1e-5 for a, b in zip(val, ref_val, strict=True)), (name, val)
        worst, pname = max_relative_difference(final_weights(run_dir), ref_weights)
        assert worst < 1e-5, (name, pname, worst)


# ---------------------------------------------------------------------- memory
def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _loss_peak(kind: str, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> int:
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    gc.collect()
    _reset_peak()
    base = _peak_rss()
    if kind == "torch":
        loss = cross_entropy((xx @ ww.t()).unsqueeze(0), t.unsqueeze(0))
    else:
        loss = chunked_cross_entropy(xx, ww, t, 256)
    loss.backward()
    return _peak_rss() - base


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_chunked_loss_peak_memory_is_below_torch_by_the_logits() -> None:
    pin_malloc_mmap_threshold()
    n, h, v = 2048, 64, 32768
    x, w, t = _case(n, h, v, seed=2)
    logits_bytes = n * v * 4  # the fp32 logits of the micro-batch: 256 MiB
    peaks = {k: min(_loss_peak(k, x, w, t) for _ in range(2)) for k in ("torch", "chunked")}
    assert peaks["torch"] - peaks["chunked"] >= logits_bytes, peaks
