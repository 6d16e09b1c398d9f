"""Two lanes of work on one rank that take turns, so one lane's collective is in flight while
the other computes: DualPipeV's overlapped forward + backward pair (DeepSeek-V3 sec. 3.2.1).

:func:`run_pair` runs a forward (the calling thread, lane ``F``) and a backward (a second thread,
lane ``B``) of two different micro-batches and stages. Exactly one lane runs at a time: a lane
runs until it has issued an asynchronous collective and reaches :func:`wait` for it, hands the
turn to the other lane, and takes the turn back before it waits for its own collective -- by
then the other lane's computation has covered (part of) the transfer. A lane that has finished
hands the turn over for good. Expert parallelism's dispatch and combine all-to-alls
(``expert.py``, forward and backward) are the collectives that pass the turn.

Because one lane runs at a time and the turn passes only at those points, every rank with the
same pipeline position (all ranks of an ep, tp, dp or cp group) issues its collectives in the
same order -- the order NCCL and gloo both need -- and Python state that a pass sets and reads
is never touched by the other lane in between, except where a pass holds it across its own
all-to-all (the zero-bubble capture list: kept per thread by the executor). Numerics are those
of the two passes run one after the other.

On CPU the overlap comes from gloo's background threads carrying an issued all-to-all while the
other lane computes. On CUDA (a GPU-only path, not run on CPU) both lanes launch on the same
stream; an issued NCCL all-to-all runs on NCCL's stream, and waiting for its handle makes the
compute stream wait -- launches alternate as here, kernels overlap.

:data:`EXPOSED` measures what overlap is for: the seconds a rank's host waited for its
expert all-to-alls after issuing them, with no other lane left to run (the exposed all-to-all
time; without a pair, every all-to-all's whole wait). No communication or memory of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Exposed:
    """Seconds the host spent waiting for issued all-to-alls (and how many), since reset."""

    seconds: float = 0.0
    count: int = 0

    def reset(self) -> None:
        self.seconds, self.count = 0.0, 0


EXPOSED = Exposed()


class _Lanes:
    """The turn between lane ``F`` and lane ``B``."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.turn = "F"
        self.done: set[str] = set()

    @staticmethod
    def other(lane: str) -> str:
        return "B" if lane == "F" else "F"

    def switch(self, lane: str) -> None:
        """Hand the turn to the other lane (if it still runs) and wait to get it back."""
        with self.cond:
            if self.other(lane) in self.done:
                return
            self.turn = self.other(lane)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == lane)

    def take(self, lane: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == lane)

    def finish(self, lane: str) -> None:
        with self.cond:
            self.done.add(lane)
            self.turn = self.other(lane)
            self.cond.notify_all()


# The pair running now. One lane runs at a time, so the caller of :func:`wait` is the lane
# whose turn it is -- also when autograd runs a backward on its own device thread (CUDA)
# on the lane's behalf.
_active: _Lanes | None = None


def in_pair() -> bool:
    """Whether an overlapped pair runs now."""
    return _active is not None


def wait(handle: object) -> None:
    """Wait for an issued collective's ``handle`` (anything with ``wait()``); inside a pair,
    first let the other lane run until it waits for a collective of its own or finishes."""
    lanes = _active
    if lanes is not None:
        lanes.switch(lanes.turn)
    t0 = time.perf_counter()
    handle.wait()  # type: ignore[attr-defined]
    EXPOSED.seconds += time.perf_counter() - t0
    EXPOSED.count += 1


def run_pair(forward: Callable[[], None], backward: Callable[[], None],
             backward_setup: Callable[[], None] | None = None) -> None:
    """Run ``forward`` here and ``backward`` in a second thread, taking turns (module doc).

    ``backward_setup`` runs first in the backward's thread (thread-local state its pass needs:
    the executor's CUDA device and stream). An exception in either lane ends that lane,
    lets the other finish, and is raised here (the backward's first).
    """
    global _active
    if _active is not None:
        raise RuntimeError("an overlapped pair is already running")
    lanes = _Lanes()
    errors: list[BaseException] = []

    def lane_b() -> None:
        lanes.take("B")
        try:
            if backward_setup is not None:
                backward_setup()
            backward()
        except BaseException as exc:  # (re-raised by the caller's thread)
            if not hasattr(exc, "meshlm_phase"):
                exc.meshlm_phase = "backward"  # type: ignore[attr-defined]
            errors.append(exc)
        finally:
            lanes.finish("B")

    thread = threading.Thread(target=lane_b, name="meshlm-overlap-backward", daemon=True)
    thread.start()  # (it waits for its turn)
    _active = lanes
    try:
        forward()
    finally:
        lanes.finish("F")
        thread.join()
        _active = None
    if errors:
        raise errors[0]
