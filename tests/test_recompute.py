"""Activation recomputation: same numbers, fewer activations.

Every layout -- one process, tp = 2 with sp, pp = 2 under 1F1B and zero-bubble, dp = 2 with
ZeRO-3, cp = 2 (ring), and a MoE model (aux loss on) alone and with ep = 2 -- trains to the
same losses, gradient norms and weights under ``train.recompute`` = selective, op and full as
under none (fp32, relative < 1e-6: recomputation replays the same kernels). Router statistics
are recorded once per forward, not again by the replays.

Memory: the activations a micro-batch leaves for backward (resident memory after the forward
and the loss, over the resident memory before them; large tensors are mmapped, so freed ones
leave) strictly decrease none > op, selective > full with eager attention, and op, full < none
with SDPA's flash kernel (where selective drops only the log-sum-exp: the kernel's output is the
output projection's input anyway); each is within 25 % of the planner's ``activations`` item.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshlm.layout import Layout
from meshlm.models.llama import build_model
from meshlm.models.presets import get_preset
from meshlm.parallel.extensions import apply_choices
from meshlm.parallel.loss import cross_entropy
from meshlm.planner.hardware import get_accelerator
from meshlm.planner.memory import stage_memory
from meshlm.planner.workload import ModelSpec, Workload
from meshlm.testing import final_weights, max_relative_difference, run_world, train_runs
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import pin_malloc_mmap_threshold

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 509, 32, 8, 4
MODES = ("none", "selective", "op", "full")


def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        f"--data.vocab_size={VOCAB}", f"--data.seq_len={SEQ}", f"--train.steps={STEPS}",
        f"--train.global_batch={GLOBAL_BATCH}", "--train.warmup_steps=1", "--train.eval_every=0",
        "--run.sample_tokens=0", "--train.peak_flops=1e10", "--train.grad_clip=0.5",
    ]


# Layouts of a world of 2 (name, overrides); every one runs each recompute mode.
LAYOUTS: list[tuple[str, list[str]]] = [
    ("tp2-sp", ["--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=4"]),
    ("pp2-1f1b", ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--train.micro_batch=2"]),
    ("pp2-zb", ["--parallel.pp=2", "--parallel.pp_schedule=zb", "--train.micro_batch=2"]),
    ("dp2-zero3", ["--parallel.dp=2", "--parallel.zero=3", "--train.micro_batch=2"]),
    ("cp2-ring", ["--parallel.cp=2", "--parallel.cp_attention=ring", "--train.micro_batch=4"]),
    ("moe-ep2", ["--model.preset=tiny-moe", "--parallel.dp=2", "--parallel.ep=2",
                 "--train.micro_batch=2", "--model.moe_aux_loss_coef=0.01"]),
]


def check_same(run_dir: Path, losses: dict[int, float], ref_dir: Path,
               ref_losses: dict[int, float]) -> None:
    for step, loss in ref_losses.items():
        assert abs(losses[step] - loss) / loss < 1e-6, (run_dir.name, step, loss, losses[step])
    got = [r["grad_norm"] for r in read_metrics(run_dir / "metrics.jsonl")]
    ref = [r["grad_norm"] for r in read_metrics(ref_dir / "metrics.jsonl")]
    for g, r in zip(got, ref, strict=True):
        assert abs(g - r) / r < 1e-6, (run_dir.name, g, r)
    worst, name = max_relative_difference(final_weights(run_dir), final_weights(ref_dir))
    assert worst < 1e-6, (run_dir.name, name, worst)


def test_recompute_modes_match_in_one_process(corpus_dir: Path, cache_dir: Path,
                                              tmp_path: Path) -> None:
    base = base_args(corpus_dir, cache_dir)
    runs = [[f"--train.recompute={m}", "--train.micro_batch=4", f"--run.dir={tmp_path / m}"]
            for m in MODES]
    runs += [["--model.preset=tiny-moe", "--model.moe_aux_loss_coef=0.01",
              f"--train.recompute={m}", "--train.micro_batch=4",
              f"--run.dir={tmp_path / f'moe-{m}'}"] for m in MODES]
    results = train_runs(base, runs)
    for i, (args, losses) in enumerate(zip(runs, results, strict=True)):
        ref = i - i % len(MODES)  # the group's "none" run
        check_same(Path(args[-1].split("=", 1)[1]), losses,
                   Path(runs[ref][-1].split("=", 1)[1]), results[ref])
    # the replays do not record router statistics again: the recorded load is one forward's
    tokens = GLOBAL_BATCH * SEQ * 2  # top-2 copies per step
    for m in MODES:
        rec = read_metrics(tmp_path / f"moe-{m}" / "metrics.jsonl")[-1]["router"]
        for layer in rec.values():
            assert sum(layer["tokens_per_expert"]) == tokens, (m, layer)


def test_recompute_modes_match_in_every_layout(corpus_dir: Path, cache_dir: Path,
                                               tmp_path: Path) -> None:
    base = base_args(corpus_dir, cache_dir)
    runs = [args + [f"--train.recompute={m}", f"--run.dir={tmp_path / f'{name}-{m}'}"]
            for name, args in LAYOUTS for m in MODES]
    results = run_world(2, train_runs, base, runs)[0]
    for i, (args, losses) in enumerate(zip(runs, results, strict=True)):
        ref = i - i % len(MODES)
        check_same(Path(args[-1].split("=", 1)[1]), losses,
                   Path(runs[ref][-1].split("=", 1)[1]), results[ref])


# ---------------------------------------------------------------------- activation memory
def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _trim_heap() -> None:
    """Return the heap's free pages to the kernel (glibc ``malloc_trim``)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # another C library
        pass


