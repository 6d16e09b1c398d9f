"""Context parallelism (ring, zigzag, Ulysses) against the one-process run.

Attention alone: each mode's forward and backward on cp shards equal one process's attention
(causal, grouped-query heads), with both block kernels; the per-rank attention tiles (equal
under zigzag only) and the communication log against the modules' docstring formulas; peak
memory of one attention layer at a long sequence falls with cp.

Training: losses, gradient norms, validation loss, sample and final weights of cp = 2 and cp = 4
in each mode, and of cp = 2 with tp = 2 (+sp), with dp = 2 (zero 1, 2 and 3), with pp = 2 (1f1b,
zb and interleaved) and with a Mixture-of-Experts model, equal the one-process run; a checkpoint saved at cp = 4 resumes
at cp = 1 and one saved at cp = 1 resumes at cp = 2; the planner's cp volumes equal the log.

AdamW's ``eps`` is 1e-5 here (default 1e-8). Context parallelism splits every weight gradient's
sum over tokens differently from one process; both are equally close to the float64 gradient
(~3e-7 relative), but an element whose gradient is a near-cancelling sum (|g| ~ 1e-8) has a
relative rounding error near 1, and Adam's normalised first step ``g / (|g| + eps)`` turns it
into an lr-sized difference of that one element (2e-5 of its tensor's norm with eps = 1e-8).
eps = 1e-5 damps only such elements (typical |g| here is ~1e-3); tolerances stay at 1e-5.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshlm.config import load_config
from meshlm.testing import final_weights, max_relative_difference, run_world
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

VOCAB, SEQ, GLOBAL_BATCH, STEPS, HALF = 509, 32, 8, 5, 3


# ---------------------------------------------------------------------- attention alone
def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def attention_checks(cp: int) -> dict:
    """World body: every mode and kernel on this rank's shards vs the whole-sequence attention."""
    from meshlm.distributed.comm import Comm, CommLog
    from meshlm.distributed.mesh import Mesh
    from meshlm.layout import Layout
    from meshlm.parallel.context import ContextParallel

    b, nh, nkv, s, hd = 2, 8, 4, 64, 16
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(b, nh, s, hd, generator=g) for _ in range(2))
    k, v = (torch.randn(b, nkv, s, hd, generator=g) for _ in range(2))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    out_ref.backward(do)
    results = {}
    for mode in ("zigzag", "ring", "ulysses"):
        for kernel in ("flash", "math"):
            comm = Comm(Mesh(Layout(cp=cp, cp_attention=mode)), CommLog())
            ctx = ContextParallel(comm, mode, kernel)
            mine = [ctx.shard(t, 2).clone().requires_grad_() for t in (q, k, v)]
            comm.log.reset()
            out = ctx.attention(*mine)
            forward_log = comm.log.bytes_by_op()
            out.backward(ctx.shard(do, 2))
            errors = {"out": _relative(out, ctx.shard(out_ref, 2))}
            for name, t, r in zip(("dq", "dk", "dv"), mine, ref, strict=True):
                errors[name] = _relative(t.grad, ctx.shard(r.grad, 2))
            results[(mode, kernel)] = {
                "errors": errors, "tiles": ctx.tiles(), "forward": forward_log,
                "total": comm.log.bytes_by_op(), "sends": comm.log.count("send", "cp"),
                "a2a": comm.log.count("all_to_all", "cp")}
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_matches_one_process(cp: int) -> None:
    b, nh, nkv, s, hd = 2, 8, 4, 64, 16
    kv_bytes = 2 * b * nkv * (s // cp) * hd * 4  # this rank's K and V, fp32
    per_head = b * (s // cp) * hd * 4
    ranks = run_world(cp, attention_checks, cp)
    for rank, res in enumerate(ranks):
        for (mode, kernel), r in res.items():
            worst = max(r["errors"].values())
            assert worst < 1e-5, (cp, rank, mode, kernel, r["errors"])
            if mode == "ulysses":
                # four all-to-alls forward (q, k, v, output), four backward
                assert r["a2a"] == 8
                assert r["forward"] == {"all_to_all/cp": (2 * nh + 2 * nkv) * per_head}
                assert r["total"] == {"all_to_all/cp": 2 * (2 * nh + 2 * nkv) * per_head}
                continue
            # cp - 1 hops of K/V forward; backward cp - 1 of K/V and cp - 1 of dK/dV
            assert r["forward"] == {"send/cp": (cp - 1) * kv_bytes,
                                    "recv/cp": (cp - 1) * kv_bytes}
            assert r["total"] == {"send/cp": 3 * (cp - 1) * kv_bytes,
                                  "recv/cp": 3 * (cp - 1) * kv_bytes}
            assert r["sends"] == 5 * (cp - 1)  # K and V apart, dK/dV together
    for kernel in ("flash", "math"):
        zigzag = [res[("zigzag", kernel)]["tiles"] for res in ranks]
        ring = [res[("ring", kernel)]["tiles"] for res in ranks]
        assert zigzag == [2 * cp + 1] * cp  # balanced
        assert ring == [4 * r + 3 for r in range(cp)]  # the last rank does the most
        assert sum(ring) == sum(zigzag)  # same work in total


def attention_memory(mode: str, s: int) -> dict:
    """World body: peak resident growth of one attention layer's forward + backward (its
    projections, rotary embedding and attention) on this rank's share of a sequence."""
    import torch.distributed as dist

    from meshlm.distributed.comm import Comm
    from meshlm.distributed.mesh import Mesh
    from meshlm.layout import Layout
    from meshlm.models.config import ModelConfig
    from meshlm.models.llama import Attention, rope_tables
    from meshlm.parallel.context import ContextParallel
    from meshlm.train.trainer import pin_malloc_mmap_threshold

    pin_malloc_mmap_threshold()
    cp = dist.get_world_size() if dist.is_initialized() else 1
    cfg = ModelConfig(name="wide", vocab_size=64, dim=512, n_layers=1, n_heads=8, n_kv_heads=4,
                      ffn_hidden=64, max_seq_len=s)
    torch.manual_seed(0)
    layer = Attention(cfg)
    cos, sin = rope_tables(cfg.hd, s, cfg.rope_theta)
    x = torch.randn(1, s, cfg.dim, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(1, s, cfg.dim, generator=torch.Generator().manual_seed(2))
    if cp > 1:
        ctx = ContextParallel(Comm(Mesh(Layout(cp=cp, cp_attention=mode))), mode)
        layer.core = ctx.attention
        x, dy, cos, sin = (ctx.shard(t, t.dim() - 2).clone() for t in (x, dy, cos, sin))
    x.requires_grad_()

    def resident() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM")

    layer(x, cos, sin).backward(dy)  # warm-up: communication buffers, kernel workspaces
    x.grad = None
    layer.zero_grad(set_to_none=False)
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to now
    base = resident()
    layer(x, cos, sin).backward(dy)
    return {"growth": resident() - base, "shard": x.numel() * 4}


def test_attention_memory_falls_with_cp() -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to measure peak resident memory")
    s = 3072  # (the ratios below are the same at 6144: every buffer is linear in s)
    one = run_world(1, attention_memory, "zigzag", s)[0]["growth"]
    two = max(r["growth"] for r in run_world(2, attention_memory, "zigzag", s))
    four = max(r["growth"] for r in run_world(4, attention_memory, "zigzag", s))
    assert four < two < one, (four, two, one)
    assert four < 0.6 * one, (four / 2**20, one / 2**20)
    # every buffer is (s/cp)-sized: half the sequence, about half the peak (s x s scores would
    # give a quarter; at 8 heads x 3072^2 fp32 they alone are 288 MiB)
    shorter = max(r["growth"] for r in run_world(4, attention_memory, "zigzag", s // 2))
    assert four < 2.3 * shorter, (four / 2**20, shorter / 2**20)
    ulysses = max(r["growth"] for r in run_world(4, attention_memory, "ulysses", s))
    assert ulysses < 0.6 * one, (ulysses / 2**20, one / 2**20)


# ---------------------------------------------------------------------- training
def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", "--model.n_layers=4", f"--data.path={corpus}",
        f"--data.cache_dir={cache}", f"--data.vocab_size={VOCAB}", f"--data.seq_len={SEQ}",
        f"--train.steps={STEPS}", f"--train.global_batch={GLOBAL_BATCH}",
        "--train.warmup_steps=2", f"--train.eval_every={STEPS}", "--train.eval_batches=2",
        "--run.sample_tokens=0",
        "--train.peak_flops=1e10", "--train.grad_clip=0.5", "--train.eps=1e-5",
        f"--train.checkpoint_every={HALF}",
    ]


def cut_copy(src: Path, dst: Path) -> None:
    """``dst``: the run ``src`` as it was after its step-HALF checkpoint."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").iterdir():
        if int(ckpt.name.split("_")[1]) > HALF:
            shutil.rmtree(ckpt)


def train_all(base: list[str], runs: list[list[str]]) -> list[dict[int, float]]:
    """World body: train ``base + run`` for each run (resumes included); their losses (and
    the sample text at key -1 when one was asked for)."""
    out = []
    for r in runs:
        res = train(load_config(None, base + r), log=lambda _m: None, progress=False)
        out.append({**res.losses, **({-1: res.sample} if res.sample else {})})
    return out


@pytest.fixture(scope="module")
def references(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One-process runs of the dense and the MoE model (checkpoints at steps 3 and 5)."""
    root = tmp_path_factory.mktemp("cp")
    base = base_args(corpus_dir, cache_dir)
    out = {}
    for name, extra in (("dense", ["--run.sample_tokens=8"]), ("moe", ["--model.preset=tiny-moe"])):
        run_dir = root / f"reference-{name}"
        res = train(load_config(None, base + extra + ["--train.micro_batch=8",
                                                      f"--run.dir={run_dir}"]),
                    log=lambda _m: None, progress=False)
        records = read_metrics(run_dir / "metrics.jsonl")
        norms = [r["grad_norm"] for r in records]
        assert res.sample or name == "moe"
        out[name] = (res.losses, final_weights(run_dir), norms, records[-1]["val_loss"],
                     res.sample)
    return base, root, out


def check_parity(run_dir: Path, losses: dict, reference: tuple) -> None:
    ref_losses, ref_weights, ref_norms, ref_val, ref_sample = reference
    if -1 in losses:  # whole sequences sampled by every cp rank alone: the same text
        assert losses.pop(-1) == ref_sample, run_dir.name
    for step, loss in losses.items():
        assert abs(loss - ref_losses[step]) / ref_losses[step] < 1e-5, (run_dir.name, step)
    worst, name = max_relative_difference(final_weights(run_dir), ref_weights)
    assert worst < 1e-5, (run_dir.name, name, worst)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert min(ref_norms) > 0.5  # clipping is active on every step
    for rec in records:
        ref = ref_norms[rec["step"] - 1]
        assert abs(rec["grad_norm"] - ref) / ref < 1e-5, (run_dir.name, rec["step"])
    assert abs(records[-1]["val_loss"] - ref_val) / ref_val < 1e-5, run_dir.name  # (cp shards)


def _dir(args: list[str]) -> Path:
    return Path(next(a for a in args if a.startswith("--run.dir=")).split("=", 1)[1])


def test_cp2_each_mode_moe_and_resume_from_one_process(references) -> None:  # noqa: ANN001
    base, root, refs = references
    runs = [["--parallel.cp=2", f"--parallel.cp_attention={mode}", f"--train.micro_batch={mb}",
             f"--run.dir={root / f'cp2-{mode}'}"]
            for mode, mb in (("zigzag", 8), ("ring", 4), ("ulysses", 8))]
    runs[0].append("--run.sample_tokens=8")
    runs.append(["--model.preset=tiny-moe", "--parallel.cp=2", "--train.micro_batch=8",
                 f"--run.dir={root / 'cp2-moe'}"])
    # a checkpoint written by one process resumes on cp = 2
    cut_copy(root / "reference-dense", root / "one-to-cp2")
    runs.append(["--parallel.cp=2", "--train.micro_batch=8", "--run.resume=true",
                 f"--run.dir={root / 'one-to-cp2'}"])
    results = run_world(2, train_all, base, runs)[0]
    for args, losses in zip(runs, results, strict=True):
        run_dir = _dir(args)
        check_parity(run_dir, losses, refs["moe" if "moe" in run_dir.name else "dense"])
    assert sorted(results[-1]) == [4, 5]  # resumed after step 3
    recs = {a[1].split("=")[1]: read_metrics(_dir(a) / "metrics.jsonl")[-1] for a in runs[:3]}
    assert recs["zigzag"]["cp_attention"] == "zigzag"
    # per step: 4 layers x micro-batches x tiles per forward (5 each under zigzag at cp = 2)
    assert recs["zigzag"]["cp_tiles_per_rank"] == [4 * 1 * 5] * 2
    assert recs["ring"]["cp_tiles_per_rank"] == [4 * 2 * 3, 4 * 2 * 7]
    assert "cp_tiles_per_rank" not in recs["ulysses"]


def test_cp4_modes_and_compositions(references) -> None:  # noqa: ANN001
    base, root, refs = references
    runs = [["--parallel.cp=4", f"--parallel.cp_attention={mode}", "--train.micro_batch=8",
             f"--run.dir={root / f'cp4-{mode}'}"] for mode in ("zigzag", "ring", "ulysses")]
    runs += [
        ["--parallel.cp=2", "--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=8",
         f"--run.dir={root / 'cp2-tp2-sp'}"],
        ["--parallel.cp=2", "--parallel.dp=2", "--parallel.zero=1", "--train.micro_batch=4",
         "--parallel.bucket_mb=0.05", f"--run.dir={root / 'cp2-dp2-zero1'}"],
        ["--parallel.cp=2", "--parallel.dp=2", "--parallel.zero=3",
         "--parallel.cp_attention=ulysses", "--train.micro_batch=2",
         f"--run.dir={root / 'cp2-dp2-zero3'}"],
        ["--parallel.cp=2", "--parallel.pp=2", "--train.micro_batch=2",
         f"--run.dir={root / 'cp2-pp2-1f1b'}"],
        ["--parallel.cp=2", "--parallel.dp=2", "--parallel.zero=2", "--train.micro_batch=2",
         "--parallel.cp_attention=ring", f"--run.dir={root / 'cp2-dp2-zero2'}"],
        ["--parallel.cp=2", "--parallel.pp=2", "--parallel.pp_schedule=zb",
         "--parallel.cp_attention=ulysses", "--train.micro_batch=2",
         f"--run.dir={root / 'cp2-pp2-zb'}"],
        ["--parallel.cp=2", "--parallel.pp=2", "--parallel.pp_schedule=interleaved",
         "--parallel.pp_virtual=2", "--parallel.cp_attention=ring", "--train.micro_batch=2",
         f"--run.dir={root / 'cp2-pp2-interleaved'}"],
    ]
    results = run_world(4, train_all, base, runs)[0]
    for args, losses in zip(runs, results, strict=True):
        check_parity(_dir(args), losses, refs["dense"])
    # a checkpoint written at cp = 4 resumes in one process
    cut_copy(root / "cp4-zigzag", root / "cp4-to-one")
    losses = train(load_config(None, base + ["--train.micro_batch=8", "--run.resume=true",
                                             f"--run.dir={root / 'cp4-to-one'}"]),
                   log=lambda _m: None, progress=False).losses
    assert sorted(losses) == [4, 5]
    check_parity(root / "cp4-to-one", losses, refs["dense"])
    zigzag = read_metrics(root / "cp4-zigzag" / "metrics.jsonl")[-1]["cp_tiles_per_rank"]
    ring = read_metrics(root / "cp4-ring" / "metrics.jsonl")[-1]["cp_tiles_per_rank"]
    assert zigzag == [4 * 9] * 4 and ring == [4 * t for t in (3, 7, 11, 15)]
    # the planner's volumes per step are the measured comm log's
    from meshlm.models.config import ModelConfig
    from meshlm.planner import Workload, comm_volumes
    from meshlm.planner.workload import ModelSpec

    for name in ("cp4-zigzag", "cp4-ulysses", "cp2-dp2-zero1", "cp2-dp2-zero3"):
        cfg = load_config(root / name / "config.toml")
        model = ModelConfig.from_dict(read_metrics_model(root / name))
        work = Workload(ModelSpec(model), SEQ, GLOBAL_BATCH, dtype="fp32", states="fp32")
        predicted = comm_volumes(work, cfg.layout())
        measured = read_metrics(root / name / "metrics.jsonl")[-1]["comm_bytes"]
        for key in set(predicted) | set(measured):
            if key.endswith("/cp"):
                assert measured.get(key) == predicted.get(key), (name, key)
            elif key.endswith("/dp_cp"):  # flat buffers are padded to a multiple of dp x cp
                assert measured[key] == pytest.approx(predicted[key], rel=1e-3), (name, key)


def read_metrics_model(run_dir: Path) -> dict:
    """The model config of a run's latest checkpoint (its trainer.json)."""
    import json

    latest = sorted((run_dir / "checkpoints").iterdir())[-1]
    return json.loads((latest / "trainer.json").read_text())["model"]


def test_cp_bad_layouts_are_refused_before_training(corpus_dir: Path, cache_dir: Path,
                                                    tmp_path: Path) -> None:
    from meshlm.config import ConfigError

    base = base_args(corpus_dir, cache_dir) + ["--train.micro_batch=8", f"--run.dir={tmp_path / 'r'}"]
    cases = {
        ("--parallel.cp=8", "--parallel.cp_attention=ulysses"):
            "parallel.cp=8 does not divide the 4 KV heads of each tp rank",
        ("--parallel.cp=2", "--parallel.tp=4", "--parallel.cp_attention=ulysses"):
            "parallel.cp=2 does not divide the 1 KV heads of each tp rank",
        ("--parallel.cp=3",): "data.seq_len=32 is not divisible by 2 * cp (zigzag)",
        ("--parallel.cp=3", "--parallel.cp_attention=ring"):
            "data.seq_len=32 is not divisible by cp",
        ("--parallel.cp=8", "--parallel.tp=4", "--parallel.sp=true", "--data.seq_len=48",
         "--parallel.cp_attention=ring"):
            "parallel.sp=true: data.seq_len / cp = 6 is not divisible by parallel.tp=4",
        ("--parallel.cp=2", "--parallel.cp_attention=star"):
            "parallel.cp_attention='star' is not one of zigzag, ring, ulysses",
    }
    for args, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, base + list(args))
    load_config(None, base + ["--parallel.cp=4", "--parallel.tp=2", "--parallel.sp=true"])
    assert not (tmp_path / "r").exists()  # nothing was started or written
