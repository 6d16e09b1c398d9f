"""Every collective meshlm issues, over a mesh axis, with an optional communication log.

Collectives are c10d's (gloo on CPU, NCCL on GPU); this module adds nothing to the transport.
It resolves an axis name ("dp", "tp", "pp", "cp", "dp_cp", "ep", "edp", "world") to the mesh's process group,
short-circuits axes of size 1 (no communication at all), and can record each call as
``(op, axis, dtype, bytes)`` so tests and the trainer can compare volume with theory.

Byte convention: ``bytes`` is the size of the *full* buffer the collective is about --
the tensor of an all-reduce, the input of a reduce-scatter, the output of an all-gather, the
input of an all-to-all, the tensor of a send or receive --
the number the ZeRO paper and the Ultra-Scale Playbook use when they count volume
(the wire traffic per rank of a ring implementation is ``(n-1)/n`` of it, twice for all-reduce).

Profiler labels: while a torch profiler records (``profile.steps``), each collective is a named
range ``meshlm.OP[AXIS]`` (``meshlm.all_reduce[dp_cp]``, ``meshlm.p2p[pp]`` ...) in the trace; for
an asynchronous one the range covers issuing it, the wait shows where the caller waits.
Otherwise the label costs one flag check.

Flight recorder: with ``Comm.flight`` set (the trainer sets it), every collective is also
entered into this rank's ring (:mod:`meshlm.distributed.flight`) -- op, axis, bytes, sequence
numbers, entry and completion times -- so a timeout can name the rank the others waited for.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.autograd.profiler as autograd_profiler
import torch.distributed as dist

from . import nccl_p2p, nccl_semantics
from .flight import FlightRecorder
from .mesh import Mesh
from .stall import StallMonitor

# torch 2.13 renamed the tensor collectives; keep working with older releases too.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommRecord:
    op: str
    axis: str
    dtype: str
    bytes: int
    time: float  # time.perf_counter() when the collective was issued
    purpose: str = "train"  # "train" (gradients, parameters), "metrics" or "state" (checkpoints)


@dataclass
class CommLog:
    """Recorded collectives; ``enabled`` can be switched around the region of interest."""

    enabled: bool = True
    records: list[CommRecord] = field(default_factory=list)

    def add(self, op: str, axis: str, t: torch.Tensor, purpose: str = "train") -> None:
        if self.enabled:
            self.records.append(CommRecord(
                op, axis, str(t.dtype).removeprefix("torch."), t.numel() * t.element_size(),
                time.perf_counter(), purpose))

    def bytes_by_op(self, purpose: str = "train") -> dict[str, int]:
        """Total bytes per ``"op/axis"`` since the last reset."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            if r.purpose == purpose:
                out[f"{r.op}/{r.axis}"] += r.bytes
        return dict(out)

    def count(self, op: str, axis: str | None = None, purpose: str = "train") -> int:
        return sum(1 for r in self.records if r.op == op and r.purpose == purpose
                   and (axis is None or r.axis == axis))

    def reset(self) -> None:
        self.records.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _label(op: str, axis: str) -> contextlib.AbstractContextManager:
    """``meshlm.OP[AXIS]`` in a running profiler's trace; nothing (one flag check) otherwise."""
    if autograd_profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"meshlm.{op}[{axis}]")
    return contextlib.nullcontext()


