"""Point-to-point groups and communicator order in NCCL-semantics mode
(:mod:`meshlm.distributed.nccl_semantics` states the rules; this module runs them on gloo).

- :class:`Ledger`, one per process: per communicator (process group, by name) the collectives
  this rank issued there, its last ``HISTORY`` operations, and its messages posted per peer and
  direction. ``Comm`` enters each collective when it issues it and each group when it posts it.
- :class:`P2PStream`, one per ``Comm``: a thread that runs the rank's groups one after another.
  For each message it posts the data, this side's header (:data:`HEADER_LEN` int64: the message's
  index on the pair, the collectives issued on the communicator before the group, dtype, shape,
  label, the last operations) and a receive for the other side's. The receiver's header goes
  back as soon as its group starts, so a send completes only once the peer has *started* the
  group holding the matching receive, whatever the transport buffers. The thread first waits for
  the headers and compares both sides' (a difference raises on both ranks without waiting for
  data that may never match), then for the data.
- :class:`GroupWork`, the group's one handle: its wait raises what the headers showed, or, after
  completion, names a send tensor changed since it was posted (a copy is kept until then).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .nccl_semantics import THROUGH_COMM, NcclSemanticsError, watchdog_abort

DATA_TAG, SENT_TAG, ACK_TAG = 0, 6, 7  # tags: data, the sender's header, the receiver's header
HISTORY, MAX_DIMS = 4, 8
SEQ, COLLECTIVES, DTYPE, NDIM, LABEL = range(5)
SHAPE = 5
LAST = SHAPE + MAX_DIMS
HEADER_LEN = LAST + HISTORY
KINDS = ("", "p2p", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
         "broadcast_object", "barrier", "collective")
DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)


@dataclass
class _Communicator:
    collectives: int = 0
    last: deque[int] = field(default_factory=lambda: deque(maxlen=HISTORY))
    posted: dict[tuple[str, int], int] = field(default_factory=dict)  # (kind, peer) -> count


@dataclass
class Message:
    """One send or receive of a group, with this side's header (and a send's copy)."""

    kind: str  # "send" | "recv"
    tensor: torch.Tensor
    peer: int  # global rank
    group: dist.ProcessGroup | None
    axis: str
    header: torch.Tensor
    copy: torch.Tensor | None = None


class Ledger:
    """What this process issued on each communicator (see module docstring)."""

    def __init__(self) -> None:
        self._comms: dict[str, _Communicator] = {}

    def _of(self, group: dist.ProcessGroup | None) -> _Communicator:
        name = (group if group is not None else dist.group.WORLD).group_name
        if (c := self._comms.get(name)) is None:
            c = self._comms[name] = _Communicator()
        return c

    def collective(self, group: dist.ProcessGroup | None, op: str) -> None:
        c = self._of(group)
        c.collectives += 1
        c.last.append(KINDS.index(op) if op in KINDS else KINDS.index("collective"))

    def post(self, group: dist.ProcessGroup | None, axis: str,
             ops: list[tuple[str, torch.Tensor, int, int]]) -> list[Message]:
        """The messages of a group of ``(kind, tensor, global peer, label or -1)``, each with
        this side's header; sends with a copy of their tensor."""
        c = self._of(group)
        c.last.append(KINDS.index("p2p"))
        last = [0] * (HISTORY - len(c.last)) + list(c.last)
        out = []
        for kind, t, peer, label in ops:
            seq = c.posted.get((kind, peer), 0)
            c.posted[(kind, peer)] = seq + 1
            header = torch.tensor([seq, c.collectives, DTYPES.index(t.dtype), t.dim(), label,
                                   *_shape_slots(t.shape), *last], dtype=torch.int64)
            out.append(Message(kind, t, peer, group, axis, header,
                               t.detach().clone() if kind == "send" else None))
        return out


def _shape_slots(shape: torch.Size) -> list[int]:
    """``MAX_DIMS`` numbers for a shape: its sizes (the trailing ones folded into the last slot
    beyond ``MAX_DIMS`` dimensions), padded with -1."""
    dims = list(shape)
    if len(dims) > MAX_DIMS:
        rest = 1
        for d in dims[MAX_DIMS - 1:]:
            rest *= d
        dims = dims[:MAX_DIMS - 1] + [rest]
    return dims + [-1] * (MAX_DIMS - len(dims))


def _describe(h: list[int]) -> str:
    dims = h[SHAPE:SHAPE + min(h[NDIM], MAX_DIMS)]
    label = f", label {h[LABEL]}" if h[LABEL] >= 0 else ""
    return f"{str(DTYPES[h[DTYPE]]).removeprefix('torch.')} {dims}{label}"


def _last(h: list[int]) -> str:
    return ", ".join(KINDS[k] for k in h[LAST:] if k) or "none"


ORDER = ("NCCL runs a communicator's work in the order issued, so each rank's group would wait "
         "behind work the other queued after it (a deadlock on GPUs): issue a communicator's "
         "collectives and groups in the same order on every rank")
