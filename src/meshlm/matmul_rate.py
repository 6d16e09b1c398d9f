"""The best FLOP/s of a square matmul on this CPU: the trainer's MFU peak (``train/peak.py``)
and the planner's calibration (``planner/calibrate.py``) measure the same way."""

from __future__ import annotations

import time

import torch


def measure_matmul_flops(dtype: torch.dtype, n: int = 1024, seconds: float = 0.3) -> float:
    """Best observed FLOP/s of an (n x n) @ (n x n) matmul on CPU in ``dtype``."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b  # warm-up: thread pool and kernels
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        dt = time.perf_counter() - t0
        best = max(best, 2 * n**3 / dt)
    return best
