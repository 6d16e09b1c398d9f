"""Stragglers: the detector on fixed sequences of per-rank times (no processes), the wait clocks
(the NCCL one with stand-in groups), the injected slow rank, and two real 2-rank runs of
``meshlm train``: one with rank 1 slowed down for a few steps (named, with its coordinates,
while the run goes on; then caught up), one without (nothing named)."""

from __future__ import annotations

import os
import random
import subprocess
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshlm.distributed import faults
from meshlm.layout import Layout
from meshlm.testing import run_cli
from meshlm.train.metrics import read_metrics
from meshlm.train.stragglers import NcclWait, StragglerDetector, WaitClock, seconds, wait_clock

LAYOUT = Layout(dp=2, tp=2)  # rank 2: pp 0, dp 1, cp 0, tp 0


def detector(steps: int = 3, **kw) -> StragglerDetector:  # noqa: ANN003
    return StragglerDetector(0.2, steps, LAYOUT.coords, **kw)


def feed(det: StragglerDetector, own: list[float], start: int = 1, n: int = 1,
         step_s: float = 1.0) -> list[tuple[int, str]]:
    """``n`` steps in which rank r worked ``own[r]`` s and waited the rest of ``step_s``."""
    lines = []
    for step in range(start, start + n):
        waits = [step_s - o for o in own]
        lines += [(step, line) for line in det.update(step, [step_s] * len(own), waits)]
    return lines


# ------------------------------------------------------------------ the detector
def test_names_the_slow_rank_after_k_steps_not_before() -> None:
    det = detector(steps=3)
    slow = [0.23, 0.23, 0.42, 0.23]  # steps of 0.42 s: the others wait 0.19 s
    assert feed(det, slow, n=4, step_s=0.42) == []  # steps 1, 2: warm-up; 3, 4: two slow
    assert det.current is None
    lines = feed(det, slow, start=5, step_s=0.42)
    assert lines == [(5, "straggler: rank 2 (pp 0, dp 1, cp 0, tp 0) is 1.8x slower than the "
                         "median rank: 0.42 s of its own work per step vs 0.23 s; its peers "
                         "wait 0.19 s per step for it (last 3 steps)")]
    rec = det.current.record()
    assert rec["rank"] == 2 and rec["ratio"] == pytest.approx(0.42 / 0.23, rel=1e-3)
    assert feed(det, slow, start=6, n=20, step_s=0.42) == []  # then quiet while it lasts


def test_the_first_steps_are_warm_up() -> None:
    det = detector(steps=1)
    assert feed(det, [0.1, 5.0, 0.1, 0.1], n=2) == []  # slow first steps: allocating, compiling
    assert feed(det, [0.1, 0.1, 0.1, 0.1], start=3) == []
    assert [s for s, _ in feed(det, [0.1, 5.0, 0.1, 0.1], start=4)] == [4]


def test_noise_below_the_threshold_names_nobody() -> None:
    rng = random.Random(0)
    det = detector(steps=3)
    for step in range(1, 500):  # +-4 % around 0.2 s, and one rank always 10 % slower
        own = [0.2 * (1 + rng.uniform(-0.04, 0.04)) for _ in range(4)]
        own[1] *= 1.10
        assert det.update(step, [0.5] * 4, [0.5 - o for o in own]) == [], step
    assert det.current is None


def test_short_steps_below_the_floor_name_nobody() -> None:
    det = detector(steps=3)  # 3x slower, but by 4 ms: timer and scheduler noise
    assert feed(det, [0.002, 0.002, 0.006, 0.002], n=20, step_s=0.01) == []


def test_names_the_right_rank_among_eight_with_its_coordinates() -> None:
    layout = Layout(pp=2, dp=2, tp=2)
    stage = [layout.coords(r)["pp"] for r in range(8)]
    det = StragglerDetector(0.2, 4, layout.coords, stage=stage)
    own = [0.3] * 8
    own[5] = 0.6
    lines = feed(det, own, n=6)
    assert [s for s, _ in lines] == [6]
    assert lines[0][1].startswith("straggler: rank 5 (pp 1, dp 0, cp 0, tp 1) is 2.0x slower")


def test_a_pipeline_stage_with_more_work_is_not_a_straggler_when_it_has_peers() -> None:
    layout = Layout(pp=2, dp=2)  # stage 1 (ranks 2, 3) holds the head: more work, same for both
    det = StragglerDetector(0.2, 3, layout.coords, stage=[0, 0, 1, 1])
    assert feed(det, [0.2, 0.2, 0.35, 0.35], n=20) == []
    alone = StragglerDetector(0.2, 3, Layout(pp=2).coords, stage=[0, 1])  # no peers: all others
    assert [s for s, _ in feed(alone, [0.2, 0.35], n=20)] == [5]


