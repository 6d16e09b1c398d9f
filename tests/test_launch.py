"""launch.py: local multi-process launches through torch's elastic agent, and world detection.

The worker functions live at module level because spawned workers import them by name
(multiprocessing hands the parent's sys.path to the child, so ``test_launch`` is importable).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time

import pytest
import torch
import torch.distributed as dist

from meshlm.launch import (
    WorkerFailure,
    WorldInfo,
    detect_external_world,
    export_env,
    launch_local,
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
        launch_local(3, _rank2_raises_worker)
    elapsed = time.monotonic() - start
    assert info.value.log_dir is not None
    shutil.rmtree(info.value.log_dir)
    assert _torch_log_records(caplog) == []
    msg = str(info.value)
    assert "\n" not in msg
    assert "rank 2" in msg and "ValueError: boom" in msg, msg
    assert info.value.rank == 2
    assert "Traceback" in info.value.details and "_rank2_raises_worker" in info.value.details
    assert elapsed < 60, elapsed


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
