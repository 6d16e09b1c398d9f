"""Every layout that sends point-to-point or waits on handles, in NCCL-semantics mode, against
the one-process run: every pipeline schedule, ring / zigzag / Ulysses attention, the expert
all-to-all, DiLoCo and ZeRO-3's prefetch (``MESHLM_NCCL_SEMANTICS=1``: gloo keeping NCCL's
rules, meshlm/distributed/nccl_semantics.py). Same seed and global batch, fp32, the tolerances
of the plain parity tests (losses and weights within 1e-5 relative).

One spawned world of 4 runs every layout in turn; the references run in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlm.config import load_config
from meshlm.distributed import nccl_semantics
from meshlm.testing import final_weights, max_relative_difference, run_world, train_runs
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

STEPS, GLOBAL_BATCH = 3, 8
SGD_SYNC = ["--train.optimizer=sgd", "--train.lr=0.05", "--train.min_lr=0.005",
            "--diloco.inner_steps=1", "--diloco.outer_lr=1", "--diloco.outer_momentum=0",
            "--train.grad_clip=0"]
# (name, reference key, arguments) -- the world is 4 ranks
LAYOUTS = [
    *[(f"pp2-dp2-{s}", "dense", ["--parallel.pp=2", "--parallel.dp=2",
                                 f"--parallel.pp_schedule={s}",
                                 f"--parallel.pp_virtual={2 if s == 'interleaved' else 1}",
                                 "--train.micro_batch=1"])
      for s in ("afab", "1f1b", "interleaved", "zb")],
    ("pp4-1f1b", "dense", ["--parallel.pp=4", "--train.micro_batch=2"]),
    *[(f"cp2-dp2-{mode}", "dense", ["--parallel.cp=2", "--parallel.dp=2",
                                    f"--parallel.cp_attention={mode}", "--train.micro_batch=4"])
      for mode in ("ring", "zigzag", "ulysses")],
    ("dp4-zero3", "dense", ["--parallel.dp=4", "--parallel.zero=3", "--train.micro_batch=2",
                            "--parallel.bucket_mb=0.05"]),
    ("dp4-ep4-moe", "moe", ["--model.preset=tiny-moe", "--parallel.dp=4", "--parallel.ep=4",
                            "--train.micro_batch=2"]),
    ("diloco-2x-dp2", "sgd", ["--parallel.islands=2", "--parallel.dp=2", "--train.micro_batch=2",
                              *SGD_SYNC]),
]
REFERENCES = {"dense": [], "moe": ["--model.preset=tiny-moe"], "sgd": SGD_SYNC}


def _base(corpus: Path, cache: Path) -> list[str]:
    return ["--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
            "--data.vocab_size=512", "--data.seq_len=32", "--model.n_layers=4",
            f"--train.steps={STEPS}", f"--train.global_batch={GLOBAL_BATCH}",
            "--train.warmup_steps=2", "--train.eval_every=0", "--run.sample_tokens=0",
            "--train.peak_flops=1e10", "--train.grad_clip=0.5", "--train.eps=1e-5"]


def test_every_p2p_and_handle_layout_matches_one_process_under_nccl_rules(
        corpus_dir: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _base(corpus_dir, cache_dir)
    refs = {}
    for key, extra in REFERENCES.items():
        run_dir = tmp_path / f"ref-{key}"
        res = train(load_config(None, base + extra + ["--train.micro_batch=8",
                                                      f"--run.dir={run_dir}"]),
                    log=lambda _m: None, progress=False)
        refs[key] = (res.losses, final_weights(run_dir))
    runs = [[*args, f"--run.dir={tmp_path / name}"] for name, _, args in LAYOUTS]
    monkeypatch.setenv(nccl_semantics.ENV, "1")  # the spawned ranks inherit it
    results = run_world(4, train_runs, base, runs)[0]
    for (name, key, _), losses in zip(LAYOUTS, results, strict=True):
        ref_losses, ref_weights = refs[key]
        if key == "sgd":  # DiLoCo: rank 0's loss is its island's; the mean is outer_loss
            losses = {r["step"]: r["outer_loss"]
                      for r in read_metrics(tmp_path / name / "metrics.jsonl")}
        assert sorted(losses) == sorted(ref_losses), name
        for step, loss in ref_losses.items():
            assert abs(losses[step] - loss) / loss < 1e-5, (name, step, losses[step], loss)
        worst, tensor = max_relative_difference(final_weights(tmp_path / name), ref_weights)
        assert worst < 1e-5, (name, tensor, worst)