def _activation_bytes(mode: str, cfg, batch: int, seq: int) -> int:  # noqa: ANN001
    """Resident bytes a forward + loss keeps for backward (second of two forwards).

    Measured as the drop in RSS when the autograd graph is released (its saved tensors are
    freed and the heap trimmed), not as the growth over the forward: memory an earlier test
    left alive and freed during the forward would otherwise be subtracted.
    """
    torch.manual_seed(0)
    model = build_model(cfg)
    apply_choices(model, recompute=mode)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    held = 0
    for _ in range(2):
        gc.collect()
        _trim_heap()
        loss = cross_entropy(model(ids[:, :-1]), ids[:, 1:])
        with_graph = _rss()
        del loss
        gc.collect()
        _trim_heap()
        held = with_graph - _rss()
    return held


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def _measure_modes(cfg, batch: int, seq: int) -> dict[bool, dict[str, int]]:  # noqa: ANN001
    """World body: :func:`_activation_bytes` of every mode, math and flash attention, in a
    process of its own (a heap another test has fragmented returns its pages differently)."""
    pin_malloc_mmap_threshold()  # (as the trainer: buffers above 128 KiB are mmapped)
    out = {}
    for flash in (False, True):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION if flash else SDPBackend.MATH):
            out[flash] = {m: _activation_bytes(m, cfg, batch, seq) for m in MODES}
    return out


def test_recompute_lowers_activations_as_the_planner_predicts() -> None:
    cfg = get_preset("tiny").with_(dim=256, n_heads=4, n_kv_heads=4, ffn_hidden=688,
                                   n_layers=4, vocab_size=4096, max_seq_len=512)
    batch, seq = 4, 256
    every = run_world(1, _measure_modes, cfg, batch, seq)[0]
    for flash in (False, True):
        measured = every[flash]
        work = Workload(ModelSpec(cfg), seq, batch, dtype="fp32", states="fp32", flash=flash)
        for m in MODES:
            lo = Layout(micro_batch=batch, recompute=m)
            predicted = stage_memory(work, lo, get_accelerator("h100-sxm"), 0).items[
                "activations"]
            assert abs(measured[m] - predicted) / predicted < 0.25, (flash, m, measured,
                                                                      predicted)
        assert measured["none"] > measured["op"] > measured["full"], (flash, measured)
        assert measured["selective"] > measured["full"], (flash, measured)
        if flash:  # selective drops only the log-sum-exp (kilobytes, below the RSS noise)
            assert measured["selective"] <= measured["none"] * 1.03, measured
        else:  # eager attention: selective drops the (B, heads, S, S) probabilities
            assert measured["none"] > measured["selective"] + 8 * 2**20, measured
