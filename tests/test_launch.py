"""launch.py: local multi-process launches through torch's elastic agent, and world detection.

The worker functions live at module level because spawned workers import them by name
(multiprocessing hands the parent's sys.path to the child, so ``test_launch`` is importable).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshlm.cli import build_parser, main
from meshlm.distributed.spawn import run_world
from meshlm.launch import (
    WorkerFailure,
    WorldInfo,
    detect_external_world,
    export_env,
    launch_local,
    restart_message,
)


def _allreduce_worker() -> tuple[int, int, float, int]:
    print(f"console line from rank {dist.get_rank()}", flush=True)
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), torch.get_num_threads()


def _rank2_raises_worker() -> None:
    if dist.get_rank() == 2:
        raise ValueError("boom")
    dist.barrier()  # ranks 0/1 block here on a peer that never arrives


def _rank1_sigkill_worker() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _trivial_worker() -> int:
    return dist.get_rank()


def _dies_on_first_attempt_worker() -> tuple[int, float]:
    """Rank 1 of the first attempt is SIGKILLed after joining; the restarted group completes."""
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if dist.get_rank() == 1 and restarts == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)  # the restarted group's process group works
    return restarts, t.item()


def _rank1_always_raises_worker() -> None:
    if dist.get_rank() == 1:
        raise ValueError(f"boom in attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}")
    dist.barrier()


def _torch_log_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Records from torch loggers a user would see. The elastic *event* loggers do not propagate
    and only have a NullHandler (pytest hooks them anyway), so they are left out."""
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.name.startswith("torch") and logging.getLogger(r.name).propagate]


