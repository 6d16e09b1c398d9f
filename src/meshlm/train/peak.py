"""Peak FLOP/s of one rank, the denominator of MFU.

On CPU the peak is measured at start-up: the best rate of a square matmul in the run's compute
dtype with the threads this process uses (so MFU reads "fraction of what this machine's matmul
can do"). On a GPU it is the datasheet dense peak of the named part. ``train.peak_flops``
overrides both. The source is always reported next to the number.
"""

from __future__ import annotations

import time

import torch

# Dense (no sparsity) datasheet peaks in FLOP/s; fp32 entries are TF32 tensor-core rates.
GPU_PEAK: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "H800": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "fp32": 1100e12},
    "MI300X": {"bf16": 1307e12, "fp16": 1307e12, "fp32": 654e12},
}


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


def peak_flops(device: torch.device, dtype_name: str, override: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s per rank, where the number comes from)."""
    if override > 0:
        return override, "train.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK.items():
            if key in name:
                return table[dtype_name], f"datasheet {key} {dtype_name}"
        raise ValueError(f"unknown GPU {name!r}: set train.peak_flops to its peak FLOP/s")
    from ..precision import DTYPES

    value = measure_matmul_flops(DTYPES[dtype_name])
    return value, f"measured CPU matmul {dtype_name}, {torch.get_num_threads()} thread(s)"
