"""Process-wide policies of a training process, set before the trainer allocates anything:
glibc's malloc (``run.malloc_mmap_kb``, ``run.malloc_keep``; no-ops off glibc) and the
thread count (at most one thread per CPU when ``OMP_NUM_THREADS`` is unset).

No communication; the malloc policies change how freed memory is returned, not how much is live.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

from ..config import RunSection


def set_process_policies(run: RunSection) -> None:
    """The malloc policies of ``run`` and the thread count of this process."""
    if run.malloc_mmap_kb:
        pin_malloc_mmap_threshold(run.malloc_mmap_kb * 1024)
    if run.malloc_keep:
        keep_freed_memory()
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
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD (also ends the dynamic adjustment)


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
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD: never give the heap's top back
