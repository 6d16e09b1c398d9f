"""Out of memory, anywhere, is one line: ``torch.OutOfMemoryError`` raised on rank 1 of a
2-rank world (``meshlm train``, local workers) in each phase of a run -- construction,
checkpoint load, forward, backward (also inside a pipeline), optimizer step, evaluation,
checkpoint save, sampling. Every rank stops, the command exits 1 with one ``meshlm: error:``
line naming the phase, the rank, the bytes, the planner's estimate and the levers, no
traceback; a save that runs out leaves no partial checkpoint and the run resumes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from meshlm.config import load_config
from meshlm.distributed.phases import PHASES, phase, phase_of
from meshlm.planner.cli import config_vocab, config_workload, oom_advice
from meshlm.planner.hardware import get_accelerator
from meshlm.planner.levers import levers
from meshlm.testing import run_cli
from meshlm.train.oom import asked_bytes, describe


@pytest.fixture(scope="module")
def args(corpus_dir: Path, cache_dir: Path) -> list[str]:
    return [
        "train", "--model.preset=tiny", f"--data.path={corpus_dir}",
        f"--data.cache_dir={cache_dir}", "--data.vocab_size=512", "--data.seq_len=32",
        "--train.global_batch=8", "--train.micro_batch=2", "--train.warmup_steps=2",
        "--train.log_every=1", "--train.peak_flops=1e10", "--parallel.dp=2",
        "--train.steps=4", "--train.eval_every=2", "--train.eval_batches=1",
        "--train.checkpoint_every=2", "--run.sample_tokens=4",
    ]


def _meshlm(argv: list[str], fault: str | None) -> subprocess.CompletedProcess:
    """``meshlm ARGV`` with the fault injected (run here: its workers fork from this process's
    forkserver; the console script itself is run by tests/test_readme.py and test_cli.py)."""
    return run_cli(argv, {"MESHLM_FAULT_OOM": fault} if fault else None)


def _one_line(proc: subprocess.CompletedProcess, where: str) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("meshlm: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = errors[0]
    assert line.startswith(f"meshlm: error: out of memory on rank 1 during {where}: "), line
    assert "tried to allocate 0.22 GiB with " in line and " GiB in use and " in line, line
    assert " GiB available" in line and "the planner estimates " in line, line
    assert "; to fit: " in line and " (saves " in line, line  # the planner's levers
    return line


@pytest.mark.parametrize("where", ["construction", "forward", "backward", "optimizer step",
                                   "evaluation", "sampling"])
def test_out_of_memory_in_each_phase_is_one_line(args: list[str], tmp_path: Path,
                                                 where: str) -> None:
    proc = _meshlm([*args, f"--run.dir={tmp_path / 'run'}"], f"{where}:1")
    _one_line(proc, where)


def test_out_of_memory_inside_a_pipeline(args: list[str], tmp_path: Path) -> None:
    """The pipeline executor marks its backward actions (pp = 2: rank 1 is the last stage)."""
    layout = ["--parallel.dp=1", "--parallel.pp=2", "--run.sample_tokens=0"]
    proc = _meshlm([*args, *layout, f"--run.dir={tmp_path / 'run'}"], "backward:1")
    _one_line(proc, "backward")


def test_out_of_memory_in_save_and_load_keeps_the_run_resumable(args: list[str],
                                                                tmp_path: Path) -> None:
    """The second save (step 4) runs out on rank 1: step 2's checkpoint stays the latest, no
    step-4 checkpoint exists; resuming runs out in the load; then the run resumes to the end."""
    run = tmp_path / "run"
    proc = _meshlm([*args, f"--run.dir={run}"], "checkpoint save:1:2")
    _one_line(proc, "checkpoint save")
    ckpts = run / "checkpoints"
    assert (ckpts / "step_0000002" / "index.json").is_file()
    assert not (ckpts / "step_0000004").exists()
    resume = [*args, f"--run.dir={run}", "--run.resume=auto"]
    _one_line(_meshlm(resume, "checkpoint load:1"), "checkpoint load")
    done = _meshlm(resume, None)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (ckpts / "step_0000004" / "index.json").is_file()


# ---------------------------------------------------------------------- the pieces alone
def test_phase_is_carried_by_the_exception_and_the_message_by_the_planner() -> None:
    with pytest.raises(torch.OutOfMemoryError) as info, phase("evaluation"), phase("forward"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0")
    assert phase_of(info.value) == "forward"  # the innermost phase
    assert asked_bytes(info.value) == 1.5 * 2**30
    assert set(PHASES) >= {"construction", "forward", "backward", "optimizer step",
                           "evaluation", "checkpoint save", "checkpoint load", "sampling"}
    cfg = load_config(None, ["--model.preset=small", "--train.micro_batch=16",
                             "--train.global_batch=16"])
    line = describe(cfg, 3, "backward", info.value, torch.device("cpu"), oom_advice)
    assert line.startswith("out of memory on rank 3 during backward: tried to allocate 1.50 "
                           "GiB with ") and "\n" not in line
    assert "; the planner estimates " in line and "; to fit: " in line, line
    # without the planner's advice (the trainer never imports the planner): bytes only
    alone = describe(cfg, 3, "backward", info.value, torch.device("cpu"))
    assert "planner" not in alone and alone.startswith(
        "out of memory on rank 3 during backward: tried to allocate 1.50 GiB with "), alone
    # the levers in the order of planner/levers.py: fitting ones by step time, then savings
    found = levers(config_workload(cfg, config_vocab(cfg)), cfg.layout(),
                   get_accelerator("h100-sxm"))
    assert found and all(v.saves > 0 for v in found)
    fit = [v for v in found if v.fits]
    assert [v.step_s for v in fit] == sorted(v.step_s for v in fit)
    assert found[:len(fit)] == fit


def test_a_layout_the_planner_says_does_not_fit_is_refused_in_one_line(tmp_path: Path) -> None:
    """Before any worker starts: one line with the estimate, the peak's phase and the levers
    ranked by the planner; nothing is written."""
    run = tmp_path / "run"
    proc = _meshlm(["train", "--model.preset=llama3-8b", "--data.vocab_size=32000",
                    "--data.seq_len=256", "--train.global_batch=8", f"--run.dir={run}"], None)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: layout "), proc.stderr
    assert "GiB per rank by the planner's estimate (peak at the " in lines[0]
    assert "to fit: train.micro_batch=" in lines[0] or "to fit: train.recompute=" in lines[0]
    assert not run.exists()
