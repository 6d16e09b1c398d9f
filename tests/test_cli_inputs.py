"""Every command-line path answers bad input with one ``meshlm: error:`` line, exit status 2,
and leaves the folder it ran in byte for byte as it was (nothing created, nothing
overwritten); absurd sizes are refused or answered from bounded work.

In-process (``meshlm.cli.main``) in a scratch folder holding a text file, an empty file, an
empty folder, a folder with a file, an image, a broken TOML file and a fake checkpoint with a
damaged index. Damaged real checkpoints are in tests/test_bad_input.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlm.cli import main
from meshlm.models.presets import PRESETS
from meshlm.planner import calibrate as cal
from meshlm.planner.cli import build_workload
from meshlm.planner.hardware import get_accelerator
from meshlm.planner.memory import stage_memory
from meshlm.planner.search import MAX_WORLD, base_layouts, search, world_problem
from meshlm.planner.workload import ModelSpec
from meshlm.testing import cli


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path below ``root`` -> its bytes (None: a folder)."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.fixture()
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current folder for one command, with one of each kind of path in it."""
    (tmp_path / "notes.txt").write_text("notes\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("keep")
    (tmp_path / "old.png").write_bytes(b"an old drawing")
    (tmp_path / "bad.toml").write_text("[[[")
    ckpt = tmp_path / "junk" / "checkpoints" / "step_0000002"
    ckpt.mkdir(parents=True)
    (ckpt / "index.json").write_text("{garbage")
    (ckpt / "trainer.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    return tmp_path


PLAN = ["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "4"]
H100 = ["plan", "--model", "llama3-70b", "--gpu", "h100-sxm"]
SCHEDULE = ["schedule", "--pp", "4", "--microbatches", "8"]

CASES = [
    # meshlm plan: sizes out of range or that no layout splits -- refused at once
    ([*H100, "--gpus", "10000000"], "--gpus=10000000: no split of 10000000 ranks into tp x cp"),
    ([*H100, "--gpus", "1000003"], "no split of 1000003 ranks"),
    ([*H100, "--gpus", "99999999999999999999"], f"must lie in [1, {MAX_WORLD}]"),
    ([*H100, "--gpus", "0"], "--gpus=0 must lie in [1,"),
    ([*H100, "--gpus", "-3"], "--gpus=-3 must lie in [1,"),
    ([*H100, "--gpus", "abc"], "argument --gpus: invalid int value: 'abc'"),
    (["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "10000000"],
     "10000000 ranks is more than model tiny can use: at most 16384"),
    ([*PLAN, "--top", "0"], "--top=0 must be >= 1"),
    ([*PLAN, "--top", "-1"], "--top=-1 must be >= 1"),
    ([*PLAN, "--seq-len", "0"], "--seq-len=0 must be >= 1"),
    ([*PLAN, "--seq-len", "1000000000"], "--seq-len=1000000000 must lie in [1, max_seq_len=512]"),
    ([*PLAN, "--global-batch-tokens", "0"], "--global-batch-tokens=0 must be >= 1"),
    ([*PLAN, "--global-batch-tokens", "-5"], "--global-batch-tokens=-5 must be >= 1"),
    (["plan", "--model", "nosuch", "--gpu", "cpu", "--gpus", "4"], "--model 'nosuch' is neither"),
    (["plan", "--model", "bad.toml", "--gpu", "cpu", "--gpus", "4"], "is not valid TOML"),
    (["plan", "--model", "tiny", "--gpu", "nosuch", "--gpus", "4"], "is not in the catalogue"),
    ([*PLAN, "--calibration", "missing.json"], "CPU calibration file 'missing.json' does not"),
    ([*PLAN, "--layout", "tp=x"], "--layout item 'tp=x': tp must be a positive integer"),
    (["plan", "--calibrate", "--calibrate-wait", "-1"], "--calibrate-wait=-1.0 must be a number"),
    (["plan", "--calibrate", "--calibrate-wait", "nan"], "--calibrate-wait=nan must be a number"),
    (["plan", "--calibrate", "--calibration", "emptydir"], "--calibration 'emptydir' is a folder"),
    (["plan", "--calibrate", "--calibration", "nodir/c.json"], "folder 'nodir' does not exist"),
    (["plan", "--calibrate", "--calibration", "notes.txt/c.json"],
     "'notes.txt' is a file, not a folder"),
    # meshlm schedule: the --plot path is checked before anything is printed or drawn
    ([*SCHEDULE, "--plot", "nodir/x.png"], "--plot 'nodir/x.png': folder 'nodir' does not exist"),
    ([*SCHEDULE, "--plot", "x.foo"], "--plot 'x.foo': unknown format '.foo' (one of .jpeg"),
    ([*SCHEDULE, "--plot", "x"], "--plot 'x': has no file suffix"),
    ([*SCHEDULE, "--plot", "notes.txt"], "unknown format '.txt'"),
    ([*SCHEDULE, "--plot", "notes.txt/x.png"], "'notes.txt' is a file, not a folder"),
    ([*SCHEDULE, "--plot", "/proc/x.png"], "--plot '/proc/x.png': cannot write it"),
    (["schedule", "--pp", "100000", "--microbatches", "100000"],
     "--pp=100000 is more than the 128 ranks"),
    (["schedule", "--pp", "64", "--microbatches", "128"], "= 8192 is more than the 4096 cells"),
    (["schedule", "--microbatches", "0"], "micro-batches=0"),
    (["schedule", "--schedule", "nosuch"], "is not one of"),
    (["schedule", "--timeline", "notes.txt"], "--timeline 'notes.txt' is not a run directory"),
    (["schedule", "--timeline", "emptydir"], "has no timeline/rank_*.json"),
    # meshlm report
    (["report", "notes.txt"], "notes.txt"),
    (["report", "emptydir", "--out", "full"], "emptydir"),
    (["report", "emptydir", "--out", "notes.txt"], "--out 'notes.txt' is a file, not a folder"),
    (["report", "emptydir", "--out", "notes.txt/r"], "cannot be created: 'notes.txt' is a file"),
    # meshlm generate / convert: not a checkpoint, bad numbers
    (["generate", "--checkpoint", "emptydir", "--prompt", "x"], "emptydir"),
    (["generate", "--checkpoint", "notes.txt", "--prompt", "x"], "notes.txt"),
    (["generate", "--checkpoint", "junk", "--prompt", "x"], "junk"),
    (["generate", "--checkpoint", "junk", "--prompt", "x", "--temperature", "-1"],
     "--temperature=-1.0 must be"),
    (["generate", "--checkpoint", "junk", "--prompt", "x", "--temperature", "nan"],
     "--temperature=nan must be"),
    (["generate", "--checkpoint", "junk", "--prompt", "x", "--top-k", "-1"],
     "--top-k=-1 must be >= 0"),
    (["convert", "emptydir", "--to-hf", "out"], "emptydir"),
    (["convert", "junk", "--to-hf", "out"], "junk"),
    (["convert", "junk", "--to-hf", "notes.txt"], "--to-hf 'notes.txt' already exists"),
    (["convert", "junk", "--to-hf", "full"], "--to-hf 'full' already exists"),
    (["convert", "junk", "--to-hf", "notes.txt/out"], "cannot be created: 'notes.txt' is a"),
    (["convert", "junk", "--to-hf", "out", "--max-shard-mb", "nan"], "--max-shard-mb=nan must"),
    (["convert", "junk", "--to-hf", "out", "--max-shard-mb", "-1"], "--max-shard-mb=-1.0 must"),
    # meshlm info / prepare / train
    (["info", "--seq-len", "-1"], "--seq-len=-1 must be >= 1"),
    (["info", "--seq-len", "abc"], "argument --seq-len: invalid int value: 'abc'"),
    (["prepare", "missing.txt", "--out", "ds"], "missing.txt"),
    (["prepare", "empty.txt", "--out", "new/ds", "--quiet"], "empty.txt holds no documents"),
    (["prepare", "notes.txt", "--out", "full"], "full"),
    (["prepare", "notes.txt", "--out", "notes.txt/ds"], "notes.txt"),
    (["prepare", "notes.txt", "--out", "ds", "--vocab-size", "10"], "--vocab-size=10 must be"),
    (["prepare", "notes.txt", "--out", "ds", "--workers", "0"], "--workers=0 must be >= 1"),
    (["prepare", "notes.txt", "--out", "ds", "--val-fraction", "nan"], "--val-fraction=nan"),
    (["prepare", "notes.txt", "--out", "ds", "--unit-mb", "nan"], "--unit-mb=nan must be"),
    (["prepare", "notes.txt", "--out", "ds", "--unit-mb", "inf"], "--unit-mb=inf must be"),
    (["train", "missing.toml"], "missing.toml"),
    (["train", "emptydir"], "emptydir"),
    (["train", "bad.toml"], "bad.toml"),
    (["train", "--model.preset=tiny", "--parallel.dp=10000000", "--parallel.auto=true",
      "--dry-run"], "10000000"),
    (["train", "--model.preset=tiny", "--parallel.dp=99999999999", "--parallel.auto=true",
      "--train.global_batch=99999999999", "--dry-run"],
     "parallel.auto: 99999999999 ranks is more than the planner's maximum of 16777216"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_one_line_and_nothing_written(argv: list[str], message: str, scratch: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(scratch)
    rc, lines = cli(argv, capsys)
    assert rc == 2, lines
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: "), lines
    assert message in lines[0], lines[0]
    assert snapshot(scratch) == before


# ------------------------------------------------------------------ the layout search's work
def _work(preset: str, hw_name: str):  # noqa: ANN202
    hw = get_accelerator(hw_name)
    return build_workload(ModelSpec(PRESETS[preset]), hw, None, None, None, "fp32"), hw


@pytest.mark.parametrize("world", [10**7, 1000003, 2**24 + 1, 10**20])
def test_absurd_worlds_do_no_work(world: int) -> None:
    """A world no split fits is answered before one layout is considered."""
    work, hw = _work("llama3-70b", "h100-sxm")
    counts: dict[str, int] = {}
    assert search(work, world, hw, counts=counts) == []
    assert counts == {"layouts": 0, "memory": 0, "timed": 0}
    assert world_problem(work, world, hw)


def test_work_is_bounded_by_the_model_not_the_world() -> None:
    """A thousand times the ranks: about as many layouts considered (the splits come from
    the model's divisors), each with a few memory evaluations at most."""
    work, hw = _work("tiny", "cpu")
    assert "at most 16384" in world_problem(work, 16385, hw)
    small, large, largest = {}, {}, {}
    assert search(work, 4, hw, top=1, counts=small)
    assert search(work, 4096, hw, top=1, counts=large)
    search(work, 16384, hw, top=1, counts=largest)
    for c in (large, largest):
        assert c["layouts"] <= 2 * small["layouts"] and c["memory"] <= 5 * c["layouts"], c


def test_states_do_not_depend_on_micro_batch_or_recomputation() -> None:
    """The search drops a layout with every micro-batch and recomputation mode when its
    weights, gradients and Adam moments alone overflow a stage: they must not depend on
    either (on any stage)."""
    from dataclasses import replace

    work, hw = _work("tiny-moe", "cpu")
    for lo in list(base_layouts(work, 4, hw))[::7]:
        for zero in (0, 1) if lo.pp > 1 else (0, 1, 3):
            for stage in range(lo.pp):
                ref = stage_memory(work, replace(lo, zero=zero, micro_batch=1), hw, stage)
                for rc in ("none", "selective", "full"):
                    m = stage_memory(work, replace(lo, zero=zero, recompute=rc), hw, stage)
                    assert m.states == ref.states, (lo, rc, stage)


def test_absurd_global_batch_is_answered() -> None:
    hw = get_accelerator("cpu")
    work = build_workload(ModelSpec(PRESETS["tiny"]), hw, None, 10**30, None, "fp32")
    counts: dict[str, int] = {}
    plans = search(work, 4, hw, top=1, counts=counts)
    assert plans and plans[0].layout.micro_batch <= 128 and counts["layouts"] < 2000


# ------------------------------------------------------------------ calibration's waiting
def test_wait_for_idle_gives_up_and_says_how_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    samples: list[float] = []
    monkeypatch.setattr(cal, "cpu_busy", lambda s: samples.append(s) or 0.85)
    wait = cal.IdleWait(5.0)
    wait.wait()
    assert len(samples) == 5 and wait.left == 0.0
    wait.wait()  # budget spent: one sample to know the load, no waiting
    assert len(samples) == 6
    assert wait.under_load and wait.remark() == "; measured under load (up to 85% busy)"


def test_wait_for_idle_ends_on_an_idle_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cal, "cpu_busy", lambda s: 0.02)
    wait = cal.IdleWait(60.0)
    wait.wait()
    assert wait.left == 57.0 and not wait.under_load and wait.remark() == ""


def test_calibrate_wait_reaches_the_measurement(scratch: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    seen = {}

    class Profile:
        def to_dict(self) -> dict:
            return {"measured": True}

    def fake(max_wait: float) -> Profile:
        seen["max_wait"] = max_wait
        return Profile()

    monkeypatch.setattr(cal, "calibrate", fake)
    assert main(["plan", "--calibrate", "--calibrate-wait", "7",
                 "--calibration", "c.json"]) == 0
    assert seen == {"max_wait": 7.0}
    assert (scratch / "c.json").read_text() == '{\n "measured": true\n}'
    assert "waits at most 7 s in all" in capsys.readouterr().out


# ------------------------------------------------------------------ --plot that works
def test_plot_replaces_an_image_and_writes_formats(scratch: Path) -> None:
    assert main([*SCHEDULE, "--plot", "old.png"]) == 0
    assert (scratch / "old.png").read_bytes().startswith(b"\x89PNG")
    assert main([*SCHEDULE, "--plot", "emptydir/x.svg"]) == 0
    assert b"<svg" in (scratch / "emptydir" / "x.svg").read_bytes()
    assert not list(scratch.rglob(".*.partial"))
