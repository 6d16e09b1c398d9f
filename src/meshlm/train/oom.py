"""Out of memory, anywhere, is one line.

The trainer marks the phase it is in (``distributed/phases.py``: construction, checkpoint
load, forward, backward, optimizer step, evaluation, checkpoint save, sampling). When torch runs
out of memory -- ``torch.OutOfMemoryError`` from the CUDA caching allocator, or a CUDA
library's "out of memory" -- :func:`train` turns it into :class:`OutOfMemory`, whose one line
names the phase, the rank, the bytes asked for, in use and available, and the advice its caller
passed in: ``meshlm train`` passes the planner's (``planner.cli.oom_advice``: its estimate for
this layout and the levers that would fit it, in the order the planner ranks them). The rank
stops with it; its launcher (meshlm's own, torchrun's) stops the others, and ``meshlm`` prints
the line and exits 1. A checkpoint is written to a temporary folder and renamed only when
complete, so a save that runs out of memory leaves the last complete checkpoint the latest: the
run directory still resumes.

No communication, no memory.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable

import torch

from ..config import Config

GIB = 2**30

# (the planner's estimate of a config's layout, the levers that would fit it), each "" when
# the planner has no answer for this machine
Advice = Callable[[Config], tuple[str, str]]


class OutOfMemory(RuntimeError):
    """A rank ran out of memory (one line: phase, rank, bytes, estimate, levers)."""


def is_oom(exc: BaseException) -> bool:
    """torch's out-of-memory error, or a CUDA library's (cuBLAS, NCCL) in a RuntimeError."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def asked_bytes(exc: BaseException) -> float | None:
    """The allocation that failed, from torch's message ("Tried to allocate 224.00 MiB")."""
    found = re.search(r"[Tt]ried to allocate ([\d.]+) ?(B|KiB|MiB|GiB|TiB)", str(exc))
    return float(found.group(1)) * _UNITS[found.group(2)] if found else None


def memory_state(device: torch.device) -> tuple[float, float]:
    """(bytes in use by this process, bytes still available) on ``device``: the caching
    allocator's reserved bytes and the device's free bytes on a GPU; resident and available
    host memory on a CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(torch.cuda.memory_reserved(device)), float(free)
    used = available = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/statm") as f:
            used = float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = float(info["MemAvailable"].split()[0]) * 1024
    return used, available


def describe(cfg: Config, rank: int, where: str, exc: BaseException, device: torch.device,
             advice: Advice | None = None) -> str:
    """The one line (see module docstring)."""
    asked = asked_bytes(exc)
    used, available = memory_state(device)
    estimate, levers = advice(cfg) if advice is not None else ("", "")
    parts = [f"out of memory on rank {rank} during {where}: "
             + (f"tried to allocate {asked / GIB:.2f} GiB with " if asked else "")
             + f"{used / GIB:.2f} GiB in use and {available / GIB:.2f} GiB available"]
    if estimate:
        parts.append(estimate)
    parts.append(f"to fit: {levers}" if levers else
                 "no single setting fits it: add ranks (parallel.tp, parallel.pp) or see "
                 "meshlm train --dry-run")
    return "; ".join(parts)
