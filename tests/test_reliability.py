"""Runtime faults: a frozen or killed rank is named within 2x the timeout, SIGTERM stops a run
gracefully with a checkpoint it resumes from exactly, and a NaN in one rank's gradients gets
the same ``train.on_nonfinite`` decision on every rank.

Real command lines (``meshlm train``, 4 local workers, dp = 2 x tp = 2) for the signals and
timeouts; one spawned world of 2 (DDP) for the non-finite policies, checked against the
one-process run. The flight recorder's diagnosis is also checked alone on synthetic rings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshlm.checkpoint.loading import load_model
from meshlm.checkpoint.sharded import ShardedCheckpoint
from meshlm.config import load_config
from meshlm.distributed.flight import FlightRecorder, describe_record, diagnose, read_ring
from meshlm.testing import (
    HANG_GUARD_S,
    command_env,
    max_relative_difference,
    run_cli,
    run_world,
)
from meshlm.train.metrics import read_metrics
from meshlm.train.nonfinite import NonFiniteError
from meshlm.train.trainer import Trainer, train

MESHLM = Path(sys.executable).with_name("meshlm")
LAYOUT = ["--parallel.dp=2", "--parallel.tp=2", "--train.micro_batch=4"]
TIMEOUT_S = 10.0


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return command_env(extra)


@pytest.fixture(scope="module")
def args(corpus_dir: Path, cache_dir: Path) -> list[str]:
    return [
        "train", "--model.preset=tiny", f"--data.path={corpus_dir}",
        f"--data.cache_dir={cache_dir}", "--data.vocab_size=512", "--data.seq_len=32",
        "--train.global_batch=8", "--train.warmup_steps=2", "--train.eval_every=0",
        "--train.log_every=1", "--run.sample_tokens=0", "--train.peak_flops=1e10",
    ]


# ------------------------------------------------------------------ frozen / killed ranks
def test_frozen_rank_is_named_within_twice_the_timeout(args: list[str], tmp_path: Path) -> None:
    """Rank 3 SIGSTOPs itself inside step 3: every rank exits, non-zero, the survivors giving up
    within 2x distributed.timeout_s of the freeze; the message names rank 3, its coordinates and its
    last collective; the survivors dumped their flight records."""
    stop_file = tmp_path / "stopped_at"
    run = tmp_path / "run"
    proc = run_cli([*args, *LAYOUT, "--train.steps=200", f"--run.dir={run}",
                    f"--distributed.timeout_s={TIMEOUT_S}"],
                   {"MESHLM_FAULT_STOP_AT_STEP": "3", "MESHLM_FAULT_STOP_FILE": str(stop_file)})
    assert proc.returncode != 0, proc.stdout
    froze = float(stop_file.read_text())
    # when the survivors gave up (their flight dumps), not when the processes were gone: the
    # teardown after it is the machine's, slow when it is loaded
    detected = min(p.stat().st_mtime for p in (run / "flight").glob("rank_0000[012].json"))
    assert detected - froze < 2 * TIMEOUT_S, (detected - froze, proc.stderr)
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshlm: error: rank "), proc.stderr
    assert "stalled rank 3 (pp 0, dp 1, cp 0, tp 1; process stopped): last collective " in err[0]
    assert "Timed out" in err[0] and str(run / "flight") in err[0]
    dumped = sorted(p.name for p in (run / "flight").glob("rank_*.json")
                    if not p.name.endswith("meta.json"))
    assert dumped == ["rank_00000.json", "rank_00001.json", "rank_00002.json"], dumped
    assert read_ring(run / "flight", 3)["records"], "the frozen rank's ring is readable"


def test_killed_rank_is_named_with_its_last_collective(args: list[str], tmp_path: Path) -> None:
    """Rank 3 SIGKILLs itself inside step 3: the job exits 1 (a fault, not a user mistake)
    without waiting for distributed.timeout_s, naming rank 3, its signal, its coordinates and
    its last collective, read from its flight ring."""
    run = tmp_path / "run"
    timeout_s = 90.0  # longer than any teardown, loaded or not: ending sooner is not waiting
    proc = run_cli([*args, *LAYOUT, "--train.steps=200", f"--run.dir={run}",
                    f"--distributed.timeout_s={timeout_s}"], {"MESHLM_FAULT_KILL_AT_STEP": "3"})
    ended = time.time()
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("meshlm: error: worker rank 3 died (signal SIGKILL) "
                           "(pp 0, dp 1, cp 0, tp 1); its last collective: "), line
    assert "\n" not in line and f"(flight records: {run / 'flight'})" in line
    metrics = run / "metrics.jsonl"
    steps = [r["step"] for r in read_metrics(metrics)]
    assert steps[-1] <= 3  # it stopped right there, not after a timeout-long wait
    # the last sign of life (step 2's or 3's record) to the end of every process
    assert ended - metrics.stat().st_mtime < timeout_s
    ring = read_ring(run / "flight", 3)
    assert ring["records"], "the killed rank's ring outlives it"
    assert describe_record(ring["records"][-1]) in line


# ------------------------------------------------------------------ graceful stop
def test_sigterm_saves_exits_zero_and_resumes_on_the_uninterrupted_curve(
        args: list[str], tmp_path: Path) -> None:
    run, ref = tmp_path / "run", tmp_path / "ref"
    steps = ["--train.steps=30", "--train.checkpoint_every=0"]
    proc = subprocess.Popen([str(MESHLM), *args, *LAYOUT, *steps, f"--run.dir={run}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    metrics = run / "metrics.jsonl"
    deadline = time.time() + HANG_GUARD_S
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # the launcher relays it to its 4 workers
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, err
    stopped = [r["step"] for r in read_metrics(metrics)]
    last = stopped[-1]
    assert stopped == list(range(1, last + 1)) and 3 <= last < 30, stopped
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{last:07d}"]
    assert f"stopped by SIGTERM after step {last}" in out
    resume = [ln for ln in out.splitlines() if "to continue: " in ln]
    assert len(resume) == 1 and resume[0].endswith(f"--run.dir={run} --run.resume=true"), out
    command = resume[0].split("to continue: ", 1)[1].split()
    assert command[:2] == ["meshlm", "train"]
    done = run_cli(command[1:])  # (the printed command, through meshlm's main in this process)
    assert done.returncode == 0, done.stderr
    assert run_cli([*args, *steps, "--train.micro_batch=8", f"--run.dir={ref}"]).returncode == 0
    got = {r["step"]: r["loss"] for r in read_metrics(metrics)}
    want = {r["step"]: r["loss"] for r in read_metrics(ref / "metrics.jsonl")}
    assert sorted(got) == list(range(1, 31))
    for step, loss in want.items():
        assert abs(got[step] - loss) / loss < 1e-5, (step, got[step], loss)
    diff, name = max_relative_difference(dict(load_model(run).named_parameters()),
                                         dict(load_model(ref).named_parameters()))
    assert diff < 1e-4, (name, diff)


_STOPPER = """
import os, signal, sys, time
from meshlm.train.stopping import StopSignals
with StopSignals() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)  # within a second: the same request, relayed twice
    time.sleep(0.1)
    print(stop.name, flush=True)
    time.sleep(1.2)
    os.kill(os.getpid(), signal.SIGTERM)  # a second request: the process ends at once
    time.sleep(5)
    print("still running", flush=True)
