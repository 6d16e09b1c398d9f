"""NCCL-semantics mode: gloo behaving as NCCL does, so a CPU run fails where a GPU run would.

One spawned world of 2 checks the process-group layer itself (one handle per group, a send
that completes only when matched, groups in order, tensor checks) against plain gloo; another
commits, one after another, each violation gloo runs silently and NCCL hangs on or corrupts (a
group and a collective in different orders on one communicator, a send buffer written before
the wait, a pair's messages received in swapped order, a receive longer than its message, direct
torch.distributed calls) and checks each rank's error; a third runs the pipeline executor with
interleaved tables that place each receive right before its compute, which deadlock in
NCCL-semantics mode as they would on GPUs, while Megatron-Core's grouping trains (the same losses
as on plain gloo). The device-index check, the stall monitor and the launcher's verdict are
checked without processes.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshlm.distributed import nccl_semantics
from meshlm.distributed.flight import FlightRecorder, read_ring
from meshlm.distributed.stall import StallMonitor
from meshlm.testing import HANG_GUARD_S, run_world


def _comm(timeout_s: float = 60.0):  # noqa: ANN202
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from meshlm.distributed.comm import Comm
    from meshlm.distributed.mesh import Mesh
    from meshlm.layout import Layout

    _set_pg_timeout(timedelta(seconds=timeout_s), dist.group.WORLD)
    mesh = Mesh(Layout(pp=2))
    return Comm(mesh)


def _semantics_body(nccl: bool) -> dict:
    """Checks of the process-group layer on 2 ranks; returns what each rank saw."""
    import torch

    os.environ[nccl_semantics.ENV] = "1" if nccl else "0"
    comm = _comm(timeout_s=60.0)
    r, peer = comm.rank("pp"), 1 - comm.rank("pp")
    out: dict = {"nccl_rules": comm.nccl_rules}
    # one handle for a group of four operations, data as sent
    a, b = torch.full((3,), 10.0 + r), torch.full((2,), 20.0 + r)
    ra, rb = torch.empty(3), torch.empty(2)
    h = comm.batch_p2p([("send", a, peer), ("send", b, peer), ("recv", ra, peer),
                        ("recv", rb, peer)], "pp")
    h.wait()
    h.wait()  # a second wait returns at once
    out["received"] = ra.tolist() + rb.tolist()
    # a send is complete only once the peer has started the group with its receive: rank 1
    # posts that receive 1.5 s late; rank 0's send handle must not complete before
    if r == 0:
        t0 = time.perf_counter()
        comm.batch_p2p([("send", torch.ones(4), 1)], "pp").wait()
        out["send_wait_s"] = time.perf_counter() - t0
    else:
        time.sleep(1.5)
        comm.batch_p2p([("recv", torch.empty(4), 0)], "pp").wait()
    # NCCL takes contiguous tensors on the rank's device only
    try:
        comm.all_reduce(torch.ones(4, 4).t(), "pp")
        out["non_contiguous"] = "accepted"
    except ValueError as e:
        out["non_contiguous"] = str(e)
        comm.all_reduce(torch.ones(4, 4), "pp")  # (keep the ranks' collectives matched)
    comm.close()
    return out


def test_process_group_layer_in_nccl_semantics_mode() -> None:
    nccl = run_world(2, _semantics_body, True)
    plain = run_world(2, _semantics_body, False)
    for res in (nccl, plain):
        assert res[0]["received"] == [11.0] * 3 + [21.0] * 2
        assert res[1]["received"] == [10.0] * 3 + [20.0] * 2
    assert nccl[0]["nccl_rules"] and not plain[0]["nccl_rules"]
    # the send completes only when the receive is posted
    assert nccl[0]["send_wait_s"] > 1.2, nccl[0]
    assert "not contiguous" in nccl[0]["non_contiguous"]
    assert plain[0]["non_contiguous"] == "accepted"


def _deadlock_body(nccl: bool) -> str:
    """Send first, then receive, on both ranks, in two groups: gloo completes the sends
    locally; under NCCL's rule each rank's send group waits for the other's receive group,
    which its stream runs only after its own send group: a deadlock."""
    import torch

    os.environ[nccl_semantics.ENV] = "1" if nccl else "0"
    comm = _comm(timeout_s=3.0)
    peer = 1 - comm.rank("pp")
    x, y = torch.ones(8), torch.empty(8)
    sent = comm.batch_p2p([("send", x, peer)], "pp")
    comm.batch_p2p([("recv", y, peer)], "pp").wait()
    sent.wait()
    comm.close()
    return "completed"


def test_send_send_deadlock_surfaces_as_on_nccl() -> None:
    assert run_world(2, _deadlock_body, False) == ["completed"] * 2
    with pytest.raises(RuntimeError, match=r"died \(exit code -6\)"):  # SIGABRT: the watchdog
        run_world(2, _deadlock_body, True)


def _violations_body() -> dict[str, str]:
    """Each violation NCCL hangs on or corrupts silently (gloo runs them all), committed on
    purpose in NCCL-semantics mode; what each rank saw ("passed" or the error)."""
    import torch
    import torch.distributed as dist

    os.environ[nccl_semantics.ENV] = "1"
    comm = _comm(timeout_s=60.0)
    r, peer = comm.rank("pp"), 1 - comm.rank("pp")
    out: dict[str, str] = {}

    def attempt(name: str, fn) -> None:  # noqa: ANN001
        try:
            fn()
            out[name] = "passed"
        except nccl_semantics.NcclSemanticsError as e:
            out[name] = str(e)

    def exchange(first: str = "p2p") -> str:
        """A group and an all-reduce on the pp communicator (pp-only: the default group)."""
        sent, got, total = torch.full((3,), 1.0 + r), torch.empty(3), torch.full((2,), 1.0 + r)
        if first == "p2p":
            h = comm.batch_p2p([("send", sent, peer), ("recv", got, peer)], "pp")
            comm.all_reduce(total, "pp")
        else:
            comm.all_reduce(total, "pp")
            h = comm.batch_p2p([("send", sent, peer), ("recv", got, peer)], "pp")
        h.wait()
        return f"{got.tolist()} {total.tolist()}"

    out["legitimate"] = exchange()
    # a. rank 0: group, then all-reduce; rank 1: all-reduce, then group (NCCL: a deadlock)
    attempt("order", lambda: exchange("p2p" if r == 0 else "all_reduce"))

    def changed_send() -> None:  # b. rank 0 writes its send buffer before the wait
        if r == 0:
            t = torch.zeros(5)
            h = comm.batch_p2p([("send", t, 1)], "pp")
            t.add_(1.0)
            h.wait()
        else:
            comm.batch_p2p([("recv", torch.empty(5), 0)], "pp").wait()

    def swapped(send: list, recv: list) -> None:  # noqa: ANN001 (c. rank 1 receives in
        comm.batch_p2p(send if r == 0 else recv, "pp").wait()  # another order, gloo matches)

    attempt("changed_send", changed_send)
    attempt("swapped_shapes", lambda: swapped(
        [("send", torch.zeros(2, 3), 1), ("send", torch.ones(3, 2), 1)],
        [("recv", torch.empty(3, 2), 0), ("recv", torch.empty(2, 3), 0)]))
    attempt("swapped_labels", lambda: swapped(
        [("send", torch.zeros(4), 1, 1), ("send", torch.ones(4), 1, 2)],
        [("recv", torch.empty(4), 0, 2), ("recv", torch.empty(4), 0, 1)]))
    attempt("longer_receive", lambda: swapped([("send", torch.ones(4), 1)],
                                              [("recv", torch.empty(6), 0)]))

    def direct() -> None:  # e. around Comm
        dist.all_reduce(torch.ones(2))

    def direct_p2p() -> None:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), peer)])

    attempt("direct", direct)
    attempt("direct_p2p", direct_p2p)
    out["after"] = exchange()  # (every violation left both ranks in step)
    comm.close()
    return out


def test_violations_gloo_forgives_raise_in_nccl_semantics_mode() -> None:
    """a-e in one world of 2: each raises a clear error on the ranks that can see it."""
    res = run_world(2, _violations_body)
    for r, seen in enumerate(res):
        other = 1 - r
        assert seen["legitimate"] == seen["after"] == f"{[2.0 - r] * 3} {[3.0] * 2}", seen
        # a. named on both ranks, with both orders
        order = seen["order"]
        assert "out of order with that communicator's collectives" in order, order
        last = ["p2p, all_reduce, p2p", "p2p, all_reduce, all_reduce, p2p"]
        assert (f"rank {r} issued it after {1 + r} collectives there (its last operations "
                f"there: {last[r]}), rank {other} after {1 + other} ({last[other]})") in order
        # c. a swap of equal sizes (gloo: the data swapped), a longer receive (gloo: accepted)
        assert ("rank 1's receive #3 from rank 0 on pp is float32 [3, 2], but rank 0's send #3 "
                "is float32 [2, 3]") in seen["swapped_shapes"], seen["swapped_shapes"]
        assert ("rank 1's receive #5 from rank 0 on pp is float32 [4], label 2, but rank 0's "
                "send #5 is float32 [4], label 1") in seen["swapped_labels"]
        assert "is float32 [6], but rank 0's send #7 is float32 [4]" in seen["longer_receive"]
        # e. before any communication
        assert seen["direct"].startswith("torch.distributed.all_reduce called from "), seen
        assert ":direct:" in seen["direct"] and "not through meshlm" in seen["direct"]
        assert seen["direct_p2p"].startswith("torch.distributed.batch_isend_irecv called from")
    # b. on the rank that wrote its buffer
    assert res[0]["changed_send"].startswith(
        "send #2 to rank 1 on pp (float32 [5]) changed between posting and the wait"), res[0]
    assert res[1]["changed_send"] == "passed"


def test_tensor_on_another_ranks_device_is_refused() -> None:
    """d. On a device with an index the index must be the rank's (a CPU tensor has none, so the
    tensor is a fake one on cuda:0: no GPU needed)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = torch.empty(4, device="cuda:0")
    with pytest.raises(ValueError, match=r"all_reduce: tensor on cuda:0, but this rank's device "
                                         r"is cuda:1"):
        nccl_semantics.check_tensor(t, torch.device("cuda", 1), "all_reduce")
    nccl_semantics.check_tensor(t, torch.device("cuda", 0), "all_reduce")
    with pytest.raises(ValueError, match="meta tensor of shape"):
        nccl_semantics.check_tensor(torch.empty(2, device="meta"), torch.device("cpu"), "send")