def test_recovery_is_said_once() -> None:
    det = detector(steps=3)
    feed(det, [0.2, 0.2, 0.2, 0.5], n=5)
    assert det.current.rank == 3
    lines = feed(det, [0.2, 0.2, 0.2, 0.21], start=6, n=10)
    assert lines == [(8, "straggler: rank 3 (pp 0, dp 1, cp 0, tp 1) has caught up: 0.21 s "
                         "of its own work per step vs 0.20 s (last 3 steps)")]
    assert det.current is None


def test_a_lasting_straggler_is_named_again_rarely_or_when_it_changes() -> None:
    det = detector(steps=3, repeat=10)
    assert [s for s, _ in feed(det, [0.2, 0.4, 0.2, 0.2], n=25)] == [5, 15, 25]
    det = detector(steps=3)
    assert [s for s, _ in feed(det, [0.2, 0.4, 0.2, 0.2], n=10)] == [5]
    lines = feed(det, [0.2, 0.8, 0.2, 0.2], start=11, n=20)  # 2x -> 4x: named again, once
    assert [s for s, _ in lines] == [15] and "is 4.0x slower" in lines[0][1]  # (10 steps on)


def test_threshold_zero_disables_detection() -> None:
    det = StragglerDetector(0.0, 1, LAYOUT.coords)
    assert feed(det, [0.1, 0.1, 9.0, 0.1], n=10) == [] and det.current is None


def test_seconds_text() -> None:
    assert (seconds(0.4249), seconds(0.0223), seconds(12.0)) == ("0.42 s", "22 ms", "12.00 s")


# ------------------------------------------------------------------ wait clocks
class FakeGroup:
    """A process group that accepts c10d's timing switch and completion hook."""

    def __init__(self) -> None:
        self.timing, self.hook = False, None

    def _enable_collectives_timing(self) -> None:
        self.timing = True

    def _register_on_completion_hook(self, hook) -> None:  # noqa: ANN001
        self.hook = hook

    def complete(self, started: float, duration: float) -> None:
        self.hook(SimpleNamespace(time_started=datetime.fromtimestamp(started),
                                  active_duration=timedelta(seconds=duration)))


def test_cpu_wait_clock_reads_the_host_wait() -> None:
    comm = SimpleNamespace(wait_s=3.0)
    clock = WaitClock(comm)
    clock.start()
    assert comm.wait_s == 0.0
    comm.wait_s += 0.25
    assert clock.stop() == 0.25


def test_nccl_wait_counts_the_collectives_issued_in_steps() -> None:
    """(The logic of the GPU-only path, with stand-in groups.)"""
    a, b = FakeGroup(), FakeGroup()
    nccl = NcclWait([a, b])
    assert a.timing and b.timing and a.hook is not None
    nccl.start()
    t0 = nccl.opened
    a.complete(t0 + 0.001, 0.2)
    b.complete(t0 + 0.002, 0.1)
    first = nccl.stop()
    assert first == pytest.approx(0.3)
    (lo, hi), = nccl.windows
    b.complete(hi + 1.0, 5.0)  # issued between steps (evaluation, checkpoint): not counted
    a.complete((lo + hi) / 2, 0.05)  # the last step's collective, reported late: in the next
    nccl.start()
    a.complete(nccl.opened + 0.001, 0.1)
    assert nccl.stop() == pytest.approx(0.15)


def test_wait_clock_on_cuda_falls_back_to_the_host_and_says_so() -> None:
    class Refusing(FakeGroup):
        def _register_on_completion_hook(self, hook) -> None:  # noqa: ANN001
            raise RuntimeError("hooks need NCCL")

    groups = {"world": Refusing(), "dp": Refusing()}
    mesh = SimpleNamespace(distributed=True, world_size=2, group_ranks=lambda: groups,
                           group=groups.get)
    comm = SimpleNamespace(mesh=mesh, wait_s=0.0)
    said: list[str] = []
    clock = wait_clock(comm, "cuda", said.append)
    assert clock.nccl is None and said and "hooks need NCCL" in said[0]
    groups = {"world": FakeGroup(), "dp": FakeGroup()}
    mesh.group_ranks, mesh.group = (lambda: groups), groups.get
    assert wait_clock(comm, "cuda", said.append).nccl is not None
    assert wait_clock(comm, "cpu", said.append).nccl is None