"""


def test_a_second_signal_ends_the_process_at_once() -> None:
    proc = subprocess.run([sys.executable, "-c", _STOPPER], capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.stdout.split() == ["SIGTERM"], proc.stdout
    assert proc.returncode == -signal.SIGTERM


def test_a_second_signal_ends_a_stuck_graceful_stop_at_once(args: list[str],
                                                           tmp_path: Path) -> None:
    """Through the launcher, with the graceful stop unable to finish (rank 3 frozen inside
    step 3, as a hung kernel would be): the first SIGTERM asks for a graceful stop, a second
    one 1.5 s later ends every process within seconds -- not after distributed.timeout_s --
    with ``meshlm: interrupted`` (exit 130); the run dir keeps its last complete checkpoint."""
    stop_file, run = tmp_path / "stopped_at", tmp_path / "run"
    proc = subprocess.Popen(
        [str(MESHLM), *args, *LAYOUT, "--train.steps=200", "--train.checkpoint_every=1",
         f"--run.dir={run}", "--distributed.timeout_s=120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env({"MESHLM_FAULT_STOP_AT_STEP": "3", "MESHLM_FAULT_STOP_FILE": str(stop_file)}))
    deadline = time.time() + HANG_GUARD_S
    while not stop_file.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert stop_file.exists(), proc.communicate(timeout=HANG_GUARD_S)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # graceful: cannot finish, rank 3 is frozen
    time.sleep(1.5)
    assert proc.poll() is None
    second = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    assert time.time() - second < 15, "a second signal must not wait for the timeout"
    assert proc.returncode == 130 and err.strip().endswith("meshlm: interrupted"), (out, err)
    complete = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    assert "step_0000002" in complete, complete
    assert ShardedCheckpoint(run / "checkpoints" / "step_0000002").trainer["step"] == 2


# ------------------------------------------------------------------ non-finite policies
def _policy_run(base: list[str], extra: list[str], env: dict[str, str]) -> dict:
    """One run in a spawned world: per rank, the error (or None) and the final weights."""
    os.environ.update(env)
    try:
        cfg = load_config(None, base + extra)
        trainer = Trainer(cfg, log=lambda _m: None, progress=False)
        try:
            trainer.fit()
            error = None
        except NonFiniteError as e:
            error = str(e)
        return {"error": error, "step": trainer.step,
                "weights": {n: p.detach().clone() for n, p in trainer.model_part.model.named_parameters()}}
    finally:
        for k in env:
            os.environ.pop(k, None)


def _policy_runs(base: list[str], runs: list[tuple[list[str], dict[str, str]]]) -> list[dict]:
    return [_policy_run(base, extra, env) for extra, env in runs]


def test_nonfinite_policies_decide_alike_on_every_rank(corpus_dir: Path, cache_dir: Path,
                                                       tmp_path: Path) -> None:
    base = ["--model.preset=tiny", f"--data.path={corpus_dir}", f"--data.cache_dir={cache_dir}",
            "--data.vocab_size=512", "--data.seq_len=32", "--train.global_batch=4",
            "--train.warmup_steps=1", "--train.eval_every=0", "--run.sample_tokens=0",
            "--train.peak_flops=1e10", "--train.steps=6", "--train.checkpoint_every=2",
            "--parallel.dp=2"]
    nan4 = {"MESHLM_FAULT_NAN_GRAD": "4:1"}  # step 4, rank 1 only (after the all-reduce)
    runs = {
        "stop": (["--train.on_nonfinite=stop"], nan4),
        "skip": (["--train.on_nonfinite=skip", "--train.checkpoint_every=1"], nan4),
        "rollback": (["--train.on_nonfinite=rollback"], nan4),
        "max_skips": (["--train.on_nonfinite=skip", "--train.max_skips=2"],
                      {"MESHLM_FAULT_NAN_GRAD": "3,4:1"}),
    }
    listed = [(extra + [f"--run.dir={tmp_path / name}"], env) for name, (extra, env) in runs.items()]
    per_rank = run_world(2, _policy_runs, base, listed)
    got = {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(runs)}

    # every rank took the same decision and holds the same weights
    for name, (a, b) in got.items():
        assert a["error"] == b["error"] and a["step"] == b["step"], name
        assert max_relative_difference(a["weights"], b["weights"])[0] == 0.0, name

    stop = got["stop"][0]
    assert stop["error"].startswith("step 4: the gradient norm is not finite"), stop["error"]
    assert "train.on_nonfinite=stop" in stop["error"]
    names = sorted(p.name for p in (tmp_path / "stop" / "checkpoints").iterdir())
    assert names == ["step_0000002"], names  # nothing saved after the NaN

    recs = read_metrics(tmp_path / "skip" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert "nonfinite" not in recs[2] and recs[3]["nonfinite"].startswith("the gradient norm")
    assert recs[-1]["nonfinite_skips"] == 1
    ck = tmp_path / "skip" / "checkpoints"
    w3, w4, w5 = ({n: p.detach() for n, p in load_model(ck / f"step_{s:07d}").named_parameters()}
                  for s in (3, 4, 5))
    assert max_relative_difference(w4, w3)[0] == 0.0  # the skipped step changed nothing
    assert max_relative_difference(w5, w4)[0] > 0.0

    assert got["max_skips"][0]["error"].startswith("step 4: the gradient norm is not finite, "
                                                   "2 times in a row; train.max_skips=2")

    # rollback: back to step 2, batch 4 never trained on -- the one-process run told to skip
    # batch 4 from the start ends with the same weights and losses
    rb = tmp_path / "rollback"
    recs = read_metrics(rb / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]  # the redone steps replace theirs
    assert recs[-1]["rollbacks"] == 1
    with ShardedCheckpoint(rb / "checkpoints" / "step_0000006") as ckpt:
        assert ckpt.trainer["sampler"]["skip"] == [4]
    ref = train(load_config(None, base + ["--parallel.dp=1", "--train.skip_batches=4",
                                          f"--run.dir={tmp_path / 'ref'}"]),
                log=lambda _m: None, progress=False)
    for r in recs:
        assert abs(r["loss"] - ref.losses[r["step"]]) / ref.losses[r["step"]] < 1e-5, r["step"]
    diff, name = max_relative_difference(got["rollback"][0]["weights"],
                                         dict(load_model(tmp_path / "ref").named_parameters()))
    assert diff < 1e-4, (name, diff)


def test_a_huge_learning_rate_stops_instead_of_training_on_nan(corpus_dir: Path,
                                                               cache_dir: Path,
                                                               tmp_path: Path) -> None:
    cfg = load_config(None, [
        "--model.preset=tiny", f"--data.path={corpus_dir}", f"--data.cache_dir={cache_dir}",
        "--data.vocab_size=512", "--data.seq_len=32", "--train.global_batch=4",
        "--train.warmup_steps=0", "--train.eval_every=0", "--run.sample_tokens=0",
        "--train.lr=1e30", "--train.min_lr=0", "--train.grad_clip=0", "--train.steps=20",
        f"--run.dir={tmp_path / 'run'}"])
    with pytest.raises(NonFiniteError, match=r"^step \d+: the (loss|gradient norm) is not finite"):
        train(cfg, log=lambda _m: None, progress=False)


# ------------------------------------------------------------------ diagnosis alone
def test_diagnosis_follows_the_chain_of_waits(tmp_path: Path) -> None:
    """Rank 0 waits in all_reduce[dp] #2 for rank 2, which waits in all_reduce[tp] #5 for rank
    3, which never entered it (alive, in compute): rank 3 is named."""
    groups = {0: {"dp": [0, 2], "tp": [0, 1]}, 1: {"dp": [1, 3], "tp": [0, 1]},
              2: {"dp": [0, 2], "tp": [2, 3]}, 3: {"dp": [1, 3], "tp": [2, 3]}}
    recs = {r: FlightRecorder(tmp_path, r, 4, 8, {"pp": 0, "dp": r // 2, "cp": 0, "tp": r % 2},
                              groups[r]) for r in range(4)}
    for rec in recs.values():
        for _ in range(4):  # four completed tp all-reduces each
            rec.done(rec.enter("all_reduce", "tp", 64))
        rec.done(rec.enter("all_reduce", "dp", 256))
    recs[0].enter("all_reduce", "dp", 256)  # waits for rank 2
    recs[2].enter("all_reduce", "tp", 64)  # waits for rank 3
    line = diagnose(tmp_path, 4)
    assert line.startswith("stalled rank 3 (pp 0, dp 1, cp 0, tp 1; never reached the "
                           "collective its peers wait in): last collective all_reduce[dp] #1 "
                           "(completed)"), line
    assert "rank 0 waited in all_reduce[dp] #2" in line and "rank 2 waited in all_reduce[tp] #5" in line
    ring = read_ring(tmp_path, 0)
    assert ring["collectives"] == 6 and len(ring["records"]) == 6
    assert ring["per_axis"]["tp"] == 4 and ring["per_axis"]["dp"] == 2
    for rec in recs.values():
        rec.close()


def test_a_survivor_that_gave_up_and_exited_is_not_named(tmp_path: Path) -> None:
    """Rank 3 is stopped; rank 2, its peer, gave up first (dumped its ring) and has exited;
    rank 1 is gone without a dump (killed). The diagnosis names ranks 1 and 3, not rank 2."""
    groups = {0: {"dp": [0, 2], "tp": [0, 1]}, 1: {"dp": [1, 3], "tp": [0, 1]},
              2: {"dp": [0, 2], "tp": [2, 3]}, 3: {"dp": [1, 3], "tp": [2, 3]}}
    recs = {r: FlightRecorder(tmp_path, r, 4, 8, {"pp": 0, "dp": r // 2, "cp": 0, "tp": r % 2},
                              groups[r]) for r in range(4)}
    recs[2].enter("all_reduce", "tp", 64)
    recs[2].dump("Timed out")
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        os.waitpid(frozen.pid, os.WUNTRACED)  # (returns once it is stopped)
        for rank, pid in ((1, exited.pid), (2, exited.pid), (3, frozen.pid)):
            meta_path = tmp_path / f"rank_{rank:05d}.meta.json"
            meta = json.loads(meta_path.read_text())
            meta_path.write_text(json.dumps({**meta, "pid": pid}))
        line = diagnose(tmp_path, 4)
    finally:
        frozen.kill()
        frozen.wait()
    assert line.startswith("stalled rank 1 (pp 0, dp 0, cp 0, tp 1; process gone): "), line
    assert "; rank 3 (pp 0, dp 1, cp 0, tp 1; process stopped): " in line, line
    assert "rank 2 (" not in line and "rank 2 waited in all_reduce[tp] #1" in line, line
    for rec in recs.values():
        rec.close()


def test_flight_ring_keeps_the_last_records(tmp_path: Path) -> None:
    rec = FlightRecorder(tmp_path, 0, 2, 4, {"pp": 0, "dp": 0, "cp": 0, "tp": 0}, {"dp": [0, 1]})
    for i in range(10):
        rec.done(rec.enter("all_gather", "dp", i))
    ring = read_ring(tmp_path, 0)
    assert [r["seq"] for r in ring["records"]] == [7, 8, 9, 10]
    assert [r["bytes"] for r in ring["records"]] == [6, 7, 8, 9]
    assert all(r["t_done"] for r in ring["records"]) and ring["per_axis"]["dp"] == 10
    rec.close()