def _pipeline_body(base: list[str], run: list[str], ungrouped: bool) -> dict[int, float]:
    """Train with the interleaved schedule; ``ungrouped``: the tables gloo forgave."""
    import meshlm.parallel.pipeline as pipeline
    from meshlm.testing import train_runs

    if ungrouped:
        from meshlm.parallel.schedules import tables_from_order

        pipeline.build_schedule = tables_from_order
    return train_runs(base, [run])[0]


def test_interleaved_groups_deadlock_in_nccl_mode_unless_regrouped(
        corpus_dir: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["--model.preset=tiny", f"--data.path={corpus_dir}", f"--data.cache_dir={cache_dir}",
            "--data.vocab_size=512", "--data.seq_len=32", "--train.steps=1",
            "--train.global_batch=8", "--train.micro_batch=2", "--train.eval_every=0",
            "--run.sample_tokens=0", "--train.peak_flops=1e10", "--model.n_layers=4",
            "--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2"]
    plain = run_world(2, _pipeline_body, base, [f"--run.dir={tmp_path / 'a'}"], False)
    monkeypatch.setenv(nccl_semantics.ENV, "1")
    grouped = run_world(2, _pipeline_body, base, [f"--run.dir={tmp_path / 'b'}"], False)
    assert grouped[1] == pytest.approx(plain[1], rel=1e-6)
    # NCCL's rule does not: at the world's collective timeout the stall monitor gives its
    # verdict and exits (1), or the collective's own timeout aborts (SIGABRT)
    with pytest.raises(RuntimeError, match=r"died \(exit code (-6|1)\)"):
        run_world(2, _pipeline_body, base, [f"--run.dir={tmp_path / 'c'}"], True,
                  collective_timeout=10.0)


# ------------------------------------------------------------------ stall monitor, launcher
class _Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def _ring(folder: Path, rank: int, world: int = 2) -> FlightRecorder:
    return FlightRecorder(folder, rank, world, 16, {"pp": 0, "dp": rank, "cp": 0, "tp": 0},
                          {"dp": list(range(world))})


def test_stall_monitor_reads_completion_from_handles_and_names_the_laggard(tmp_path: Path) -> None:
    """Completion is what the handle says, not the call returning; a collective pending past
    the timeout gets one verdict naming the rank that never reached it."""
    me, peer = _ring(tmp_path, 0), _ring(tmp_path, 1)
    verdicts: list[str] = []
    monitor = StallMonitor(me, 2, timeout_s=0.3, poll_s=0.05, on_stall=verdicts.append)
    other = StallMonitor(peer, 2, timeout_s=60, poll_s=0.05, on_stall=verdicts.append)
    try:
        for ring in (me, peer):  # both ranks did all_reduce #1 ...
            slot = ring.enter("all_reduce", "dp", 64, True)
            ring.done(slot)
        done_work, stuck_work = _Work(), _Work()
        slot = me.enter("all_reduce", "dp", 64, True)  # ... rank 0 alone enters #2 and #3
        monitor.track(slot, me.seq, done_work)
        slot3 = me.enter("all_reduce", "dp", 64, True)
        monitor.track(slot3, me.seq, stuck_work)
        done_work.done = True  # #2 completed on the device; #3 never will (rank 1 is away)
        time.sleep(0.2)
        records = read_ring(tmp_path, 0)["records"]
        assert records[1]["t_done"] is not None and records[2]["t_done"] is None
        assert not verdicts  # not yet: 0.3 s
        deadline = time.time() + 60  # (a wait, not a bound: the verdicts come in ~0.3 s)
        while not verdicts and time.time() < deadline:
            time.sleep(0.05)
        # a monitor firing later repeats the first verdict (rank 0 may have exited by then)
        assert other.verdict() == verdicts[0]
    finally:
        monitor.close()
        other.close()
    assert len(verdicts) == 1, verdicts
    assert verdicts[0].startswith("stalled rank 1 (pp 0, dp 1, cp 0, tp 0; never reached the "
                                  "collective its peers wait in)"), verdicts[0]
    assert "rank 0 waited in all_reduce[dp] #3" in verdicts[0]
    assert (tmp_path / "rank_00000.json").is_file()


def test_launcher_reports_the_root_cause_not_the_watchdog_abort(tmp_path: Path) -> None:
    """The first failure is a rank NCCL's watchdog aborted (SIGABRT); another rank's stall
    monitor wrote the verdict: the launcher reports the verdict."""
    import json

    from meshlm.launch import _summarise

    verdict = "stalled rank 3 (pp 0, dp 1, cp 0, tp 1; process stopped): last collective x"
    error_file = tmp_path / "run_id" / "attempt_0" / "1" / "error.json"
    error_file.parent.mkdir(parents=True)
    error_file.write_text(json.dumps({"message": {"message": f"CollectiveFailure: {verdict}",
                                                  "extraInfo": {"timestamp": "1"}}}))
    aborted = SimpleNamespace(exitcode=-signal.SIGABRT, error_file=str(tmp_path / "none.json"),
                              error_file_data={}, signal_name=lambda: "SIGABRT")
    err = SimpleNamespace(get_first_failure=lambda: (0, aborted))
    rank, message = _summarise(err, str(tmp_path))
    assert message == verdict, message
    # without a verdict anywhere, the abort itself is named as what it is
    error_file.unlink()
    _, message = _summarise(err, str(tmp_path))
    assert message.startswith("worker rank 0 aborted (SIGABRT: a collective timed out"), message


def test_frozen_rank_is_named_by_the_stall_monitor(corpus_dir: Path, cache_dir: Path,
                                                   tmp_path: Path) -> None:
    """NCCL-semantics mode, ``meshlm train`` on 4 workers (dp 2 x tp 2): rank 3 freezes in step
    3. No rank's error handling speaks (collectives abort, as on NCCL); the stall monitors read
    completion from the handles and name rank 3, its coordinates and its last collective; the
    launcher reports that verdict; the monitors fire within 2x distributed.timeout_s of the
    freeze."""
    import subprocess
    import sys

    from meshlm.testing import command_env

    timeout_s = 10.0
    stop_file, run = tmp_path / "stopped_at", tmp_path / "run"
    argv = [str(Path(sys.executable).with_name("meshlm")), "train", "--model.preset=tiny",
            f"--data.path={corpus_dir}", f"--data.cache_dir={cache_dir}",
            "--data.vocab_size=512", "--data.seq_len=32", "--train.global_batch=8",
            "--train.micro_batch=4", "--train.eval_every=0", "--run.sample_tokens=0",
            "--train.peak_flops=1e10", "--parallel.dp=2", "--parallel.tp=2",
            "--train.steps=200", f"--run.dir={run}", f"--distributed.timeout_s={timeout_s}"]
    env = command_env({nccl_semantics.ENV: "1", "MESHLM_FAULT_STOP_AT_STEP": "3",
                       "MESHLM_FAULT_STOP_FILE": str(stop_file)})
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert proc.returncode == 1, proc.stderr
    # when a monitor fired (its flight dump), not when the processes were gone: the teardown
    # after it is the machine's, slow when it is loaded
    fired = min(p.stat().st_mtime for p in (run / "flight").glob("rank_0000[012].json"))
    assert fired - float(stop_file.read_text()) < 2 * timeout_s, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("meshlm: error: stalled rank 3 (pp 0, dp 1, cp 0, tp 1; process "
                           "stopped): last collective "), proc.stderr
    assert str(run / "flight") in line
    assert "gave up on a collective" not in proc.stderr  # train()'s handler never ran
    assert any((run / "flight").glob("rank_0000[012].json")), "a monitor dumped its ring"
