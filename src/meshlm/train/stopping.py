"""Graceful stop: SIGTERM or SIGINT finishes the step, saves a checkpoint and exits 0.

A worker's first SIGTERM/SIGINT only sets a flag; the trainer folds it into the step's metrics
all-reduce (every rank learns that some rank was asked to stop, at the same step), saves a
checkpoint and returns. A second signal, at least :data:`REPEAT_AFTER_S` after the first,
ends the process at once (the default action of that signal). Signals closer together count
once: Ctrl-C in a terminal reaches the launcher and its workers together, and the launcher
also relays it to them.

SLURM sends SIGTERM before a job's time limit (``#SBATCH --signal=TERM@120`` makes it 120 s
before); torchrun relays SIGTERM to its workers and kills them 30 s later.

A rank blocked inside a collective (a peer froze) runs no Python until the collective
returns, so its Python handler could not act on the second signal; the C-level handler still
writes every signal to a wakeup socket (``signal.set_wakeup_fd``), and a watcher thread that
reads it ends the process (exit 128 + signal) when the main thread has not done so within
:data:`BACKSTOP_S` of a second request.

No communication of its own (one float in the trainer's per-step all-reduce); no memory.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from types import FrameType

REPEAT_AFTER_S = 1.0
BACKSTOP_S = 0.5  # the watcher's grace for the main thread's own handler
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """While active (a context manager), SIGTERM/SIGINT request a stop instead of killing."""

    def __init__(self) -> None:
        self.signal: int | None = None  # the first stop signal received
        self._at = 0.0
        self._saved: dict[int, object] = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._old_fd = -1

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signal is None:
            self.signal, self._at = signum, now
            return
        if now - self._at < REPEAT_AFTER_S:
            return  # the same request, delivered twice (terminal + launcher relay)
        signal.signal(signum, signal.SIG_DFL)  # a second request: stop at once
        signal.raise_signal(signum)

    def _watch(self, reader: socket.socket) -> None:
        """Backstop for a main thread stuck in C++ (see module docstring)."""
        first = 0.0
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum not in SIGNALS:
                    continue
                now = time.monotonic()
                if not first:
                    first = now
                elif now - first >= REPEAT_AFTER_S:
                    time.sleep(BACKSTOP_S)  # the main thread's handler goes first when it can
                    print(f"meshlm: {signal.Signals(signum).name} again: stopping at once",
                          file=sys.stderr, flush=True)
                    os._exit(128 + signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._saved[s] = signal.getsignal(s)
                signal.signal(s, self._handle)
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            self._wakeup = (reader, writer)
            self._old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            threading.Thread(target=self._watch, args=(reader,), daemon=True,
                             name="meshlm-stop-watch").start()
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._saved.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._saved.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._old_fd)
            for sock in self._wakeup:
                sock.close()
            self._wakeup = None
