"""One command per output folder, and local workers that end with their launcher.

A run directory, a prepared dataset folder and a Hugging Face export are claimed by one command
for its whole life (meshlm/run_lock.py): a second command into one of them gets one
``meshlm: error:`` line, exit 2, and writes nothing; the lock of a command that was killed is
stale and never blocks its successor. The workers of ``meshlm train --parallel.dp=2`` end when
their launcher is killed with SIGKILL, and the run then resumes.

The installed ``meshlm`` script runs what must go on beside the test (the run a second command
races, the launcher the test kills); ``run_cli`` runs the short commands in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from meshlm.checkpoint.sharded import latest_valid
from meshlm.run_lock import LOCK_NAME, claim
from meshlm.testing import HANG_GUARD_S, cli, command_env, run_cli

MESHLM = Path(sys.executable).with_name("meshlm")
# How long the workers of a killed launcher may take to end (they end within about a second).
WORKERS_END_S = 15.0

# A command that claims a run directory and waits to be killed.
HOLDER = """
import sys, time
from meshlm.run_lock import claim
lock = claim(sys.argv[1], "run.dir", "--run.dir", "meshlm train")
print("claimed", flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def args(corpus_dir: Path, cache_dir: Path) -> list[str]:
    return [
        "train", "--model.preset=tiny", f"--data.path={corpus_dir}",
        f"--data.cache_dir={cache_dir}", "--data.vocab_size=512", "--data.seq_len=32",
        "--train.global_batch=8", "--train.micro_batch=4", "--train.warmup_steps=2",
        "--train.eval_every=0", "--train.log_every=1", "--run.sample_tokens=0",
        "--train.peak_flops=1e10",
    ]


@pytest.fixture(scope="module")
def trained(args: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with a complete checkpoint of step 2."""
    run = tmp_path_factory.mktemp("trained") / "run"
    proc = run_cli([*args, "--train.steps=2", f"--run.dir={run}"])
    assert proc.returncode == 0, proc.stderr
    return run


def _steps(run: Path) -> list[int]:
    """The steps of the complete lines of the run's metrics.jsonl."""
    path = run / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line)["step"] for line in text.split("\n")[:-1] if line.strip()]


def _wait_for(what: str, done: Callable[[], bool], proc: subprocess.Popen, log: Path) -> None:
    """Until ``done()``, while the command ``proc`` (its output in ``log``) runs."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not done():
        assert proc.poll() is None, f"the command ended before {what}: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} after {HANG_GUARD_S} s"
        time.sleep(0.1)


def _refusal(proc: subprocess.CompletedProcess, what: str, folder: Path, pid: int) -> None:
    """Exit 2 and one line naming the folder, its holder and what to do."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith(f"meshlm: error: {what} {folder} is in use by pid {pid} on "), lines
    option = "--run.dir" if what == "run.dir" else what
    assert "started " in lines[0] and lines[0].endswith(f"; wait for it or choose another "
                                                        f"{option}"), lines


# ------------------------------------------------------------------ two commands, one folder
def test_a_second_train_into_a_running_run_dir_is_refused_and_writes_nothing(
        args: list[str], tmp_path: Path) -> None:
    run, log = tmp_path / "run", tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen([str(MESHLM), *args, "--train.steps=100000",
                                  "--train.checkpoint_every=0", f"--run.dir={run}"],
                                 stdout=out, stderr=out, env=command_env())
    try:
        _wait_for("metrics", lambda: len(_steps(run)) >= 2, first, log)
        files = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()
                 and p.name != "metrics.jsonl"}
        # the same run again (it could start over the first one's files), and the same with
        # local workers: refused before anything is written or any worker starts
        second = [run_cli([*args, "--train.steps=10", f"--run.dir={run}", *extra])
                  for extra in (["--run.resume=auto"], ["--parallel.dp=2"])]
        record = (run / LOCK_NAME).read_bytes() if (run / LOCK_NAME).is_file() else None
        first.send_signal(signal.SIGTERM)  # a graceful stop: a checkpoint, exit 0
        first.wait(timeout=HANG_GUARD_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    for proc in second:
        _refusal(proc, "run.dir", run, first.pid)
        assert "(meshlm train, started " in proc.stderr
    assert record == files.pop(LOCK_NAME)  # the first one's record, as it was
    assert first.returncode == 0, log.read_text()[-2000:]
    steps = _steps(run)
    assert steps == list(range(1, len(steps) + 1)), steps  # the lines of one run
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.name in files} == files
    assert not (run / LOCK_NAME).exists()  # released at the end of the run


