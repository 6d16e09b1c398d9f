"""Restarts and resume modes: the run-dir rules of ``run.resume`` (false / true / auto, and a
restarted worker group reading false as auto), then whole runs whose workers are killed.

The end-to-end runs start ``meshlm train`` with 4 workers (dp=2 x tp=2 on `tiny`) and kill the
highest rank with the test fault injectors of :mod:`meshlm.distributed.faults`
(``MESHLM_FAULT_KILL_AT_STEP``, ``MESHLM_FAULT_KILL_IN_SAVE``; first attempt only). A restarted
or resumed run must end with exactly the weights of an uninterrupted one.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

import meshlm.train.run_dir as run_dir_module
from meshlm import load_model
from meshlm.config import Config, ConfigError, load_config, to_toml
from meshlm.distributed.comm import Comm, CommLog
from meshlm.distributed.mesh import Mesh
from meshlm.testing import run_cli
from meshlm.train.metrics import read_metrics
from meshlm.train.run_dir import (
    agree_run_dir,
    check_resume_compatible,
    plan_run_dir,
    resolve_run_dir,
    restart_count,
)


# ---------------------------------------------------------------------- run-dir rules
@pytest.fixture()
def checkpoints(monkeypatch: pytest.MonkeyPatch) -> dict[Path, Path]:
    """Stand-in for ``latest_valid``: run dir -> its latest valid checkpoint (none by default).

    The rules only need the answer; the end-to-end tests below use real checkpoints.
    """
    found: dict[Path, Path] = {}

    def latest_valid(root: Path, log=print) -> Path | None:  # noqa: ANN001
        return found.get(root.parent)

    monkeypatch.setattr(run_dir_module, "latest_valid", latest_valid)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return found


def _cfg(run: Path, resume: str = "false", *extra: str) -> Config:
    return load_config(None, ["--model.preset=tiny", "--data.seq_len=32", f"--run.dir={run}",
                              f"--run.resume={resume}", *extra])


def _started_run(path: Path, *extra: str) -> Path:
    """A run dir as a run that died before its first checkpoint leaves it."""
    path.mkdir(parents=True)
    (path / "config.toml").write_text(to_toml(_cfg(path, "false", *extra)))
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    return path


def _with_checkpoint(path: Path, found: dict[Path, Path], *extra: str) -> Path:
    _started_run(path, *extra)
    ckpt = path / "checkpoints" / "step_0000002"
    ckpt.mkdir(parents=True)
    found[path] = ckpt
    return ckpt


def test_false_refuses_a_run_dir_with_files(tmp_path: Path, checkpoints: dict[Path, Path]
                                            ) -> None:
    run = _started_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="already holds files; pass --run.resume=true"):
        resolve_run_dir(_cfg(run))
    assert resolve_run_dir(_cfg(tmp_path / "new")) == tmp_path / "new"  # nothing created
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("exists", [False, True])
def test_auto_starts_fresh_in_an_empty_or_new_dir(tmp_path: Path, exists: bool,
                                                  checkpoints: dict[Path, Path]) -> None:
    run = tmp_path / "run"
    if exists:
        run.mkdir()
    assert plan_run_dir(_cfg(run, "auto")) == (run, None)


def test_auto_resumes_from_the_latest_checkpoint(tmp_path: Path, checkpoints: dict[Path, Path]
                                                 ) -> None:
    run = tmp_path / "run"
    ckpt = _with_checkpoint(run, checkpoints)
    assert plan_run_dir(_cfg(run, "auto")) == (run, ckpt)
    assert plan_run_dir(_cfg(run, "true")) == (run, ckpt)


def test_auto_starts_over_a_run_that_died_before_its_first_checkpoint(
        tmp_path: Path, checkpoints: dict[Path, Path]) -> None:
    run = _started_run(tmp_path / "run")
    lines: list[str] = []
    assert plan_run_dir(_cfg(run, "auto"), log=lines.append) == (run, None)
    assert lines == [f"run.resume=auto: {run} holds no complete checkpoint; starting at step 0"]
    with pytest.raises(ConfigError, match="run.resume=true but .* holds no complete checkpoint"):
        plan_run_dir(_cfg(run, "true"))


@pytest.mark.parametrize("with_checkpoint", [False, True])
def test_auto_refuses_an_incompatible_run(tmp_path: Path, with_checkpoint: bool,
                                          checkpoints: dict[Path, Path]) -> None:
    run = tmp_path / "run"
    if with_checkpoint:
        _with_checkpoint(run, checkpoints)
    else:
        _started_run(run)
    with pytest.raises(ConfigError) as err:
        plan_run_dir(_cfg(run, "auto", "--model.n_layers=3"))
    assert str(err.value) == (f"run.resume: [model] differs from the saved config of {run} "
                              "(model.n_layers: saved None, now 3)")
    with pytest.raises(ConfigError, match="train.seed=7 differs from the saved 1234"):
        plan_run_dir(_cfg(run, "auto", "--train.seed=7"))


def test_auto_refuses_a_dir_that_is_not_a_run(tmp_path: Path, checkpoints: dict[Path, Path]
                                              ) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds files but no config.toml"):
        plan_run_dir(_cfg(tmp_path, "auto"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        plan_run_dir(_cfg(tmp_path / "file", "auto"))


def test_restarted_group_reads_false_as_auto(tmp_path: Path, checkpoints: dict[Path, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    ckpt = _with_checkpoint(run, checkpoints)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lines: list[str] = []
    assert plan_run_dir(_cfg(run), log=lines.append) == (run, ckpt)
    assert len(lines) == 1 and lines[0].startswith("run.resume=false read as auto: the worker "
                                                   "group was restarted (1)")
    # no checkpoint yet (died before the first one): the restarted group starts over
    fresh = _started_run(tmp_path / "fresh")
    assert plan_run_dir(_cfg(fresh), log=lines.append) == (fresh, None)
    # ... but still refuses a different run
    with pytest.raises(ConfigError, match=r"\[model\] differs"):
        plan_run_dir(_cfg(run, "false", "--model.n_layers=3"))
    # the first start of a group refuses, as before
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(ConfigError, match="already holds files"):
        plan_run_dir(_cfg(run))


def test_restart_count() -> None:
    assert restart_count({}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "3"}) == 3
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "x"}) == 0


def test_agree_run_dir_settles_the_mode(tmp_path: Path, checkpoints: dict[Path, Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """After agree_run_dir, run.resume says what the trainer does: "true" resume, "false" not."""
    run = tmp_path / "run"
    cfg = _cfg(run, "auto")
    comm = Comm(Mesh(cfg.layout()), CommLog())
    agreed, folder = agree_run_dir(cfg, comm)
    assert folder == run and agreed.run.resume == "false" and cfg.run.resume == "auto"
    _with_checkpoint(run, checkpoints)
    agreed, folder = agree_run_dir(_cfg(run, "auto"), comm)
    assert folder == run and agreed.run.resume == "true"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    agreed, folder = agree_run_dir(_cfg(run, "false"), comm, log=lambda _m: None)
    assert folder == run and agreed.run.resume == "true"


def test_compatibility_without_a_saved_config(tmp_path: Path) -> None:
    check_resume_compatible(_cfg(tmp_path), tmp_path)  # nothing saved, nothing to compare


# ---------------------------------------------------------------------- killed workers
LAYOUT = ["--parallel.dp=2", "--parallel.tp=2"]


def _meshlm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``meshlm ARGS`` with the faults in ``env``, run here (its workers fork from this
    process's forkserver; the faults kill workers, not the launcher)."""
    return run_cli(list(args), env)