class _Done:
    """Handle of a collective that needed no communication (axis of size 1)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Tracked:
    """An asynchronous collective's handle (one work, or every work of a point-to-point group:
    one handle per group, as NCCL gives): counts the time its waiter spends blocked
    (:attr:`Comm.wait_s`) and, where waiting means completion (gloo), marks its flight records
    completed; elsewhere the stall monitor reads completion from the works."""

    def __init__(self, works: list, comm: Comm, slots: list[tuple[int, int]]) -> None:
        self.works, self.comm, self.slots = works, comm, slots
        self.waited = False

    def wait(self) -> bool:
        """Wait for every work of the handle; a second wait returns at once (a gloo receive
        waited twice would wait for another message)."""
        if self.waited:
            return True
        self.waited = True
        t0 = time.perf_counter()
        try:
            for w in self.works:
                w.wait()
        except nccl_semantics.NcclSemanticsError:
            raise
        except Exception as exc:
            if self.comm.nccl_rules:
                nccl_semantics.watchdog_abort("a collective", exc)
            raise
        self.comm.wait_s += time.perf_counter() - t0
        if self.comm.completes_on_return and self.comm.flight is not None:
            for slot, seq in self.slots:
                self.comm.flight.done(slot, seq)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


Handle = dist.Work | _Done | _Tracked
# a point-to-point operation: ("send" | "recv", tensor, peer index on the axis[, label])
P2PSpec = tuple[str, torch.Tensor, int] | tuple[str, torch.Tensor, int, int]


class Comm:
    """Collectives of one rank over the axes of its :class:`Mesh`.

    ``nccl_rules``: NCCL-semantics mode (:mod:`meshlm.distributed.nccl_semantics`). With a
    ``monitor`` (:mod:`meshlm.distributed.stall`; CUDA and NCCL-semantics mode) every collective
    is issued with a handle the monitor polls for completion.
    """

    def __init__(self, mesh: Mesh, log: CommLog | None = None) -> None:
        self.mesh = mesh
        self.log = log if log is not None else CommLog(enabled=False)
        self.flight: FlightRecorder | None = None
        self.monitor: StallMonitor | None = None
        self.nccl_rules = nccl_semantics.enabled() and mesh.distributed
        if self.nccl_rules:
            nccl_semantics.install_guard()
        self._stream: nccl_p2p.P2PStream | None = None
        # seconds this rank's host spent blocked in collectives (synchronous calls and waits on
        # handles) since the trainer last set it to 0: the "waiting" of straggler detection
        self.wait_s = 0.0

    @property
    def completes_on_return(self) -> bool:
        """Whether a collective that returned (or a handle that was waited) has completed:
        gloo's semantics; not NCCL's, where it has only been queued."""
        return self.mesh.device_type != "cuda" and not self.nccl_rules

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        if self.nccl_rules:
            for t in tensors:
                nccl_semantics.check_tensor(t, self.mesh.device(), op)

    def _enter(self, op: str, axis: str, nbytes: int, async_op: bool) -> tuple[int, int]:
        if self.flight is None:
            return -1, -1
        slot = self.flight.enter(op, axis, nbytes, async_op)
        return slot, self.flight.seq

    def _run(self, op: str, axis: str, nbytes: int, async_op: bool,
             call: Callable[[bool], dist.Work | None]) -> Handle:
        """Issue ``call(async_op)`` (a c10d collective) under its profiler label and flight
        record; with a stall monitor always asynchronously, the monitor keeping the handle."""
        slot, seq = self._enter(op, axis, nbytes, async_op)
        monitor = self.monitor if slot >= 0 else None
        if self.nccl_rules:
            nccl_p2p.LEDGER.collective(self.mesh.group(axis), op)
        t0 = time.perf_counter()
        with _label(op, axis), nccl_semantics.THROUGH_COMM:
            work = call(async_op or monitor is not None or self.nccl_rules)
        if work is None:  # (an operation without an asynchronous form)
            self.wait_s += time.perf_counter() - t0
            if slot >= 0:
                self.flight.done(slot, seq)
            return _Done()
        if monitor is not None:
            monitor.track(slot, seq, work)
        handle = _Tracked([work], self, [(slot, seq)] if slot >= 0 else [])
        if async_op:
            return handle
        handle.wait()  # NCCL: the stream waits; gloo: the data is here
        return _Done()

    def size(self, axis: str) -> int:
        return self.mesh.size(axis)

    def rank(self, axis: str) -> int:
        return self.mesh.local_rank(axis)

    def all_reduce(self, t: torch.Tensor, axis: str, op: str = "sum",
                   async_op: bool = False, purpose: str = "train") -> Handle:
        """In-place reduction of ``t`` over ``axis`` (``op``: sum or max)."""
        if self.size(axis) == 1:
            return _Done()
        self.log.add("all_reduce", axis, t, purpose)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        self._check("all_reduce", t)
        return self._run("all_reduce", axis, _nbytes(t), async_op, lambda a: dist.all_reduce(
            t, red, group=self.mesh.group(axis), async_op=a))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, axis: str,
                       async_op: bool = False) -> Handle:
        """``out`` = this rank's 1/n slice of the sum of ``inp`` over ``axis``."""
        if self.size(axis) == 1:
            out.copy_(inp)
            return _Done()
        self.log.add("reduce_scatter", axis, inp)
        self._check("reduce_scatter", out, inp)
        return self._run("reduce_scatter", axis, _nbytes(inp), async_op, lambda a: _reduce_scatter(
            out, inp, group=self.mesh.group(axis), async_op=a))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, axis: str,
                   async_op: bool = False) -> Handle:
        """``out`` = concatenation of every rank's ``inp`` along dim 0, in axis order."""
        if self.size(axis) == 1:
            out.copy_(inp)
            return _Done()
        self.log.add("all_gather", axis, out)
        self._check("all_gather", out, inp)
        return self._run("all_gather", axis, _nbytes(out), async_op, lambda a: _all_gather(
            out, inp, group=self.mesh.group(axis), async_op=a))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, axis: str,
                   out_splits: list[int] | None = None, in_splits: list[int] | None = None,
                   async_op: bool = False) -> Handle:
        """Block j of ``inp`` (dim 0 split in equal blocks, or ``in_splits`` rows) goes to rank
        j; ``out``'s block j (equal, or ``out_splits`` rows) comes from rank j."""
        if self.size(axis) == 1:
            out.copy_(inp)
            return _Done()
        self.log.add("all_to_all", axis, inp)
        self._check("all_to_all", out, inp)
        return self._run("all_to_all", axis, _nbytes(inp), async_op,
                         lambda a: dist.all_to_all_single(out, inp, out_splits, in_splits,
                                                          group=self.mesh.group(axis),
                                                          async_op=a))

    def broadcast(self, t: torch.Tensor, axis: str, src: int = 0) -> None:
        """Copy ``t`` from the rank with index ``src`` along ``axis`` to the others."""
        if self.size(axis) == 1:
            return
        self.log.add("broadcast", axis, t)
        group = self.mesh.group(axis)
        self._check("broadcast", t)
        self._run("broadcast", axis, _nbytes(t), False, lambda a: dist.broadcast(
            t, dist.get_global_rank(group, src), group=group, async_op=a))

    def reduce_scalars(self, values: list[float], axis: str = "world", op: str = "sum") -> list[float]:
        """Sum or max of Python numbers over ``axis``; logged with purpose "metrics"."""
        if self.size(axis) == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.mesh.device())
        self.log.add("all_reduce", axis, t, purpose="metrics")
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        self._run("all_reduce", axis, _nbytes(t), False, lambda a: dist.all_reduce(
            t, red, group=self.mesh.group(axis), async_op=a))
        return [float(x) for x in t.tolist()]

    def batch_p2p(self, ops: list[P2PSpec], axis: str) -> Handle:
        """Post ("send" | "recv", tensor, peer index on ``axis``[, label]) ops as one group; its
        one handle (NCCL's semantics on every backend: wait for the group, not an operation).
        Every tensor must stay alive and untouched until the handle has been waited. A label
        (an int >= 0 naming the message, the same on both sides) lets NCCL-semantics mode tell
        a receive that matched another message of the same shape."""
        group = self.mesh.group(axis)
        entered, plain = [], []
        for kind, t, peer, *label in ops:
            self.log.add(kind, axis, t)
            self._check(kind, t)
            slot, seq = self._enter(kind, axis, _nbytes(t), True)
            if slot >= 0:
                entered.append((slot, seq))
            plain.append((kind, t, dist.get_global_rank(group, peer), label[0] if label else -1))
        with _label("p2p", axis), nccl_semantics.THROUGH_COMM:
            if self.nccl_rules:
                if self._stream is None:
                    self._stream = nccl_p2p.P2PStream(self.collective_timeout_s, self.mesh.rank)
                works = [self._stream.submit(nccl_p2p.LEDGER.post(group, axis, plain))]
            else:  # NCCL: one work; gloo: one per operation
                works = list(dist.batch_isend_irecv([
                    dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, rank, group=group)
                    for kind, t, rank, _ in plain]))
        handle = _Tracked(works, self, entered)
        if self.monitor is not None:
            for slot, seq in entered:
                self.monitor.track(slot, seq, handle)
        return handle

    def build_embed_group(self) -> None:
        """The mesh's embedding group (collective: :meth:`Mesh.build_embed_group`), with the
        flight recorder told of it."""
        self.mesh.build_embed_group()
        if self.flight is not None:
            self.flight.set_groups(self.mesh.group_ranks())

    def close(self) -> None:
        """End the NCCL-semantics point-to-point stream (if one was started)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def collective_timeout_s(self) -> float:
        """The collective timeout of this rank's default group (seconds)."""
        from torch.distributed.distributed_c10d import _get_default_group

        try:
            backend = _get_default_group()._get_backend(self.mesh.device())
            return backend.options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            return 300.0

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """``obj`` of world rank ``src`` on every rank (start-up decisions, not training)."""
        if not self.mesh.distributed:
            return obj
        box = [obj]
        self._run("broadcast_object", "world", 0, False,
                  lambda a: dist.broadcast_object_list(box, src=src))
        return box[0]

    def max_scalar(self, value: float, axis: str = "world") -> float:
        return self.reduce_scalars([value], axis, "max")[0]

    def barrier(self) -> None:
        if self.mesh.distributed:
            self._run("barrier", "world", 0, False, lambda a: dist.barrier(async_op=a))