def test_a_lock_left_by_a_killed_command_does_not_block_its_successor(
        args: list[str], trained: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE,
                              text=True, env=command_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        resume = [*args, "--train.steps=4", f"--run.dir={run}", "--run.resume=auto"]
        _refusal(run_cli(resume), "run.dir", run, holder.pid)  # alive: refused
    finally:
        holder.kill()
        holder.communicate()
    left = json.loads((run / LOCK_NAME).read_text())
    assert left["pid"] == holder.pid and left["command"] == "meshlm train"  # stale, still there
    proc = run_cli(resume)
    assert proc.returncode == 0, proc.stderr
    assert _steps(run) == [1, 2, 3, 4]  # resumed at step 2
    assert not (run / LOCK_NAME).exists()


def test_prepare_and_convert_into_a_claimed_folder_are_refused(
        trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(The test process holds the locks: the commands find them taken, as they would find
    another command's.)"""
    text = tmp_path / "a.txt"
    text.write_text("".join(f"line {i} of a small corpus\n" for i in range(400)))
    ds, hf = tmp_path / "ds", tmp_path / "hf"
    prepare = ["prepare", str(text), "--out", str(ds), "--quiet", "--vocab-size=300",
               "--workers=1"]
    convert = ["convert", str(trained), "--to-hf", str(hf)]
    with claim(ds, "--out", "--out", "meshlm prepare"):
        rc, lines = cli(prepare, capsys)
        _refusal(subprocess.CompletedProcess(prepare, rc, "", "\n".join(lines)), "--out", ds,
                 os.getpid())
        assert [p.name for p in ds.iterdir()] == [LOCK_NAME]  # nothing written
    with claim(hf, "--to-hf", "--to-hf", "meshlm convert", beside=True):
        rc, lines = cli(convert, capsys)
        _refusal(subprocess.CompletedProcess(convert, rc, "", "\n".join(lines)), "--to-hf", hf,
                 os.getpid())
        assert not hf.exists()
    # released: both run, and leave no lock behind
    assert cli(prepare, capsys)[0] == 0 and cli(convert, capsys)[0] == 0
    assert (ds / "manifest.json").is_file() and (hf / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "ds", "hf"]
    assert LOCK_NAME not in os.listdir(ds)


# ------------------------------------------------------------------ a killed launcher
def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d.name))
    return out


def _descendants(pid: int) -> list[int]:
    children, found, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs /proc")
def test_workers_end_with_a_killed_launcher_and_the_run_resumes(args: list[str],
                                                                tmp_path: Path) -> None:
    run, log = tmp_path / "run", tmp_path / "launcher.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen([str(MESHLM), *args, "--parallel.dp=2",
                                     "--train.steps=100000", "--train.checkpoint_every=4",
                                     f"--run.dir={run}"], stdout=out, stderr=out,
                                    env=command_env())
    processes: list[int] = []
    try:
        _wait_for("checkpoint", lambda: len(_steps(run)) >= 5, launcher, log)
        processes = _descendants(launcher.pid)  # forkserver, workers, resource tracker
        assert len(processes) >= 3, processes
        launcher.kill()  # as an OOM killer would
        launcher.wait()
        deadline = time.monotonic() + WORKERS_END_S
        while (left := [p for p in processes if _running(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"still running {WORKERS_END_S} s after their launcher was killed"
    finally:
        for pid in [launcher.pid, *processes]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    size = (run / "metrics.jsonl").stat().st_size
    time.sleep(1.0)
    assert (run / "metrics.jsonl").stat().st_size == size  # nobody writes any more
    before = _steps(run)
    left = json.loads((run / LOCK_NAME).read_text())
    assert left["pid"] == launcher.pid  # the dead launcher's lock: stale
    # the kill may land after a step's checkpoint is complete and before its metrics line
    latest = latest_valid(run / "checkpoints", log=lambda line: None)
    assert latest is not None
    saved = int(latest.name.removeprefix("step_"))
    assert saved % 4 == 0 and before[-1] - 4 < saved <= before[-1] + 1, (saved, before)
    proc = run_cli([*args, "--parallel.dp=2", f"--train.steps={saved + 2}", f"--run.dir={run}",
                    "--run.resume=auto"])
    assert proc.returncode == 0, proc.stderr
    steps = _steps(run)  # resumed from its latest checkpoint; later lines replaced
    assert steps == [*range(1, min(saved, before[-1]) + 1), saved + 1, saved + 2], (steps, saved)
    assert not (run / LOCK_NAME).exists()