MATCHING = ("NCCL matches a pair's messages in posting order, by count, not by tag or shape: "
            "they were posted in another order, or into a wrong buffer")


def problems(m: Message, theirs: list[int], me: int) -> list[tuple[str, str]]:
    """What NCCL would get wrong about message ``m``, given the other side's header:
    (what happened, why it matters) pairs."""
    mine = m.header.tolist()
    sender, receiver = (me, m.peer) if m.kind == "send" else (m.peer, me)
    sent, received = (mine, theirs) if m.kind == "send" else (theirs, mine)
    out = []
    if mine[COLLECTIVES] != theirs[COLLECTIVES]:
        out.append((f"point-to-point group on {m.axis} out of order with that communicator's "
                    f"collectives: rank {me} issued it after {mine[COLLECTIVES]} collectives "
                    f"there (its last operations there: {_last(mine)}), rank {m.peer} after "
                    f"{theirs[COLLECTIVES]} ({_last(theirs)})", ORDER))
    what = f"rank {receiver}'s receive #{received[SEQ]} from rank {sender} on {m.axis}"
    if sent[SEQ] != received[SEQ]:
        out.append((f"{what} matched rank {sender}'s send #{sent[SEQ]}", MATCHING))
    elif (sent[DTYPE:NDIM + 1] != received[DTYPE:NDIM + 1]
          or sent[SHAPE:LAST] != received[SHAPE:LAST]
          or min(sent[LABEL], received[LABEL]) >= 0 and sent[LABEL] != received[LABEL]):
        out.append((f"{what} is {_describe(received)}, but rank {sender}'s send #{sent[SEQ]} is "
                    f"{_describe(sent)}", MATCHING))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (NaNs included), compared in the widest words the two allow."""
    x, y = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    for word in (torch.int64, torch.int32):
        n = word.itemsize
        if x.numel() % n == 0 and x.storage_offset() % n == 0 and y.storage_offset() % n == 0:
            return torch.equal(x.view(word), y.view(word))
    return torch.equal(x, y)


class GroupWork:
    """The one handle of a point-to-point group run by a :class:`P2PStream`."""

    def __init__(self, messages: list[Message]) -> None:
        self._done = threading.Event()
        self._sends = [m for m in messages if m.copy is not None]
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._done.wait(None if timeout is None else timeout.total_seconds())
        if isinstance(self.error, NcclSemanticsError):
            raise self.error
        if self.error is not None:
            watchdog_abort("a point-to-point group", self.error)
        sends, self._sends = self._sends, []  # (the copies go)
        changed = [m for m in sends if not same_bytes(m.tensor, m.copy)]
        if changed:
            raise NcclSemanticsError("; ".join(
                f"send #{int(m.header[SEQ])} to rank {m.peer} on {m.axis} "
                f"({_describe(m.header.tolist())}) changed between posting and the wait on its "
                "group's handle: NCCL reads a send buffer until the group completes, so the "
                "peer may get either value" for m in changed))
        return True


class P2PStream:
    """One rank's point-to-point groups, run one after another on a thread (see module doc)."""

    def __init__(self, timeout_s: Callable[[], float], rank: int) -> None:
        self.timeout_s, self.rank = timeout_s, rank
        self._queue: queue.Queue[tuple[list[Message], GroupWork] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="meshlm-p2p-stream", daemon=True)
        self._thread.start()

    def submit(self, messages: list[Message]) -> GroupWork:
        work = GroupWork(messages)
        self._queue.put((messages, work))
        return work

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        with THROUGH_COMM:  # (this thread is Comm's)
            while (item := self._queue.get()) is not None:
                messages, work = item
                try:
                    self._group(messages)
                except BaseException as exc:  # noqa: BLE001 (handed to the waiter)
                    work.finish(exc)
                else:
                    work.finish()

    def _group(self, messages: list[Message]) -> None:
        """Post the group, check both sides' headers, wait until every operation is matched."""
        works, headers = [], []
        for m in messages:
            theirs = torch.empty(HEADER_LEN, dtype=torch.int64)
            send = m.kind == "send"
            op = dist.isend if send else dist.irecv
            works.append(op(m.tensor, m.peer, group=m.group, tag=DATA_TAG))
            works.append(dist.isend(m.header, m.peer, group=m.group,
                                    tag=SENT_TAG if send else ACK_TAG))
            headers.append((dist.irecv(theirs, m.peer, group=m.group,
                                       tag=ACK_TAG if send else SENT_TAG), theirs))
        timeout = timedelta(seconds=self.timeout_s())
        found: list[tuple[str, str]] = []
        for m, (w, theirs) in zip(messages, headers, strict=True):
            w.wait(timeout)
            found += problems(m, theirs.tolist(), self.rank)
        if found:
            facts, whys = (dict.fromkeys(x) for x in zip(*found, strict=True))
            raise NcclSemanticsError(f"{'; '.join(facts)} -- {'; '.join(whys)}")
        for w in works:
            w.wait(timeout)


LEDGER = Ledger()  # this process's (communicators are shared by every Comm of a process)
