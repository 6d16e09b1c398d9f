"""Asynchronous checkpoints (``checkpoint.async = true``): the step loop goes on while the
previous save is written.

At a save (main thread, every rank): wait for the save in flight, if any (at most one is);
rank 0 makes ``step_NNNNNNN.tmp``; every rank copies what it writes -- its pieces of the
weights and AdamW moments (and DiLoCo's outer state), exactly those of a synchronous save --
into host buffers, captures its RNG states, and hands them to a background thread. The step
loop resumes; the thread writes ``rank_NNNNN.safetensors`` from the copy (flushed), and once
every rank's file is on disk rank 0's thread writes the index, ``trainer.json`` and the other
files and renames the folder (:func:`~.sharded.complete_checkpoint`, as a synchronous save
does). A checkpoint is complete at that rename, and the files are those a synchronous save of
that step writes, byte for byte.

Why a thread, not a process: the host copy is handed over without another copy or shared
memory, and safetensors writes from the tensors' memory with the GIL released (so does
``fsync``), so the thread takes little from the step loop's Python; a process would copy the
shards again (pickling or shared-memory staging) and need process groups of its own.

Why a second process group: the writers agree on "every file is on disk" with collectives,
and gloo / NCCL forbid two threads to run collectives on one group at a time. The background
threads use a gloo group of their own (made once, by every rank, when the saver is built);
the training groups stay the main thread's. Per save the group runs a barrier (the folder
exists), a MIN all-reduce of one flag per rank (every file written; a rank that failed says
so instead of leaving the others waiting) and, after rank 0's rename, a MAX all-reduce of its
flag (every rank then knows the save is complete or failed). Torchtitan's
``checkpoint.async_mode="async"`` uses a side gloo group the same way.

Crash semantics: until the rename the folder is ``.tmp``, which resuming ignores (and the next
save deletes): a kill during the write leaves the previous checkpoint the latest, and
``run.resume=auto`` uses it. ``checkpoint.keep`` prunes after the rename, on the writer
thread: the new checkpoint is then the newest complete one, and the one being written is never
a candidate (``.tmp``). A graceful stop (SIGTERM) and the end of training wait for the save in
flight (:meth:`AsyncSaver.wait`), as does a rollback to the latest checkpoint.

Memory: the host copy is each rank's shards -- 12 bytes per parameter it writes (fp32 weight
+ two moments; 20 on island 0 of DiLoCo) -- kept between saves and reused (the planner's
``checkpoint host copy``). On CUDA (GPU-only path) the buffers are pinned and the copy runs on
a side stream, after the step that wrote the shards; the training stream goes on with the next
forward and backward (which only read the weights) and waits for the copy's event -- on the
device, not on the host -- only before the next optimizer step, which overwrites the weights
and moments (a one-shot step pre-hook of the engine's optimizer). With DiLoCo islands, whose
outer step also writes them outside the optimizer, it waits at once. The host waits for the
event on the writer thread only. On CPU the buffers are ordinary tensors, copied at the save.

Fault injection (tests): ``MESHLM_FAULT_KILL_IN_SAVE=k`` kills the highest rank on the writer
thread after its file of checkpoint k (as in a synchronous save);
``MESHLM_FAULT_SLOW_SAVE="seconds[:k1,k2]"`` makes every writer sleep that long before writing
(every save, or checkpoints k1, k2).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.faults import kill_if_asked
from ..distributed.mesh import Mesh
from ..parallel.engine import Engine
from .sharded import (
    RankContents,
    begin_checkpoint,
    complete_checkpoint,
    is_rng_key,
    rank_contents,
    step_dir,
    write_contents,
)


class SaveError(RuntimeError):
    """An asynchronous save that did not complete (a fault, not a user mistake: the folder
    stays ``.tmp`` and the previous checkpoint is the latest)."""


def slow_if_asked(step: int) -> None:
    """``MESHLM_FAULT_SLOW_SAVE="seconds[:k1,k2]"``: the writer sleeps before writing."""
    spec = os.environ.get("MESHLM_FAULT_SLOW_SAVE")
    if not spec:
        return
    seconds, _, steps = spec.partition(":")
    if not steps or step in {int(k) for k in steps.split(",")}:
        time.sleep(float(seconds))


class CopyFence:
    """GPU-only: makes the compute stream wait for ``event`` the first time it is called (an
    optimizer step pre-hook), and does nothing after."""

    def __init__(self, streams: Any, event: Any) -> None:
        self.streams, self.event = streams, event
        self.pending = True

    def __call__(self, *_: Any) -> None:
        if self.pending:
            self.pending = False
            self.streams.current_stream().wait_event(self.event)


class HostCopy:
    """Host buffers a rank's pieces are copied into, kept from one save to the next.

    ``pinned``: page-locked buffers and a side stream (CUDA, GPU-only path); else ordinary CPU
    tensors copied in place. ``streams``: the stream API of the side-stream path (default
    ``torch.cuda`` when pinned; tests give a stand-in to drive it on CPU)."""

    def __init__(self, pinned: bool, streams: Any = None) -> None:
        self.pinned = pinned
        self.buffers: dict[str, torch.Tensor] = {}
        self.streams = streams if streams is not None else (torch.cuda if pinned else None)
        self.stream = self.streams.Stream() if self.streams is not None else None
        self.done: Any = None  # the CUDA event the copies end with (GPU-only path)
        self._fence: tuple[CopyFence, Any] | None = None  # (fence, its hook's handle)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != like.shape:
            buf = torch.empty(like.shape, dtype=torch.float32, pin_memory=self.pinned)
            self.buffers[key] = buf
        return buf

    def take(self, contents: RankContents,
             optimizer: torch.optim.Optimizer | None = None) -> RankContents:
        """``contents`` with every piece copied (as float32) into this rank's host buffers;
        the RNG states, already fresh CPU tensors, as they are. GPU-only path: the copies are
        queued on the side stream; ``optimizer``'s next step -- the next write of what they
        read -- makes the compute stream wait for them (None: it waits at once)."""
        pieces = {k for k in contents.tensors if not is_rng_key(k)}
        for key in set(self.buffers) - pieces:
            del self.buffers[key]
        if self.stream is not None:  # GPU-only: the copies overlap the next compute
            streams = self.streams
            self.stream.wait_stream(streams.current_stream())  # (the pieces are written)
            with streams.stream(self.stream):
                copied = {k: self._buffer(k, t).copy_(t, non_blocking=True)
                          for k, t in contents.tensors.items() if k in pieces}
            for k in pieces:  # (a temporary source is not reused before its copy ran)
                if contents.tensors[k].is_cuda:
                    contents.tensors[k].record_stream(self.stream)
            self.done = self.stream.record_event()
            self._wait_before(optimizer)
        else:
            copied = {k: self._buffer(k, t).copy_(t) for k, t in contents.tensors.items()
                      if k in pieces}
        rest = {k: t for k, t in contents.tensors.items() if k not in pieces}
        return RankContents({**rest, **copied}, contents.meta)

    def _wait_before(self, optimizer: torch.optim.Optimizer | None) -> None:
        """GPU-only: the compute stream waits for the copies' event (on the device) before
        ``optimizer``'s next step overwrites the weights and moments they read: a
        :class:`CopyFence` as its step pre-hook (replacing the last save's: the new event comes
        after the earlier copies on the side stream). None: the wait is queued now."""
        if self._fence is not None:
            self._fence[1].remove()
            self._fence = None
        fence = CopyFence(self.streams, self.done)
        if optimizer is None:
            fence()
            return
        self._fence = (fence, optimizer.register_step_pre_hook(fence))

    def ready(self) -> None:
        """Block until the copies are in host memory (the writer thread, before writing)."""
        if self.done is not None:
            self.done.synchronize()


class AsyncSaver:
    """One rank's asynchronous checkpoint writer (see module docstring); every rank of the
    world makes one, at the same point (the side group is made collectively)."""

    def __init__(self, mesh: Mesh, timeout_s: float) -> None:
        self.mesh = mesh
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                      if mesh.distributed else None)
        self.host = HostCopy(pinned=torch.cuda.is_available() and mesh.device_type == "cuda")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.in_flight: int | None = None  # the step being written
        # the last save's writer times on this rank (seconds): its file, the agreement that
        # every file is on disk, the completion (index, rename; rank 0)
        self.times: dict[str, float] = {}

    @property
    def host_bytes(self) -> int:
        """Bytes of this rank's host copy (its shards, as written)."""
        return self.host.nbytes

    def save(self, root: Path, step: int, engine: Engine, trainer_state: dict[str, Any],
             extra_files: dict[str, Path | str], keep: int = 0,
             outer: dict[int, dict[str, torch.Tensor]] | None = None) -> Path:
        """Start writing checkpoint ``step`` (after the previous save completed); returns the
        folder it will have once complete."""
        self.wait()
        rank = self.mesh.rank
        begin_checkpoint(root, step, rank)
        # (DiLoCo's outer step writes the weights outside the optimizer: wait at once there)
        contents = self.host.take(rank_contents(engine, self.mesh, outer),
                                  getattr(engine, "optimizer", None) if outer is None else None)
        state = {**trainer_state, "step": step, "adam_step": engine.adam_step()}
        self.in_flight = step
        self._thread = threading.Thread(
            target=self._write, args=(root, step, contents, state, extra_files, keep),
            name=f"meshlm-checkpoint-{step}")
        self._thread.start()
        return step_dir(root, step)

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete on every rank; SaveError when it
        failed (its folder stays ``.tmp``: the previous checkpoint is the latest)."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread, step, self.in_flight = None, self.in_flight, None
        error, self._error = self._error, None
        if error is not None:
            raise SaveError(f"checkpoint step {step} was not completed: {error}") from error

    # ------------------------------------------------------------------ the writer thread
    def _agree(self, flag: int, op: dist.ReduceOp) -> int:
        if self.group is None:
            return flag
        t = torch.tensor([flag], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.group)
        return int(t.item())

    def _write(self, root: Path, step: int, contents: RankContents, state: dict[str, Any],
               extra_files: dict[str, Path | str], keep: int) -> None:
        mesh = self.mesh
        tmp = step_dir(root, step).with_name(step_dir(root, step).name + ".tmp")
        try:
            if self.group is not None:
                dist.barrier(group=self.group)  # rank 0 made the folder
            ok, t0 = 1, time.perf_counter()
            try:
                self.host.ready()
                slow_if_asked(step)
                write_contents(tmp, mesh.rank, contents)
                kill_if_asked("MESHLM_FAULT_KILL_IN_SAVE", step, mesh.rank, mesh.world_size)
            except Exception as e:  # (told to the others; raised on this rank's main thread)
                ok, self._error = 0, e
            t1 = time.perf_counter()
            if not self._agree(ok, dist.ReduceOp.MIN):
                self._error = self._error or RuntimeError("another rank could not write its "
                                                          "file")
                return
            done, t2 = 0, time.perf_counter()
            if mesh.rank == 0:
                try:
                    complete_checkpoint(root, step, mesh.world_size, mesh.describe(), state,
                                        extra_files, keep)
                    done = 1
                except Exception as e:
                    self._error = e
            if not self._agree(done, dist.ReduceOp.MAX) and self._error is None:
                self._error = RuntimeError("rank 0 could not complete it")
            self.times = {"write_s": t1 - t0, "agree_s": t2 - t1,
                          "complete_s": time.perf_counter() - t2}
        except Exception as e:  # a side collective failed (a peer died)
            self._error = self._error or e
