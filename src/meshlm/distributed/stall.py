"""Stall monitor: reads collectives' completion from their work handles and names a stalled rank
where the rank's own error handling never runs.

On NCCL a collective returns once queued: the call returning says nothing about completion, a
peer that stalls surfaces later at some synchronisation (a loss read, a metrics reduction), and
NCCL's watchdog then aborts the process -- ``train()``'s handler never runs, and the launcher
would name whichever rank aborted first. So on CUDA (and in NCCL-semantics mode,
:mod:`meshlm.distributed.nccl_semantics`) :class:`~meshlm.distributed.comm.Comm` hands every
collective's work handle to this monitor instead of marking its flight record done itself. A
thread polls the pending handles (``work.is_completed()``: on CUDA an event query), writes each
completion time into the flight recorder, and when the oldest pending collective has waited
``timeout_s`` it dumps this rank's ring, reads every rank's ring and -- with
:func:`~meshlm.distributed.flight.diagnose` -- names the stalled rank, its coordinates and its
last collective: one line on stderr and in the worker's error file (``CollectiveFailure: ...``,
what the launcher reports), then the process exits (status 1) before the process group's own
timeout (set to twice as long) would abort it. The verdict is therefore out within
``timeout_s`` plus one poll. One verdict is shared: the first monitor to fire claims it
(``verdict.claim``, created exclusively) and writes ``verdict.txt`` in the flight folder;
monitors that fire later wait for it and repeat it rather than name a rank whose monitor has
already exited.

Communication: none. Memory: a reference to each pending work until it is seen completed (at
most ``poll_s`` after it completes); one thread.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .flight import FlightRecorder, diagnose


def write_error_file(message: str) -> None:
    """Write ``CollectiveFailure: message`` where torchelastic reads a worker's error
    (``TORCHELASTIC_ERROR_FILE``; nothing without one), in its format."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"CollectiveFailure: {message}",
                        "extraInfo": {"py_callstack": "(stall monitor)", "timestamp": str(int(time.time()))}}}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _exit_with(message: str) -> None:
    write_error_file(message)
    print(f"meshlm: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


class StallMonitor:
    """Polls pending collectives of one rank (see the module docstring)."""

    def __init__(self, flight: FlightRecorder, world: int, timeout_s: float,
                 poll_s: float | None = None,
                 on_stall: Callable[[str], None] = _exit_with) -> None:
        self.flight, self.world, self.timeout_s = flight, world, timeout_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.05, timeout_s / 20))
        self.on_stall = on_stall
        self._pending: dict[int, tuple[int, Any, float]] = {}  # seq -> (slot, work, entered)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.fired: str | None = None
        self.started = time.time()  # (verdicts of an earlier run in this folder are older)
        self._thread = threading.Thread(target=self._run, name="meshlm-stall-monitor",
                                        daemon=True)
        self._thread.start()

    def track(self, slot: int, seq: int, work: Any) -> None:
        """Collective number ``seq`` (flight ``slot``), complete when ``work.is_completed()``."""
        with self._lock:
            self._pending[seq] = (slot, work, time.time())

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def poll(self) -> None:
        """Mark completed collectives done; fire once the oldest pending is ``timeout_s`` old."""
        with self._lock:
            items = list(self._pending.items())
        oldest = None
        for seq, (slot, work, entered) in items:
            if work.is_completed():
                self.flight.done(slot, seq)
                with self._lock:
                    self._pending.pop(seq, None)
            elif oldest is None or entered < oldest:
                oldest = entered
        if oldest is not None and time.time() - oldest > self.timeout_s and self.fired is None:
            self.flight.dump(f"a collective pending for more than {self.timeout_s:g} s")
            self.fired = self.verdict()
            self.on_stall(self.fired)

    def verdict(self) -> str:
        """The run's one verdict. The first monitor to fire claims it (``verdict.claim``,
        created exclusively), diagnoses and writes ``verdict.txt``; monitors that fire after it
        wait for that file and repeat it, so a rank whose monitor already exited is never named
        as "gone" by another. A claim or verdict older than this monitor belongs to an earlier
        run in the same folder and is replaced."""
        folder = self.flight.folder
        claim, final = folder / "verdict.claim", folder / "verdict.txt"
        if self._claim(claim):
            text = diagnose(folder, self.world)
            tmp = folder / f"verdict.{self.flight.rank:05d}.tmp"
            tmp.write_text(text)
            tmp.replace(final)
            return text
        deadline = time.time() + max(5.0, self.timeout_s)  # the claimer is diagnosing
        while time.time() < deadline:
            if self._fresh(final):
                return final.read_text()
            time.sleep(0.05)
        return diagnose(folder, self.world)  # the claimer died before writing: diagnose alone

    def _fresh(self, path: Path) -> bool:
        try:
            return path.stat().st_mtime >= self.started
        except OSError:
            return False

    def _claim(self, path: Path) -> bool:
        for _ in range(2):
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return True
            except FileExistsError:
                if self._fresh(path):
                    return False
                path.unlink(missing_ok=True)  # an earlier run's claim
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 (a monitor must not kill training)
                print(f"meshlm: stall monitor: {type(exc).__name__}: {exc}", file=sys.stderr)
