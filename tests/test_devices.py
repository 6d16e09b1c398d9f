"""Which GPU each rank takes (launch.py), checked on CPU with CUDA's answers faked.

``choose_device`` covers torchrun and launch_local (every rank sees every GPU: cuda:LOCAL_RANK),
SLURM with every GPU of the node visible (cuda:SLURM_LOCALID) and SLURM with one GPU per task
(cuda:0), and refuses two ranks on one GPU with one line naming the fix. ``init_worker`` sets
and binds the chosen device, or refuses before it touches the process group; ``launch_local``
and ``meshlm train`` refuse more local ranks than GPUs before any worker starts or any file is
written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshlm import launch
from meshlm.launch import DeviceError, WorldInfo, choose_device, init_worker, launch_local


def fake_gpus(monkeypatch: pytest.MonkeyPatch, n: int, visible: str | None = None) -> None:
    """This process sees ``n`` CUDA devices (``CUDA_VISIBLE_DEVICES=visible``)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def test_choose_device_per_launcher() -> None:
    # torchrun / launch_local on an 8-GPU node: rank i takes GPU i
    assert [choose_device(r, 8, 8) for r in range(8)] == list(range(8))
    # SLURM, every GPU of the node visible to each of 4 tasks: cuda:SLURM_LOCALID
    assert [choose_device(r, 4, 4, per_task=True) for r in range(4)] == [0, 1, 2, 3]
    assert choose_device(3, 4, 8, per_task=True) == 3  # more GPUs than tasks
    # SLURM --gpus-per-task=1: every task sees its own single GPU as cuda:0
    assert [choose_device(r, 4, 1, per_task=True) for r in range(4)] == [0, 0, 0, 0]
    assert choose_device(0, 1, 1) == 0  # one rank, one GPU
    assert choose_device(2, 4, 0) is None  # no GPU: a CPU run (gloo)


@pytest.mark.parametrize(("lws", "gpus", "per_task"), [(2, 1, False), (4, 2, False),
                                                       (4, 2, True), (8, 3, True)])
def test_choose_device_refuses_two_ranks_on_one_gpu(lws: int, gpus: int, per_task: bool) -> None:
    with pytest.raises(DeviceError) as err:
        choose_device(0, lws, gpus, per_task=per_task, visible="0,1")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"{lws} local ranks but only {gpus} GPU")
    assert "(CUDA_VISIBLE_DEVICES=0,1)" in msg
    assert ("--gpus-per-task=1" in msg) == per_task
    assert f"at most {gpus}" in msg


def test_choose_device_message_without_the_variable() -> None:
    with pytest.raises(DeviceError, match=r"CUDA_VISIBLE_DEVICES=unset"):
        choose_device(1, 2, 1)