def test_allreduce_two_workers(capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    # conftest already sets 1; a different value shows the workers' 1 thread is launch_local's doing
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    caplog.set_level(logging.DEBUG)

    assert launch_local(2, _allreduce_worker) == {0: (0, 2, 3.0, 1), 1: (1, 2, 3.0, 1)}

    out = capfd.readouterr().out
    assert "console line from rank 0" in out and "rank 1" not in out  # quiet_ranks
    assert _torch_log_records(caplog) == []  # the agent's chatter is silenced
    # the parent is left as it was: the agent's signal handlers and env changes are undone
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert os.environ["OMP_NUM_THREADS"] == "2"
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ


def test_nested_function_rejected() -> None:
    def local_fn() -> None:
        pass

    with pytest.raises(TypeError, match="module-level"):
        launch_local(2, local_fn)


def test_raising_worker_stops_the_others(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    start = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        launch_local(3, _rank2_raises_worker, timeout_s=600)
    elapsed = time.monotonic() - start
    assert info.value.log_dir is not None
    shutil.rmtree(info.value.log_dir)
    assert _torch_log_records(caplog) == []
    msg = str(info.value)
    assert "\n" not in msg
    assert "rank 2" in msg and "ValueError: boom" in msg, msg
    assert info.value.rank == 2
    assert "Traceback" in info.value.details and "_rank2_raises_worker" in info.value.details
    assert elapsed < 600, elapsed  # the others were stopped, not left to their timeout


def test_worker_killed_by_signal() -> None:
    with pytest.raises(WorkerFailure) as info:
        launch_local(2, _rank1_sigkill_worker)
    assert info.value.log_dir is not None
    shutil.rmtree(info.value.log_dir)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg == "worker rank 1 died (signal SIGKILL)", msg


TORCHRUN_ENV = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def _slurm_env(nodelist: str, **extra: str) -> dict[str, str]:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": nodelist,
           "SLURM_JOB_ID": "123456"}
    env.update(extra)
    return env


def test_detect_torchrun() -> None:
    assert detect_external_world(TORCHRUN_ENV) == WorldInfo(3, 8, 1, 4, "10.0.0.1", 29500,
                                                            "torchrun")


@pytest.mark.parametrize("nodelist, master", [
    ("node[01-04]", "node01"),
    ("gpu-a[1-2],gpu-b3", "gpu-a1"),
    ("host7", "host7"),
    ("node[07,01-03]", "node07"),
])
def test_detect_slurm(nodelist: str, master: str) -> None:
    info = detect_external_world(_slurm_env(nodelist))
    assert info == WorldInfo(5, 8, 1, 4, master, 20000 + 123456 % 20000, "slurm")


def test_detect_slurm_details() -> None:
    env = _slurm_env("n[1-3]", MASTER_PORT="31000", SLURM_NTASKS_PER_NODE="",
                     SLURM_TASKS_PER_NODE="3(x2),2", SLURM_NODEID="2")
    info = detect_external_world(env)
    assert info is not None
    assert (info.master_port, info.local_world_size) == (31000, 2)
    # torchrun's variables describe the process better than the allocation's (torchrun in srun)
    assert detect_external_world({**env, **TORCHRUN_ENV}).source == "torchrun"


def test_export_env_round_trip() -> None:
    info = detect_external_world(_slurm_env("node[01-04]"))
    assert info is not None
    env: dict[str, str] = {}
    export_env(info, env)
    assert env["RANK"] == "5" and env["MASTER_ADDR"] == "node01"
    assert detect_external_world(env) == info  # still reported as a SLURM world


def test_detect_no_external_world() -> None:
    assert detect_external_world(_slurm_env("node[01-04]", SLURM_NTASKS="1")) is None
    assert detect_external_world({}) is None
    assert detect_external_world({"SLURM_PROCID": "0"}) is None


# --------------------------------------------------------------------------- restarts
def test_killed_worker_restarts_the_group(capfd: pytest.CaptureFixture[str]) -> None:
    assert launch_local(2, _dies_on_first_attempt_worker, max_restarts=1) == {
        0: (1, 2.0), 1: (1, 2.0)}
    out = capfd.readouterr().out
    assert out.count("worker group restarted (1 of 1)") == 1, out  # rank 0 only, once
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ  # the parent's env is restored


def test_failure_after_the_last_restart() -> None:
    with pytest.raises(WorkerFailure) as info:
        launch_local(2, _rank1_always_raises_worker, max_restarts=1)
    assert info.value.log_dir is not None
    shutil.rmtree(info.value.log_dir)
    msg = str(info.value)
    assert "\n" not in msg
    # the root cause of the last attempt, and how many restarts were made
    assert msg.startswith("worker rank 1 failed: ValueError: boom in attempt 1"), msg
    assert msg.endswith("(the worker group was restarted 1 time)"), msg


def test_max_restarts_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        launch_local(2, _trivial_worker, max_restarts=-1)


def test_restart_message() -> None:
    assert restart_message({}) is None
    assert restart_message({"TORCHELASTIC_RESTART_COUNT": "0"}) is None
    assert restart_message({"TORCHELASTIC_RESTART_COUNT": "x"}) is None
    line = restart_message({"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3"})
    assert line is not None and line.startswith("worker group restarted (2 of 3)")


def test_max_restarts_flag() -> None:
    parser = build_parser()
    assert parser.parse_known_args(["train"])[0].max_restarts == 0
    assert parser.parse_known_args(["train", "--max-restarts", "2"])[0].max_restarts == 2
    assert parser.parse_known_args(["train", "--max-restarts=3"])[0].max_restarts == 3


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_bad_max_restarts_is_refused_before_anything_starts(
        value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    try:
        status = main(["train", f"--max-restarts={value}", "--model.preset=tiny",
                       f"--run.dir={run_dir}", "--parallel.dp=2"])
    except SystemExit as e:  # argparse: not an integer
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert f"--max-restarts={value} must be >= 0" in err if value == "-1" else (
        "argument --max-restarts: invalid int value" in err), err
    assert not run_dir.exists()


def test_max_restarts_under_torchrun_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    for key, value in {**TORCHRUN_ENV, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MESHLM_WORLD_SOURCE", raising=False)
    assert main(["train", "--max-restarts=1", "--model.preset=tiny",
                 f"--run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm: error: --max-restarts restarts the workers meshlm starts "
                          "itself; this process is one rank of a torchrun world"), err
    assert "\n" not in err and not (tmp_path / "run").exists()


# ------------------------------------------------------------------ forked workers
PROBE = "MESHLM_TEST_PROBE"


def _probe_worker() -> tuple[str | None, str]:
    """Print a line (rank 0's reaches the launcher's stdout); the probe variable and the
    folder the worker runs in."""
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} forked", flush=True)
    return os.environ.get(PROBE), os.getcwd()


def test_forked_workers_get_the_launchers_environment_output_and_folder(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """run_world's ranks and launch_local's workers fork from a forkserver started once per
    process, with the environment, stdout and folder of that moment. Each world and each
    launch still gets the caller's as they are at its start: a variable set after the server
    started is seen, one removed is gone, a rank's print reaches this test's captured output,
    not an earlier test's, and a relative path means what it means to the caller."""
    here = os.getcwd()
    run_world(2, _probe_worker)  # the server runs from here on
    monkeypatch.setenv(PROBE, "42")
    monkeypatch.chdir(tmp_path)
    assert run_world(2, _probe_worker) == [("42", str(tmp_path))] * 2
    assert launch_local(2, _probe_worker) == {0: ("42", str(tmp_path)), 1: ("42", str(tmp_path))}
    out = capfd.readouterr().out
    assert "rank 0 of 2 forked" in out and "rank 1 of 2 forked" in out, out
    monkeypatch.delenv(PROBE)
    monkeypatch.chdir(here)
    assert run_world(2, _probe_worker) == [(None, here)] * 2
    assert launch_local(2, _probe_worker) == {0: (None, here), 1: (None, here)}
    assert "rank 0 of 2 forked" in capfd.readouterr().out


def test_the_forkserver_holds_neither_stdin_nor_stdout_of_its_caller() -> None:
    """The forkserver outlives the process that started it by its own teardown (torch imported:
    a second here); it holds /dev/null, not the caller's stdin / stdout, so ``meshlm train |
    tee log`` ends when meshlm does. Its stderr is the caller's: a child that fails before it
    takes its caller's streams says why. It starts without importing torch (the launcher starts
    it before its own imports), and the caller's descriptors are back in place."""
    probe = (
        "import os, sys\n"
        "from multiprocessing import forkserver\n"
        "from meshlm.distributed.forkserver import ensure_server, forkserver_context\n"
        "before = [os.readlink(f'/proc/self/fd/{fd}') for fd in (0, 1, 2)]\n"
        "ensure_server(forkserver_context(['json']))\n"
        "pid = forkserver._forkserver._forkserver_pid\n"
        "server = [os.readlink(f'/proc/{pid}/fd/{fd}') for fd in (0, 1, 2)]\n"
        "after = [os.readlink(f'/proc/self/fd/{fd}') for fd in (0, 1, 2)]\n"
        "print(server[:2], server[2] == before[2], before == after, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, stdin=subprocess.PIPE)
    assert out.stdout.strip() == f"{[os.devnull] * 2} True True False", (out.stdout, out.stderr)


def _unimportable_main_worker() -> None:
    """Never runs: its launch dies while the child imports its main module."""


def test_a_child_that_fails_before_taking_the_callers_streams_says_why(tmp_path: Path) -> None:
    """A script whose own import fails in the forked child (here: a module it imports is gone)
    gets that traceback on its stderr, and the world's failure names the dead rank."""
    (tmp_path / "gone_mod.py").write_text("X = 1\n")
    script = tmp_path / "main_script.py"
    script.write_text(
        "import os, shutil, sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import gone_mod\n"
        "from meshlm.distributed.spawn import run_world\n"
        "from test_launch import _unimportable_main_worker\n"
        "if __name__ == '__main__':\n"
        f"    os.remove({str(tmp_path / 'gone_mod.py')!r})\n"
        f"    shutil.rmtree({str(tmp_path / '__pycache__')!r}, ignore_errors=True)\n"
        "    try:\n"
        "        run_world(1, _unimportable_main_worker, timeout=120)\n"
        "    except RuntimeError as e:\n"
        "        print('world:', e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         check=True, env=env)
    assert "world: rank 0 died" in out.stdout, (out.stdout, out.stderr)
    assert "No module named 'gone_mod'" in out.stderr, out.stderr
