"""Optimizer-state offload: AdamW moments off the device (``parallel.offload``).

- ``none``: torch's AdamW; the moments (8 bytes per owned parameter) live beside the weights.
- ``cpu`` (ZeRO-Offload, Ren et al. 2021): the moments live in pinned host memory; each step
  streams the owned weights and gradients to the host one chunk at a time, runs AdamW there and
  copies the updated weights back. The copies run on a CUDA stream of their own into two pinned
  staging slots (double buffering): chunk i + 1 travels to the host while the host steps chunk
  i, and chunk i's weights travel back while it steps chunk i + 1; the host waits on a per-slot
  event, never on the whole device (:class:`StreamCopies`). **GPU-only**: on a CPU run the
  moments already live in host memory, so ``cpu`` is the same as ``none`` (torch's AdamW; the
  trainer says so at start-up). The same chunk loop runs on CPU with synchronous copies
  (:class:`SyncCopies`), which the tests drive.
  meshlm's weights are the fp32 masters already, so no separate master copy is kept.
- ``disk`` (ZeRO-Infinity's NVMe tier, Rajbhandari et al. 2021): the moments live in one file
  per rank, mapped into memory (``mmap``, shared). The step pages in one chunk of both
  moments, runs AdamW on it, and drops the chunk's pages from this process
  (``MADV_DONTNEED``: dirty pages go back to the page cache and on to the file), so the
  moments' resident memory is zero between steps and at most one chunk during the step.

The host step runs torch's fused CPU AdamW (``fused=True``: one vectorised pass over weight,
gradient and both moments, about 4x the foreach kernels' rate per parameter on one core,
``benchmarks/offload_step.py``) unless ``train.adamw_impl=foreach`` asks for the multi-tensor
kernels. Results equal torch's ``AdamW`` with the same kernels bit for bit: the same functional
kernels (``torch.optim.adamw.adamw``) on the same groups and hyper-parameters, applied to
slices of each parameter cut at multiples of :data:`CHUNK` elements from its start (every
update is element-wise, and the cut keeps each element's vector lane).

Memory per rank (Ψ_o parameters owned by this rank's optimizer): device -- 0 moment bytes with
``cpu`` or ``disk`` (8 Ψ_o with ``none``); host -- 8 Ψ_o pinned with ``cpu`` plus 16 CHUNK of
staging (two slots of weights and gradients), at most 8 CHUNK resident with ``disk`` (plus AdamW's temporary of one chunk); disk --
8 Ψ_o bytes per rank. Traffic per step: ``cpu`` -- 8 Ψ_o bytes device to host (weights and
gradients), 4 Ψ_o host to device; ``disk`` -- 8 Ψ_o read and 8 Ψ_o written through the page
cache. No communication: the step stays local, as with ``none``.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.optim.adamw import adamw as functional_adamw
from torch.optim.optimizer import _get_scalar_dtype

from ..config import ConfigError

CHUNK = 1 << 20  # elements streamed per AdamW call: 4 MiB per fp32 moment (a multiple of 64)
PAGE = mmap.PAGESIZE
# Linux maps the cached pages around a faulting one too ("fault-around", 64 KiB by default):
# ranges are released rounded out to this alignment, so none of those strays stays mapped
RELEASE_ALIGN = max(PAGE, 64 * 1024)


# ---------------------------------------------------------------------- where moments live
class HostStore:
    """Both moments of ``n`` elements in (pinned, on a CUDA run) host memory."""

    def __init__(self, n: int, pin: bool) -> None:
        self.flat = torch.zeros(2, n, dtype=torch.float32, pin_memory=pin)

    def window(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.flat[0, lo:hi], self.flat[1, lo:hi]

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.window(lo, hi)

    def release(self, lo: int, hi: int) -> None:
        pass

    def resident_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class DiskStore:
    """Both moments of ``n`` elements in the file ``path``, mapped shared; pages are dropped
    from this process after use (:meth:`release`). Written pages reach the file through the
    page cache (the kernel's write-back), which the process does not hold.

    A file left by an earlier run is replaced (the moments come from the checkpoint on
    resume); the file is removed when the optimizer is garbage-collected or the process
    exits.
    """

    def __init__(self, path: Path, n: int) -> None:
        self.path, self.n = path, n
        self.nbytes = 2 * n * 4
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # a new file: never truncate one still mapped elsewhere
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise ConfigError(f"parallel.offload_dir: cannot create {path}: "
                              f"{e.strerror or e}") from None
        size = max(self.nbytes, PAGE)
        try:
            # blocks reserved now (reading as zeros): a full disk is an error here, not a
            # SIGBUS when a page is written back in the middle of training
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ConfigError(f"parallel.offload_dir: cannot reserve {self.nbytes:,} bytes "
                              f"for {path}: {e.strerror or e}") from None
        self.flat = (torch.frombuffer(self.map, dtype=torch.float32, count=2 * n).view(2, n)
                     if n else torch.zeros(2, 0))
        # removed when collected, and at exit -- multiprocessing's finalizers also run in
        # spawned workers, which leave through os._exit (no atexit)
        self._finalizer = Finalize(self, _remove, args=(fd, path), exitpriority=0)

    def window(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.flat[0, lo:hi], self.flat[1, lo:hi]

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of elements ``[lo, hi)`` (a checkpoint's read), their pages dropped again."""
        m, v = (t.clone() for t in self.window(lo, hi))
        self.release(lo, hi)
        return m, v

    def release(self, lo: int, hi: int) -> None:
        """Drop the pages of elements ``[lo, hi)`` of both moments from this process (rounded
        out to :data:`RELEASE_ALIGN`; a neighbour's page is paged in again when it is used)."""
        for base in (0, self.n):
            start = (base + lo) * 4 // RELEASE_ALIGN * RELEASE_ALIGN
            end = min(-(-(base + hi) * 4 // RELEASE_ALIGN) * RELEASE_ALIGN, len(self.map))
            if end > start:
                self.map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def release_all(self) -> None:
        self.map.madvise(mmap.MADV_DONTNEED, 0, len(self.map))

    def resident_bytes(self) -> int:
        """Bytes of the mapping resident in this process, measured: the present bits of its
        pages in ``/proc/self/pagemap`` (8 bytes per 4 KiB page; Linux), else 0."""
        if not self.n:
            return 0
        return mapped_pages(self.flat.data_ptr(), len(self.map) // PAGE) * PAGE


def _remove(fd: int, path: Path) -> None:
    """Close the file and remove it, unless another optimizer has replaced it meanwhile."""
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            path.unlink()
    except OSError:
        pass
    os.close(fd)


def mapped_pages(addr: int, pages: int) -> int:
    """How many of the ``pages`` pages from address ``addr`` are mapped in this process (bit 63
    of each ``/proc/self/pagemap`` entry); 0 where that file cannot be read."""
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(addr // PAGE * 8)
            entries = np.frombuffer(f.read(pages * 8), dtype=np.uint64)
    except OSError:
        return 0
    return int(np.count_nonzero(entries >> np.uint64(63)))


# ---------------------------------------------------------------------- the optimizer
@dataclass(frozen=True)
class Piece:
    """Elements ``[a, b)`` of parameter ``index`` (its flat view), at ``pos`` in the store."""

    index: int
    a: int
    b: int
    pos: int


@dataclass(frozen=True)
class Chunk:
    """Consecutive pieces of one group, stored at ``[lo, hi)``: one AdamW call."""

    group: int
    lo: int
    hi: int
    pieces: tuple[Piece, ...]


def plan_chunks(groups: list[list[torch.Tensor]], chunk: int = CHUNK
                ) -> tuple[list[int], list[Chunk], int]:
    """Store offset of every parameter (groups in order, each parameter's elements
    consecutive), the chunks each step streams, and the store's length. A parameter larger
    than ``chunk`` is cut at multiples of ``chunk`` from its start."""
    offsets: list[int] = []
    chunks: list[Chunk] = []
    pos = index = 0
    for gi, params in enumerate(groups):
        current: list[Piece] = []
        size = 0
        for p in params:
            offsets.append(pos)
            for a in range(0, p.numel(), chunk):
                b = min(a + chunk, p.numel())
                if size + b - a > chunk and current:
                    chunks.append(Chunk(gi, current[0].pos, pos, tuple(current)))
                    current, size = [], 0
                current.append(Piece(index, a, b, pos))
                size += b - a
                pos += b - a
            index += 1
        if current:
            chunks.append(Chunk(gi, current[0].pos, pos, tuple(current)))
    return offsets, chunks, pos


class OffloadedState(MutableMapping):
    """``optimizer.state`` of :class:`OffloadedAdamW`: parameter -> ``{"step", "exp_avg",
    "exp_avg_sq"}``. Reading gives views of a host store and copies from a disk store (whose
    pages are dropped again, so a checkpoint's read leaves nothing resident); assigning copies
    the moments into the store."""

    def __init__(self, opt: OffloadedAdamW) -> None:
        self.opt = opt

    def _index(self, p: torch.Tensor) -> int:
        i = self.opt.index.get(id(p))
        if i is None or self.opt.params[i] is not p:
            raise KeyError(p)
        return i

    def __getitem__(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        i = self._index(p)
        if self.opt.steps[i] is None:
            raise KeyError(p)
        lo = self.opt.offsets[i]
        m, v = self.opt.store.read(lo, lo + p.numel())
        return {"step": torch.tensor(self.opt.steps[i], dtype=_get_scalar_dtype()),
                "exp_avg": m.view(p.shape), "exp_avg_sq": v.view(p.shape)}

    def __setitem__(self, p: torch.Tensor, value: dict[str, torch.Tensor]) -> None:
        i = self._index(p)
        m, v = self.opt.moments(i)
        m.copy_(value["exp_avg"].reshape(-1))
        v.copy_(value["exp_avg_sq"].reshape(-1))
        self.opt.steps[i] = float(value["step"])
        lo = self.opt.offsets[i]
        self.opt.store.release(lo, lo + p.numel())

    def __delitem__(self, p: torch.Tensor) -> None:
        self.opt.steps[self._index(p)] = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p, s in zip(self.opt.params, self.opt.steps, strict=True) if s is not None)

    def __len__(self) -> int:
        return sum(s is not None for s in self.opt.steps)


# ---------------------------------------------------------------------- staging copies
Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source) of each copy


class SyncCopies:
    """Copies between the parameters' device and the host staging slots, done when issued
    (a CPU run: there is nothing to overlap). :class:`StreamCopies` is the CUDA one; both
    take the calls of :meth:`OffloadedAdamW._pipelined` in the same order."""

    def begin(self) -> None:
        """A step starts: the gradients are complete on the device."""

    def to_host(self, slot: int, pairs: Pairs) -> None:
        """Issue the device -> host copies of one chunk into staging ``slot``."""
        for dst, src in pairs:
            dst.copy_(src)

    def wait(self, slot: int) -> None:
        """Block the host until the copies into ``slot`` are done."""

    def to_device(self, slot: int, pairs: Pairs) -> None:
        """Issue the host -> device copies of ``slot``'s updated weights."""
        for dst, src in pairs:
            dst.copy_(src)

    def end(self) -> None:
        """The step ends: later device work sees the updated weights."""


# GPU-only: the staging copies of a CUDA run
class StreamCopies(SyncCopies):
    """GPU-only path (driven on CPU by tests through a stand-in ``streams`` API; default
    ``torch.cuda``): the copies run on a side stream of their own, so they overlap the host's
    AdamW on the other slot; the host waits on one event per slot, the compute stream on the
    side stream once per step.

    Order on the side stream (FIFO): D2H(i + 1) is issued before the host steps chunk i, and
    H2D(i - 1) before D2H(i + 1), which reuses its slot, so no copy into a slot overtakes the
    copy out of it. The staging slots are pinned (true asynchronous copies).

    The sources of a slot's device -> host copies are held until the host has waited for that
    slot's event: a gradient that is not contiguous is copied flat on the compute stream
    (``OffloadedAdamW._grad``) and read on the side stream, and freed any earlier its memory
    could be handed to the compute stream's next allocation while the copy still reads it."""

    def __init__(self, device: torch.device, streams: Any = None) -> None:
        self.device = device
        self.streams = streams if streams is not None else torch.cuda
        self.stream = self.streams.Stream(device)
        self.ready = [self.streams.Event(), self.streams.Event()]
        self.sources: list[list[torch.Tensor]] = [[], []]  # per slot, until its event

    def begin(self) -> None:
        self.stream.wait_stream(self.streams.current_stream(self.device))  # gradients written

    def to_host(self, slot: int, pairs: Pairs) -> None:
        # (a gradient that is not contiguous was just copied flat on the compute stream)
        self.stream.wait_stream(self.streams.current_stream(self.device))
        with self.streams.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            self.ready[slot].record(self.stream)
        self.sources[slot] = [src for _, src in pairs]

    def wait(self, slot: int) -> None:
        self.ready[slot].synchronize()
        self.sources[slot] = []  # (copied: their memory may be reused)

    def to_device(self, slot: int, pairs: Pairs) -> None:
        with self.streams.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def end(self) -> None:
        self.streams.current_stream(self.device).wait_stream(self.stream)  # weights written


@dataclass(frozen=True)
class Work:
    """The pieces of chunk ``chunk`` that have a gradient this step, each with its
    ``[lo, hi)`` inside the chunk."""

    chunk: Chunk
    pieces: tuple[tuple[Piece, int, int], ...]


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW whose moments live in a :class:`HostStore` or :class:`DiskStore` and are
    streamed through the step chunk by chunk (module docstring). Groups, hyper-parameters,
    ``step``, ``zero_grad`` and ``state`` behave as torch's ``AdamW``."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
                 store: str, path: Path | None = None, chunk: int = CHUNK,
                 staged: bool | None = None, fused: bool = True) -> None:
        """``store``: ``cpu`` or ``disk`` (``path``: the file). ``staged``: copy weights and
        gradients through a host buffer (default: when the parameters are not on the CPU).
        ``fused``: torch's fused CPU AdamW on the host (else its foreach kernels)."""
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.fused = fused
        self.params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        for p in self.params:
            if not p.is_contiguous():
                raise ValueError("offloaded AdamW steps flat views: parameters must be "
                                 "contiguous")
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.offsets, self.chunks, n = plan_chunks(
            [list(g["params"]) for g in self.param_groups], chunk)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        # moments on the host, weights on the device: AdamW runs on host copies
        self.staged = self.device.type != "cpu" if staged is None else staged
        self.cuda = self.device.type == "cuda"
        if store == "disk":
            if path is None:
                raise ValueError("offload=disk needs a file path")
            self.store: HostStore | DiskStore = DiskStore(path, n)
        else:
            self.store = HostStore(n, pin=self.cuda)
        self.steps: list[float | None] = [None] * len(self.params)  # None: no state yet
        self.state = OffloadedState(self)  # type: ignore[assignment]
        self.chunk = chunk
        self.staging: torch.Tensor | None = None  # two slots, made at the first staged step
        # GPU-only: copies on a side stream (a CPU run copies when asked)
        self.copies: SyncCopies = StreamCopies(self.device) if self.cuda else SyncCopies()

    @classmethod
    def like(cls, optimizer: torch.optim.Optimizer, store: str, path: Path | None = None,
             chunk: int = CHUNK, staged: bool | None = None) -> OffloadedAdamW:
        """The offloaded twin of a fresh ``torch.optim.AdamW`` (same groups, same order)."""
        if len(optimizer.state):
            raise ValueError("offload: the optimizer must not have stepped yet")
        g0 = optimizer.param_groups[0]
        for g in optimizer.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ValueError("offload supports plain AdamW (no amsgrad, no maximize)")
        groups = [{"params": list(g["params"]), "weight_decay": g["weight_decay"],
                   "lr": g["lr"], "betas": g["betas"], "eps": g["eps"]}
                  for g in optimizer.param_groups]
        # the host step takes the fused CPU kernels unless the run asked for foreach ones
        fused = not any(g.get("foreach") for g in optimizer.param_groups)
        return cls(groups, g0["lr"], g0["betas"], g0["eps"], store, path, chunk, staged, fused)

    def moments(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat views of parameter ``i``'s two moments in the store."""
        lo = self.offsets[i]
        return self.store.window(lo, lo + self.params[i].numel())

    def resident_bytes(self) -> int:
        """Host bytes of the moments resident in this process now (0 between steps on disk)."""
        return self.store.resident_bytes()

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: ANN001
        if closure is not None:
            raise ValueError("offloaded AdamW takes no closure")
        work = [w for w in (self._work(c) for c in self.chunks) if w.pieces]
        if self.staged:
            self._pipelined(work)
        else:
            for w in work:  # moments in host memory, weights too: AdamW in place
                self._adamw(w, [self._weight(pc) for pc, _, _ in w.pieces],
                            [self._grad(pc) for pc, _, _ in w.pieces])
                self.store.release(w.chunk.lo, w.chunk.hi)
        for i in {pc.index for w in work for pc, _, _ in w.pieces}:  # once per parameter
            self.steps[i] = (self.steps[i] or 0.0) + 1.0
        if isinstance(self.store, DiskStore):
            self.store.release_all()  # (pages faulted in around the chunks' edges)

    def _work(self, c: Chunk) -> Work:
        """Chunk ``c``'s pieces with a gradient (as torch's AdamW: no gradient, no step)."""
        return Work(c, tuple((pc, pc.pos - c.lo, pc.pos + pc.b - pc.a - c.lo)
                             for pc in c.pieces if self.params[pc.index].grad is not None))

    def _weight(self, pc: Piece) -> torch.Tensor:
        return self.params[pc.index].detach().view(-1)[pc.a:pc.b]

    def _grad(self, pc: Piece) -> torch.Tensor:
        return self.params[pc.index].grad.detach().reshape(-1)[pc.a:pc.b]

    def _slots(self) -> torch.Tensor:
        """Two staging slots of (weights, gradients), ``chunk`` elements each: (2, 2, chunk),
        pinned on a CUDA run; kept across steps (the side stream orders their reuse)."""
        if self.staging is None:
            self.staging = torch.empty(2, 2, self.chunk, dtype=torch.float32,
                                       pin_memory=self.cuda)
        return self.staging

    def _pipelined(self, work: list[Work]) -> None:
        """Staged step, double-buffered: chunk i + 1 is copied to the host while the host
        steps chunk i; chunk i's weights go back from its slot, which chunk i + 2 reuses."""
        slots, copies = self._slots(), self.copies
        copies.begin()
        if work:
            copies.to_host(0, self._fetch(work[0], slots[0]))
        for i, w in enumerate(work):
            slot = slots[i % 2]
            if i + 1 < len(work):
                copies.to_host((i + 1) % 2, self._fetch(work[i + 1], slots[(i + 1) % 2]))
            copies.wait(i % 2)
            weights = [slot[0, lo:hi] for _, lo, hi in w.pieces]
            self._adamw(w, weights, [slot[1, lo:hi] for _, lo, hi in w.pieces])
            copies.to_device(i % 2, [(self._weight(pc), host)
                                     for (pc, _, _), host in zip(w.pieces, weights, strict=True)])
            self.store.release(w.chunk.lo, w.chunk.hi)
        copies.end()

    def _fetch(self, w: Work, slot: torch.Tensor) -> Pairs:
        """The device -> host copies of ``w``'s weights and gradients into ``slot``."""
        pairs = [(slot[0, lo:hi], self._weight(pc)) for pc, lo, hi in w.pieces]
        return pairs + [(slot[1, lo:hi], self._grad(pc)) for pc, lo, hi in w.pieces]

    def _adamw(self, w: Work, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """One AdamW call on chunk ``w`` (host tensors ``params``, ``grads``, one per piece)."""
        group = self.param_groups[w.chunk.group]
        m, v = self.store.window(w.chunk.lo, w.chunk.hi)
        ms, vs, steps = [], [], []
        for pc, lo, hi in w.pieces:
            if self.steps[pc.index] is None:
                m[lo:hi].zero_()
                v[lo:hi].zero_()
            ms.append(m[lo:hi])
            vs.append(v[lo:hi])
            steps.append(torch.tensor(self.steps[pc.index] or 0.0,
                                      dtype=_get_scalar_dtype(is_fused=self.fused)))
        beta1, beta2 = group["betas"]
        functional_adamw(params, grads, ms, vs, [], steps, foreach=not self.fused,
                         capturable=False, differentiable=False, fused=self.fused or None,
                         grad_scale=None, found_inf=None,
                         has_complex=False, amsgrad=False, beta1=beta1, beta2=beta2,
                         lr=group["lr"], weight_decay=group["weight_decay"],
                         eps=group["eps"], maximize=False)


# ---------------------------------------------------------------------- applying it
def offload_states(engine, kind: str, path: Path | None = None):  # noqa: ANN001, ANN201
    """Give ``engine`` (any data-parallel engine, before its first step) an
    :class:`OffloadedAdamW` for ``kind`` = ``cpu`` (GPU runs) or ``disk`` (``path``: this
    rank's file); ``none``, and ``cpu`` on a CPU run, keep torch's AdamW. Returns the engine."""
    on_device = engine.comm.mesh.device().type != "cpu"
    if kind == "none" or (kind == "cpu" and not on_device):
        return engine
    engine.use_optimizer(OffloadedAdamW.like(engine.optimizer, kind, path))
    return engine
