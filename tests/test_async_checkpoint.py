"""Asynchronous checkpoints (``checkpoint.async``) against synchronous ones.

One spawned world of 2 (dp=2, ZeRO-3) runs, on the same config: a synchronous run, the same
run with async saves (losses, final weights and every checkpoint file equal), resumes of both
from their step-4 checkpoint (equal, and equal to the uninterrupted run), and an async run with
``checkpoint.keep=1`` whose save of step 4 is held in flight (its writers sleep): during it the
folder holds the last complete checkpoint and the ``.tmp`` being written; a copy of the run dir
taken then -- what a kill at that moment leaves on disk -- resumes (``run.resume=auto``) from
step 2 onto the uninterrupted curve; and a SIGTERM sent then stops the run at step 5, whose
save waits for step 4's, both complete; resumed, it ends on the uninterrupted curve. A real
``meshlm train`` (one process) is then SIGKILLed by its writer thread in the middle of a save
and resumed with ``run.resume=auto``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from meshlm.checkpoint import validate
from meshlm.config import load_config
from meshlm.testing import HANG_GUARD_S, command_env, final_weights, run_world
from meshlm.train.trainer import Trainer, train

STEPS, EVERY, CUT = 8, 2, 4
LAYOUT = ["--parallel.dp=2", "--parallel.zero=3", "--train.micro_batch=2"]
MESHLM = Path(sys.executable).with_name("meshlm")


def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
        "--train.global_batch=8", "--train.warmup_steps=2", "--train.eval_every=0",
        "--run.sample_tokens=0", "--train.peak_flops=1e10", "--parallel.bucket_mb=0.05",
        f"--train.checkpoint_every={EVERY}", *LAYOUT,
    ]


def _quiet(_m: str) -> None:
    pass


def _train(args: list[str]) -> dict[int, float]:
    return train(load_config(None, args), log=_quiet, progress=False).losses


def _cut(src: Path, dst: Path, keep_step: int) -> None:
    """``dst``: the run ``src`` as it was after checkpoint ``keep_step``."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").iterdir():
        if int(ckpt.name.split("_")[1]) > keep_step:
            shutil.rmtree(ckpt)