def test_slow_rank_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setenv("MESHLM_FAULT_SLOW_RANK", "1:0.3")
    for rank in (0, 1, 2):
        faults.slow_if_asked(7, rank)
    monkeypatch.setenv("MESHLM_FAULT_SLOW_RANK", "2:0.5:3-4")
    for step in range(1, 7):
        faults.slow_if_asked(step, 2)
    assert slept == [0.3, 0.5, 0.5]


# ------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def args(corpus_dir: Path, cache_dir: Path) -> list[str]:
    return [
        "train", "--model.preset=tiny", f"--data.path={corpus_dir}",
        f"--data.cache_dir={cache_dir}", "--data.vocab_size=512", "--data.seq_len=64",
        "--train.global_batch=16", "--train.warmup_steps=2", "--train.eval_every=0",
        "--train.log_every=1", "--run.sample_tokens=0", "--train.peak_flops=1e10",
        "--parallel.dp=2",
    ]


def _meshlm(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``meshlm ARGV`` run here (its workers fork from this process's forkserver)."""
    proc = run_cli(list(argv), env)
    assert proc.returncode == 0, proc.stderr
    return proc


def _replay(records: list[dict], threshold: float = 0.2, steps: int = 5) -> list[str]:
    """The lines a detector with these settings draws from a run's recorded times."""
    det = StragglerDetector(threshold, steps, Layout(dp=2).coords)
    return [line for r in records
            for line in det.update(r["step"], r["step_time_per_rank"], r["wait_time_per_rank"])]


def test_a_slow_rank_is_named_during_the_run(args: list[str], tmp_path: Path) -> None:
    """Rank 1 sleeps 1 s in steps 3-8 (the steps take ~0.1 s idle, a few times that on a
    loaded host): after straggler_steps=3 slow steps it is named with its coordinates, before
    step 5's progress line. The metrics list every rank's step and wait times, and replayed
    through a detector they give exactly the lines the run printed -- its "caught up" line
    too, whenever the recorded times after the fault show it (a loaded host may starve either
    rank then; the detector's own tests show the line)."""
    run = tmp_path / "run"
    proc = _meshlm(*args, "--train.steps=20", "--distributed.straggler_steps=3",
                   f"--run.dir={run}", env={"MESHLM_FAULT_SLOW_RANK": "1:1.0:3-8"})
    out = proc.stdout.splitlines()
    named = [i for i, ln in enumerate(out) if ln.startswith("straggler: ")]
    assert named, proc.stdout
    line = out[named[0]]
    print(line)
    assert line.startswith("straggler: rank 1 (pp 0, dp 1, cp 0, tp 0) is "), line
    assert "x slower than the median rank: " in line and line.endswith("(last 3 steps)"), line
    progress = {ln.split("/")[0]: i for i, ln in enumerate(out) if ln.startswith("step ")}
    assert progress["step 4"] < named[0] < progress["step 5"], proc.stdout  # during the run
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert [out[i] for i in named] == _replay(records, steps=3)
    own, wait = [0.0, 0.0], [0.0, 0.0]  # per rank, summed over the slow steps
    for r in records:
        times, waits = r["step_time_per_rank"], r["wait_time_per_rank"]
        assert len(times) == len(waits) == 2 and min(times) > 0 and min(waits) >= 0
        if 3 <= r["step"] <= 8:  # (one step of a loaded host may starve rank 0 as much)
            for k in range(2):
                own[k] += (times[k] - waits[k]) / 6
                wait[k] += waits[k] / 6
        if 5 <= r["step"] <= 8:
            assert r["straggler"]["rank"] == 1 and r["straggler"]["ratio"] > 2, r
    assert own[1] > own[0] + 0.7 and own[1] > 1.0 and wait[0] > wait[1] + 0.7, (own, wait)


def test_no_straggler_is_named_without_one(args: list[str], tmp_path: Path) -> None:
    """The same world without the fault, default settings: the log names nobody. (A host
    loaded far beyond its cores can starve one rank for steps on end, making it a straggler
    indeed; there only the agreement of the log with the recorded times is checked.)"""
    proc = _meshlm(*args, "--train.steps=12", f"--run.dir={tmp_path / 'run'}")
    printed = [ln for ln in proc.stdout.splitlines() if ln.startswith("straggler: ")]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(len(r["wait_time_per_rank"]) == 2 for r in records)
    assert printed == _replay(records)
    if os.getloadavg()[0] <= 2 * (os.cpu_count() or 1):
        assert printed == [], printed
