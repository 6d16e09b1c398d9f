"""Process-wide policies of a training process, set before the trainer allocates anything:
glibc's malloc (``run.malloc_cache_mb``, ``run.malloc_mmap_kb``, ``run.malloc_keep``; no-ops
off glibc) and the thread count (at most one thread per CPU when ``OMP_NUM_THREADS`` is unset).

The malloc policy, one per process (the first one set wins over the default):

- default, ``run.malloc_cache_mb`` = 64 (:func:`cache_freed_memory`): glibc's own dynamic policy
  held at its ceiling from the start -- buffers below 32 MiB from the heap, and up to 64 MiB
  freed at the heap's top kept for the next allocation -- the CPU counterpart of the caching
  allocator every GPU run has: a pipeline stage that frees a micro-batch's activations after
  its backward gets the same pages back for the next forward instead of faulting in fresh
  ones (``docs/benchmarks.md``, pipeline parallelism). 0: glibc's policy as it comes;
- ``run.malloc_mmap_kb`` (:func:`pin_malloc_mmap_threshold`): every buffer above it returned
  to the OS when freed (peak RSS = live memory; memory tests and ``benchmarks/memory.py``);
- ``run.malloc_keep`` (:func:`keep_freed_memory`): nothing ever returned.

No communication; the malloc policies change how freed memory is returned, not how much is live
(the default keeps at most ``malloc_cache_mb`` MiB of freed memory per process).
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

from ..config import RunSection

# M_TRIM_THRESHOLD, M_MMAP_THRESHOLD (mallopt); glibc's ceiling of its dynamic mmap threshold
TRIM, MMAP = -1, -3
MMAP_CEILING = 32 << 20
_policy: str | None = None  # the malloc policy this process set ("cache", "pin", "keep")


def set_process_policies(run: RunSection) -> None:
    """The malloc policy of ``run`` and the thread count of this process. The default cache
    (``run.malloc_cache_mb``) is not applied over a policy the process already set (a memory
    test's pinned threshold, a benchmark's kept memory)."""
    if run.malloc_mmap_kb:
        pin_malloc_mmap_threshold(run.malloc_mmap_kb * 1024)
    elif run.malloc_keep:
        keep_freed_memory()
    elif run.malloc_cache_mb and _policy is None:
        cache_freed_memory(run.malloc_cache_mb << 20)
    if os.environ.get("OMP_NUM_THREADS") is None and torch.get_num_threads() > os.cpu_count():
        torch.set_num_threads(os.cpu_count() or 1)


def _libc() -> ctypes.CDLL | None:
    """glibc, or None on another platform or C library (the malloc policies are then no-ops)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # another C library
        return None


def pin_malloc_mmap_threshold(nbytes: int = 128 * 1024) -> None:
    """Fix glibc's mmap threshold at ``nbytes`` (no-op off glibc); ``run.malloc_mmap_kb``.

    By default glibc raises the threshold after each large free (up to 32 MiB), so per-layer
    buffers -- ZeRO-3's gathered parameters and gradient flats, activations -- come from the
    brk heap, whose holes are never returned: the peak RSS then grows step after step (dp=4
    ZeRO-3, 81 M parameters: 1,824 -> 2,210 MiB over 8 steps, live tensors flat). Fixed, every
    buffer above ``nbytes`` is mmapped and returned on free: the peak is flat from step 2.
    The price is a page fault per page of every such buffer, every time it is allocated: the
    ``small`` preset's fp32 step on one CPU process takes ~1.6x as long (0.72 vs 0.45 s at
    batch 8 x 256), so runs pin it only when asked (memory tests and benchmarks do).
    """
    global _policy
    libc = _libc()
    if libc is not None:
        libc.mallopt(MMAP, nbytes)  # (also ends the dynamic adjustment)
        libc.mallopt(TRIM, 128 * 1024)  # glibc's initial trim threshold, whatever came before
        _policy = "pin"


def cache_freed_memory(nbytes: int = 64 << 20) -> None:
    """Keep up to ``nbytes`` of freed memory at the top of the heap for reuse, and serve buffers
    below 32 MiB from the heap (no-op off glibc); ``run.malloc_cache_mb``, the default.

    glibc's own policy starts with a 128 KiB mmap threshold and raises it to the size of each
    larger mmapped buffer freed (up to 32 MiB), with the trim threshold at twice that: where
    the largest buffers are a micro-batch's 8 MiB logits, it settles at 8 / 16 MiB, and a
    pipeline stage that frees a micro-batch's activations after its backward (meshlm's, which
    keeps its peak at about half of torch's pipelining) gives the heap's top back and faults
    it in again for the next forward: ~1.1 us a page, 10-40k pages a step on the last stage
    of ``benchmarks/pipeline.py`` (``small``, pp 2). Held at the ceiling instead (32 / 64
    MiB), the same stage takes a few hundred faults a step. Buffers of 32 MiB and more are
    still mmapped and returned, so what stays is bounded: at most ``nbytes`` freed at the
    heap's top (holes below it glibc's policy keeps as well).
    """
    global _policy
    libc = _libc()
    if libc is not None:
        libc.mallopt(MMAP, MMAP_CEILING)
        libc.mallopt(TRIM, nbytes)
        _policy = "cache"


def keep_freed_memory() -> None:
    """Keep freed buffers in the process (no-op off glibc); ``run.malloc_keep``.

    Even glibc's own policy mmaps every buffer of 32 MiB or more (the ``small`` preset's
    logits and their gradient at batch 8 x 256) and trims the top of the heap, so each step
    faults those pages in afresh. With the mmap threshold at 1 GiB and trimming off, a step
    reuses the pages of the last: ``small``'s eager steps at batch 8 x 256 run ~10 % faster
    (docs/benchmarks.md), compiled ones (fewer such buffers) about as fast. Peak RSS is then
    the high-water mark of the heap, freed memory included (``make train``: 730 vs 609 MiB),
    so it is off by default.
    """
    global _policy
    libc = _libc()
    if libc is not None:
        libc.mallopt(MMAP, 1 << 30)
        libc.mallopt(TRIM, (1 << 31) - 1)  # never give the heap's top back
        _policy = "keep"