def world_env(monkeypatch: pytest.MonkeyPatch, source: str, local_rank: int, lws: int) -> None:
    """The variables of one rank of a torchrun or SLURM world of two nodes."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "MESHLM_WORLD_SOURCE", "SLURM_PROCID", "SLURM_NTASKS"):
        # set, then removed: monkeypatch restores the original state (absent included) at the
        # end, so what init_worker exports (SLURM: torch's variables) does not leak into the
        # tests after this one
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    if source == "torchrun":
        for k, v in (("RANK", lws + local_rank), ("WORLD_SIZE", 2 * lws),
                     ("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", lws),
                     ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", 29999)):
            monkeypatch.setenv(k, str(v))
    else:
        for k, v in (("SLURM_PROCID", lws + local_rank), ("SLURM_NTASKS", 2 * lws),
                     ("SLURM_LOCALID", local_rank), ("SLURM_NODEID", 1),
                     ("SLURM_TASKS_PER_NODE", f"{lws}(x2)"), ("SLURM_JOB_NODELIST", "n[1-2]"),
                     ("SLURM_JOB_ID", 7)):
            monkeypatch.setenv(k, str(v))


@pytest.mark.parametrize(("source", "gpus", "expected"), [
    ("torchrun", 4, 3), ("slurm", 4, 3), ("slurm", 1, 0)])
def test_init_worker_sets_and_binds_the_chosen_device(monkeypatch: pytest.MonkeyPatch,
                                                      source: str, gpus: int,
                                                      expected: int) -> None:
    """Local rank 3 of 4: the device init_worker sets and binds to the process group."""
    world_env(monkeypatch, source, 3, 4)
    fake_gpus(monkeypatch, gpus, "5" if gpus == 1 else "0,1,2,3")
    calls: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.update(backend=backend, **kw))
    info = init_worker(10)
    assert (info.source, info.local_rank, info.local_world_size) == (source, 3, 4)
    assert calls["set"] == torch.device("cuda", expected)
    assert calls["backend"] == "nccl" and calls["device_id"] == torch.device("cuda", expected)


def test_init_worker_without_gpus_takes_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    world_env(monkeypatch, "torchrun", 1, 2)
    fake_gpus(monkeypatch, 0)
    calls: dict[str, object] = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.setdefault("threads", n))
    # a gloo world of more than one rank: init returns after a barrier (every rank's mesh built)
    monkeypatch.setattr(dist, "barrier", lambda: calls.setdefault("barrier", "backend" in calls))
    init_worker(10)
    assert calls == {"backend": "gloo", "timeout": calls["timeout"], "device_id": None,
                     "threads": 1, "barrier": True}


@pytest.mark.parametrize("source", ["torchrun", "slurm"])
def test_init_worker_refuses_before_the_process_group(monkeypatch: pytest.MonkeyPatch,
                                                      source: str) -> None:
    """4 local ranks, 2 GPUs visible: one line, and no process group is started."""
    world_env(monkeypatch, source, 3, 4)
    fake_gpus(monkeypatch, 2, "0,1")

    def must_not_run(*_a: object, **_k: object) -> None:
        raise AssertionError("reached the device or the process group")

    monkeypatch.setattr(torch.cuda, "set_device", must_not_run)
    monkeypatch.setattr(dist, "init_process_group", must_not_run)
    with pytest.raises(DeviceError, match=r"^4 local ranks but only 2 GPUs visible "
                                          r"\(CUDA_VISIBLE_DEVICES=0,1\): "):
        init_worker(10)


def test_worker_device_follows_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """One visible GPU and two local ranks: SLURM binds one per task, torchrun cannot."""
    fake_gpus(monkeypatch, 1, "3")
    info = WorldInfo(1, 4, 1, 2, "h", 1, "slurm")
    assert launch.worker_device(info) == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="at most 1 rank per node"):
        launch.worker_device(WorldInfo(1, 4, 1, 2, "h", 1, "torchrun"))
    fake_gpus(monkeypatch, 0)
    assert launch.worker_device(info) is None


def _never_called() -> None:
    raise AssertionError("a worker started")


def test_launch_local_refuses_more_ranks_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2, "0,1")

    def no_agent(*_a: object, **_k: object) -> None:
        raise AssertionError("the agent was started")

    import torch.distributed.launcher.api as launcher_api

    monkeypatch.setattr(launcher_api, "elastic_launch", no_agent)
    with pytest.raises(DeviceError) as err:
        launch_local(3, _never_called)
    assert str(err.value) == ("3 local ranks but only 2 GPUs visible (CUDA_VISIBLE_DEVICES=0,1):"
                              " start at most 2 ranks per node (e.g. --parallel.dp=2), or run "
                              "on a node with more GPUs")
    launch.refuse_local_ranks(2)  # as many ranks as GPUs: fine
    fake_gpus(monkeypatch, 0)
    launch.refuse_local_ranks(8)  # CPU workers: any number


def test_train_refuses_before_writing_anything(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    from meshlm import cli

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    fake_gpus(monkeypatch, 1, "0")
    monkeypatch.setattr(cli, "refuse_if_too_big", lambda cfg: None)  # (no GPU to size)
    import meshlm.planner.cli as planner_cli

    monkeypatch.setattr(planner_cli, "fit_micro_batch", lambda cfg, hw=None: (cfg, None))
    rc = cli.main(["train", "--model.preset=tiny", "--parallel.dp=2", "--train.micro_batch=1",
                   f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("meshlm: error: 2 local ranks but only 1 GPU visible "
                             "(CUDA_VISIBLE_DEVICES=0): start at most 1 rank per node")
    assert not (tmp_path / "run").exists()