def _listing(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _held_in_flight(base: list[str], run: Path, crash: Path) -> dict[str, Any]:
    """An async run with keep=1 whose save of step CUT sleeps in its writers. While it is in
    flight: the folder is listed, copied (the disk as a kill would leave it) and rank 0 gets
    SIGTERM; the stop is agreed at step CUT + 1, whose save waits for CUT's (listed while
    CUT + 1 is in flight)."""
    import torch.distributed as dist

    seen: dict[str, Any] = {}
    os.environ["MESHLM_FAULT_SLOW_SAVE"] = f"1.5:{CUT}"
    try:
        trainer = Trainer(load_config(None, base + ["--checkpoint.async=true",
                                                    "--checkpoint.keep=1",
                                                    f"--run.dir={run}"]),
                          log=_quiet, progress=False)
        save = trainer.checkpointer.save

        def watched(step: int) -> Path:
            out = save(step)
            if step in (CUT, CUT + 1) and dist.get_rank() == 0:
                seen[step] = _listing(run)
            if step == CUT:  # (every rank's writer now sleeps before writing)
                if dist.get_rank() == 0:
                    shutil.copytree(run, crash)  # the disk as a kill now would leave it
                    os.kill(os.getpid(), signal.SIGTERM)  # (one rank asked: all stop)
                dist.barrier()
            return out

        trainer.checkpointer.save = watched  # type: ignore[method-assign]
        result = trainer.fit()
        last = validate(run / "checkpoints" / f"step_{CUT + 1:07d}")  # (complete on return)
        seen.update(losses=result.losses, stopped_by=result.stopped_by, after=_listing(run),
                    host_bytes=trainer.checkpointer.host_bytes_per_rank, last=last["step"])
    finally:
        del os.environ["MESHLM_FAULT_SLOW_SAVE"]
    return seen


def world_body(base: list[str], root: Path) -> dict[str, Any]:
    """Every run of the module's world (see module docstring); rank 0's view."""
    import torch.distributed as dist

    out: dict[str, Any] = {
        "sync": _train(base + [f"--run.dir={root / 'sync'}"]),
        "async": _train(base + ["--checkpoint.async=true", f"--run.dir={root / 'async'}"]),
    }
    if dist.get_rank() == 0:
        for name in ("sync", "async"):
            _cut(root / name, root / f"{name}-cut", CUT)
    dist.barrier()
    for name, extra in (("sync", []), ("async", ["--checkpoint.async=true"])):
        out[f"{name}-resumed"] = _train(base + extra + [f"--run.dir={root / f'{name}-cut'}",
                                                        "--run.resume=true"])
    out["held"] = _held_in_flight(base, root / "keep1", root / "crash")
    for name in ("crash", "keep1"):
        out[f"{name}-resumed"] = _train(base + ["--checkpoint.async=true", "--checkpoint.keep=1",
                                                f"--run.dir={root / name}", "--run.resume=auto"])
    return out


@pytest.fixture(scope="module")
def world(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[list[str], Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("async")
    base = base_args(corpus_dir, cache_dir)
    return base, root, run_world(2, world_body, base, root)[0]


def _rank_file(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def _same_pieces(a: Path, b: Path, rng: bool = True) -> None:
    """Two checkpoint folders hold the same tensors (bit for bit) and the same index."""
    ia, ib = json.loads((a / "index.json").read_text()), json.loads((b / "index.json").read_text())
    assert ia == ib, (a, b)
    for fname in ia["files"]:
        (ta, ma), (tb, mb) = _rank_file(a / fname), _rank_file(b / fname)
        assert ta.keys() == tb.keys(), fname
        for key, t in ta.items():
            if rng or not key.startswith("rng/"):
                assert t.dtype == tb[key].dtype and (t == tb[key]).all(), (fname, key)
        if rng:
            assert ma == mb, fname


def test_async_run_equals_the_synchronous_one(world) -> None:  # noqa: ANN001
    _, root, res = world
    assert res["async"] == res["sync"] and sorted(res["sync"]) == list(range(1, STEPS + 1))
    saved = [f"step_{s:07d}" for s in range(EVERY, STEPS + 1, EVERY)]
    assert _listing(root / "sync") == _listing(root / "async") == saved
    for name in saved:
        a, s = root / "async" / "checkpoints" / name, root / "sync" / "checkpoints" / name
        validate(a)
        _same_pieces(a, s)
        assert (a / "trainer.json").read_text() == (s / "trainer.json").read_text()
    wa, ws = final_weights(root / "async"), final_weights(root / "sync")
    assert all((t == ws[n]).all() for n, t in wa.items())


def test_resume_from_an_async_checkpoint_equals_resume_from_a_sync_one(world) -> None:  # noqa: ANN001
    _, root, res = world
    assert sorted(res["async-resumed"]) == list(range(CUT + 1, STEPS + 1))
    assert res["async-resumed"] == res["sync-resumed"]
    assert all(res["async-resumed"][s] == res["sync"][s] for s in res["async-resumed"])
    wa, ws = final_weights(root / "async-cut"), final_weights(root / "sync")
    assert all((t == ws[n]).all() for n, t in wa.items())


def test_keep_1_never_deletes_the_save_in_flight_nor_the_last_complete(world) -> None:  # noqa: ANN001
    _, root, res = world
    held = res["held"]
    assert held[CUT] == ["step_0000002", f"step_{CUT:07d}.tmp"]
    assert held[CUT + 1] == [f"step_{CUT:07d}", f"step_{CUT + 1:07d}.tmp"]
    assert held["after"] == [f"step_{CUT + 1:07d}"]


def test_the_planner_counts_the_host_copy(world) -> None:  # noqa: ANN001
    """Each rank's host copy is the bytes of its shards (12 per parameter it owns), as the
    planner's ``checkpoint_host`` says, and the dry run shows it."""
    from meshlm.planner.cli import config_memory, config_workload
    from meshlm.planner.hardware import get_accelerator
    from meshlm.planner.memory import memory

    base, root, res = world
    measured = res["held"]["host_bytes"]
    cfg = load_config(None, base + ["--checkpoint.async=true", f"--run.dir={root / 'x'}"])
    planned = memory(config_workload(cfg), cfg.layout(), get_accelerator("cpu")).checkpoint_host
    assert len(measured) == 2 and abs(max(measured) - planned) / planned < 0.02, (measured,
                                                                                 planned)
    assert any("copy of the checkpoint shards (checkpoint.async" in line
               for line in config_memory(cfg))


def test_sigterm_during_a_save_waits_for_it_and_resumes_exactly(world) -> None:  # noqa: ANN001
    _, root, res = world
    held = res["held"]
    assert held["stopped_by"] == "SIGTERM"
    assert held["losses"] == {s: res["sync"][s] for s in range(1, CUT + 2)}
    assert held["last"] == CUT + 1  # (valid when the run returned, on every rank)
    assert res["keep1-resumed"] == {s: res["sync"][s] for s in range(CUT + 2, STEPS + 1)}
    _same_pieces(root / "keep1" / "checkpoints" / f"step_{STEPS:07d}",
                 root / "sync" / "checkpoints" / f"step_{STEPS:07d}", rng=False)


def test_a_kill_during_the_write_leaves_the_previous_checkpoint_latest(world) -> None:  # noqa: ANN001
    """The copy taken while step 4 was being written resumes from step 2 (auto) and ends on
    the uninterrupted run's weights."""
    _, root, res = world
    assert sorted(res["crash-resumed"]) == list(range(3, STEPS + 1))
    assert all(res["crash-resumed"][s] == res["sync"][s] for s in res["crash-resumed"])
    _same_pieces(root / "crash" / "checkpoints" / f"step_{STEPS:07d}",
                 root / "sync" / "checkpoints" / f"step_{STEPS:07d}", rng=False)


def test_sigkill_of_the_writer_leaves_the_previous_checkpoint_latest(
        corpus_dir: Path, cache_dir: Path, tmp_path: Path) -> None:
    """``meshlm train`` (one process, async) is SIGKILLed by its writer thread after writing
    its file of checkpoint 4 (``MESHLM_FAULT_KILL_IN_SAVE``): step_0000004 never appears and
    step 2 is the latest; ``run.resume=auto`` continues from it onto the uninterrupted run."""
    one = [a for a in base_args(corpus_dir, cache_dir) if a not in LAYOUT]
    run, ref = tmp_path / "run", tmp_path / "ref"
    args = [*one, "--checkpoint.async=true", f"--run.dir={run}"]
    killed = subprocess.run([str(MESHLM), "train", *args], capture_output=True, text=True,
                            timeout=HANG_GUARD_S, env=command_env({"MESHLM_FAULT_KILL_IN_SAVE": "4"}))
    assert killed.returncode == -signal.SIGKILL, (killed.stdout, killed.stderr)
    assert _listing(run) == ["step_0000002", "step_0000004.tmp"]
    resumed = _train([*args, "--run.resume=auto"])
    assert sorted(resumed) == list(range(3, STEPS + 1))
    want = _train([*one, f"--run.dir={ref}"])
    assert all(resumed[s] == want[s] for s in resumed)
    _same_pieces(run / "checkpoints" / f"step_{STEPS:07d}",
                 ref / "checkpoints" / f"step_{STEPS:07d}", rng=False)


def test_a_failed_write_is_raised_and_leaves_the_previous_checkpoint(
        corpus_dir: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A writer that cannot write its file (disk full) fails the run at the next save, on the
    main thread, with a fault (not a user mistake); the folder stays ``.tmp``."""
    from meshlm.checkpoint import async_save

    write = async_save.write_contents

    def full_disk(directory: Path, rank: int, contents: Any) -> Path:
        if directory.name.startswith(f"step_{CUT:07d}"):
            raise OSError(28, "No space left on device")
        return write(directory, rank, contents)

    monkeypatch.setattr(async_save, "write_contents", full_disk)
    one = [a for a in base_args(corpus_dir, cache_dir) if a not in LAYOUT]
    run = tmp_path / "run"
    with pytest.raises(async_save.SaveError, match=f"checkpoint step {CUT} was not completed: "
                                                   ".*No space left on device"):
        _train([*one, "--checkpoint.async=true", f"--run.dir={run}"])
    assert _listing(run) == ["step_0000002", f"step_{CUT:07d}.tmp"]