@pytest.fixture(scope="module")
def run_args(corpus_dir: Path, cache_dir: Path) -> list[str]:
    """A 10-step 4-worker run of `tiny` with a checkpoint every 2 steps."""
    return [
        "train", "--model.preset=tiny", f"--data.path={corpus_dir}",
        f"--data.cache_dir={cache_dir}", "--data.vocab_size=512", "--data.seq_len=32",
        "--train.steps=10", "--train.global_batch=8", "--train.micro_batch=4",
        "--train.warmup_steps=2", "--train.eval_every=0", "--train.log_every=1",
        "--train.checkpoint_every=2", "--run.sample_tokens=0", "--train.peak_flops=1e10",
        *LAYOUT,
    ]


@pytest.fixture(scope="module")
def reference(run_args: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of the same run, uninterrupted."""
    run = tmp_path_factory.mktemp("reference") / "run"
    out = _meshlm(*run_args, f"--run.dir={run}")
    assert out.returncode == 0, out.stderr
    return run


def _assert_same_weights(a: Path, b: Path) -> None:
    pa, pb = dict(load_model(a).named_parameters()), dict(load_model(b).named_parameters())
    assert pa.keys() == pb.keys()
    for name, t in pa.items():
        assert t.dtype == torch.float32 and torch.equal(t, pb[name]), name


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run / "metrics.jsonl")]


def test_killed_worker_restarts_and_ends_with_the_uninterrupted_weights(
        run_args: list[str], reference: Path, tmp_path: Path) -> None:
    """SIGKILL of rank 3 after step 5: the group restarts, resumes from step 4, finishes."""
    run = tmp_path / "run"
    out = _meshlm(*run_args, f"--run.dir={run}", "--max-restarts=1",
                  env={"MESHLM_FAULT_KILL_AT_STEP": "5"})
    assert out.returncode == 0, out.stderr
    before, sep, after = out.stdout.partition("worker group restarted (1 of 1)")
    assert sep, out.stdout
    assert "run.resume=false read as auto" in after
    assert "step 4/10" in before and "step 6/10" not in before  # killed after step 5
    assert "step 1/10" not in after and "step 5/10" in after  # resumed from step 4
    assert _steps(run) == list(range(1, 11))  # each step once
    _assert_same_weights(run, reference)


def test_worker_killed_while_saving_leaves_the_previous_checkpoint(
        run_args: list[str], reference: Path, tmp_path: Path) -> None:
    """SIGKILL of rank 3 in the middle of writing checkpoint 4 (no restarts): step_0000004 never
    appears, step_0000002 loads; ``run.resume=auto`` then finishes the run exactly."""
    run = tmp_path / "run"
    out = _meshlm(*run_args, f"--run.dir={run}", env={"MESHLM_FAULT_KILL_IN_SAVE": "4"})
    assert out.returncode == 1, (out.stdout, out.stderr)  # a fault, not a user mistake (2)
    line = out.stderr.strip()
    assert line.startswith("meshlm: error: worker rank 3 died (signal SIGKILL) (pp 0, dp 1, "
                           "cp 0, tp 1); its last collective: "), out.stderr
    assert "\n" not in line
    root = run / "checkpoints"
    names = sorted(p.name for p in root.iterdir())
    assert "step_0000002" in names and "step_0000004" not in names, names
    assert all(n.endswith(".tmp") for n in names if n.startswith("step_0000004")), names
    _assert_same_weights(run, reference / "checkpoints" / "step_0000002")  # latest: step 2

    # a plain restart of the command refuses the run dir; auto continues from step 2
    refused = _meshlm(*run_args, f"--run.dir={run}")
    assert refused.returncode == 2 and "already holds files" in refused.stderr
    out = _meshlm(*run_args, f"--run.dir={run}", "--run.resume=auto")
    assert out.returncode == 0, out.stderr
    assert "step 3/10" in out.stdout and "step 2/10" not in out.stdout
    assert _steps(run) == list(range(1, 11))
    _assert_same_weights(run, reference)
