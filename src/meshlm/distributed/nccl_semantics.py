"""NCCL-semantics mode: gloo on CPU, behaving as NCCL does where the two differ.

gloo forgives what NCCL does not, so a layout that passes every CPU test can still crash or hang
at its first step on GPUs. With ``MESHLM_NCCL_SEMANTICS=1`` (tests, ``benchmarks/multi_gpu.py
--nccl-semantics``) :class:`~meshlm.distributed.comm.Comm` keeps running gloo but follows NCCL's
rules (DESIGN.md, principle 9):

- **One handle per batched point-to-point group.** ``batch_isend_irecv`` gives one work for the
  whole group, as NCCL's coalesced group does (gloo: one per operation).
- **A group completes only when all of its operations are matched, and a rank's groups run one
  after another.** gloo runs every posted operation at once, so a later group's receive can
  match while an earlier group's send still waits; NCCL does not start a rank's next group
  before the last one completed. Here each rank's groups go to one thread (:class:`P2PStream`,
  the communication stream): it posts a group's sends and receives, waits for all of them, then
  takes the next group. A send completes only once the peer has *started* the group holding
  the matching receive -- the receiver acknowledges each receive when its group starts (a
  one-element message with its own tag), whatever the transport buffers. A schedule whose groups
  deadlock on NCCL then deadlocks here too, and fails at the collective timeout.
- **Collectives return before they complete.** A rank cannot learn completion from a call
  returning (NCCL only queues the kernel): the flight recorder's completion times come from the
  work handles, polled by the stall monitor (:mod:`meshlm.distributed.stall`), as on CUDA.
- **A collective that times out aborts the process** (NCCL's watchdog tears it down; nothing
  of the training loop's error handling runs): SIGABRT, after one line on stderr.
- **Every tensor handed to a collective is contiguous and on the rank's device**, else a
  ValueError at the call (NCCL would fail or read the wrong memory).

Communication: each point-to-point message gets a one-element acknowledgement the other way.
Memory: the acknowledgements; one thread per rank.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

ENV = "MESHLM_NCCL_SEMANTICS"
DATA_TAG, ACK_TAG = 0, 7  # point-to-point tags: the messages and their acknowledgements


def enabled() -> bool:
    """Whether this process runs in NCCL-semantics mode (``MESHLM_NCCL_SEMANTICS=1``)."""
    return os.environ.get(ENV, "").strip() not in ("", "0", "false", "no")


def check_tensor(t: torch.Tensor, device: torch.device, what: str) -> None:
    """NCCL's demands on a collective's tensor: contiguous, on the rank's device."""
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensor of shape {tuple(t.shape)} is not contiguous "
                         "(NCCL reads its storage as if it were)")
    if t.device.type != device.type:
        raise ValueError(f"{what}: tensor on {t.device}, but this rank's device is {device} "
                         "(NCCL moves device memory only)")


def watchdog_abort(what: str, exc: BaseException) -> None:
    """What NCCL's watchdog does to a process whose collective timed out: end it, at once."""
    print(f"meshlm: NCCL-semantics watchdog: {what} failed ({type(exc).__name__}: "
          f"{str(exc).splitlines()[0] if str(exc) else ''}); aborting the process",
          file=sys.stderr, flush=True)
    os.abort()


class GroupWork:
    """The one handle of a point-to-point group run by a :class:`P2PStream`."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._done.wait(None if timeout is None else timeout.total_seconds())
        if self.error is not None:
            watchdog_abort("a point-to-point group", self.error)
        return True


Op = tuple[str, torch.Tensor, int, dist.ProcessGroup | None]  # (send|recv, tensor, global peer, group)


class P2PStream:
    """One rank's point-to-point groups, run one after another on a thread (see module doc)."""

    def __init__(self, timeout_s: Callable[[], float]) -> None:
        self.timeout_s = timeout_s
        self._queue: queue.Queue[tuple[list[Op], GroupWork] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="meshlm-p2p-stream", daemon=True)
        self._thread.start()

    def submit(self, ops: list[Op]) -> GroupWork:
        work = GroupWork()
        self._queue.put((ops, work))
        return work

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            ops, work = item
            try:
                self._group(ops)
            except BaseException as exc:  # noqa: BLE001 (handed to the waiter)
                work.finish(exc)
            else:
                work.finish()

    def _group(self, ops: list[Op]) -> None:
        """Post the group and wait until every operation in it is matched."""
        works = []
        for kind, t, peer, group in ops:
            ack = torch.zeros(1)
            if kind == "recv":
                works.append(dist.irecv(t, peer, group=group, tag=DATA_TAG))
                works.append(dist.isend(ack, peer, group=group, tag=ACK_TAG))  # "started"
            else:
                works.append(dist.isend(t, peer, group=group, tag=DATA_TAG))
                works.append(dist.irecv(ack, peer, group=group, tag=ACK_TAG))
        timeout = timedelta(seconds=self.timeout_s())
        for w in works:
            w.wait(timeout)
