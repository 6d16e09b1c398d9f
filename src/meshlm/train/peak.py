"""Peak FLOP/s of one rank, the denominator of MFU.

On CPU the peak is measured at start-up (once per process, dtype and thread count: about 0.4 s):
the best rate of a square matmul in the run's compute dtype with the threads this process uses
(so MFU reads "fraction of what this machine's matmul can do"), 1024 x 1024 where one call
takes at most 0.1 s, smaller for a slow dtype. On a GPU it is the datasheet dense peak of the named part. ``train.peak_flops``
overrides both. The source is always reported next to the number.

``bf16_warning``: on many CPUs bf16 matmul is slower than fp32. AVX2-only x86 (no AVX512-BF16
or AMX) runs it through a slow fallback, tens to hundreds of times below fp32; an AVX-512 CPU
with native bf16 but no AMX measured 1.35x below fp32 on the start-up matmul.
``precision.dtype=bf16`` on such a CPU is then a slowdown, not a speed-up, so the trainer
measures both rates at start-up (a few ms each on a small matmul) and warns with what it
measured, claiming nothing about the instruction set.
"""

from __future__ import annotations

import time

import torch

from ..matmul_rate import measure_matmul_flops

# Dense (no sparsity) datasheet peaks in FLOP/s; fp32 entries are TF32 tensor-core rates.
GPU_PEAK: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "H800": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "fp32": 1100e12},
    "MI300X": {"bf16": 1307e12, "fp16": 1307e12, "fp32": 654e12},
}


# bf16 below this fraction of fp32's matmul rate earns the warning: native bf16 (AVX512-BF16,
# AMX, Arm BF16) is at least as fast as fp32; the margin keeps timing noise from warning there.
BF16_SLOW_FRACTION = 0.8


SIZE = 128  # the start-up check's matmul: (SIZE x SIZE) @ (SIZE x SIZE)


def quick_matmul_rates(n: int = SIZE, seconds: float = 0.005) -> dict[str, float]:
    """Best FLOP/s of an (n x n) matmul in fp32 and in bf16 on CPU, about ``seconds`` each
    (at least one timed call: about 2 ms for bf16 at n = 128 on an AVX2-only core)."""
    return {"fp32": measure_matmul_flops(torch.float32, n, seconds),
            "bf16": measure_matmul_flops(torch.bfloat16, n, seconds)}


def bf16_warning(rates: dict[str, float], fraction: float = BF16_SLOW_FRACTION,
                 key: str = "precision.dtype") -> str | None:
    """The start-up warning when bf16 matmul is slower than ``fraction`` of fp32 (None when not).

    ``rates``: FLOP/s per dtype name, e.g. :func:`quick_matmul_rates`; ``key``: the setting
    that chose bf16 (``precision.dtype``, or ``precision.fp8_rest`` under fp8).
    """
    fp32, bf16 = rates["fp32"], rates["bf16"]
    if bf16 >= fraction * fp32:
        return None
    # What was measured, and nothing more: the same warning fires on a CPU whose native bf16
    # is merely slower than its fp32 at this size (AVX-512 without AMX: about 1.35x) and on
    # one that emulates bf16 (AVX2-only: tens of times), so it names no missing instruction.
    return (f"warning: {key}=bf16 runs matmuls slower than fp32 on this CPU: measured "
            f"{bf16 / 1e9:.1f} GFLOP/s bf16 vs {fp32 / 1e9:.1f} GFLOP/s fp32 "
            f"({slowdown(fp32, bf16)} slower, {SIZE}x{SIZE} matmul); "
            f"--{key}=fp32 trains faster here")


def slowdown(fast: float, slow: float) -> str:
    """``fast / slow`` as a reader wants it: ``1.35x``, ``4.2x``, ``67x``; ``far`` for 0."""
    if slow <= 0:
        return "far"
    ratio = fast / slow
    return f"{ratio:.2f}x" if ratio < 2 else f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def check_bf16(device: torch.device, compute: str, key: str = "precision.dtype"
               ) -> str | None:
    """:func:`bf16_warning` of this machine when the run's compute dtype ``compute`` (a
    ``PrecisionPlan``'s) is bf16 on CPU, else None; ``key``: the setting that chose it."""
    if device.type != "cpu" or compute != "bf16":
        return None
    return bf16_warning(quick_matmul_rates(), key=key)


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

    threads = torch.get_num_threads()
    key = (dtype_name, threads)
    if key not in _MEASURED:  # (once per process: a later run here reads the same machine)
        dtype = DTYPES[dtype_name]
        _MEASURED[key] = measure_matmul_flops(dtype, peak_matmul_size(dtype))
    return _MEASURED[key], f"measured CPU matmul {dtype_name}, {threads} thread(s)"


def peak_matmul_size(dtype: torch.dtype, largest: int = 1024, call_s: float = 0.1) -> int:
    """The square matmul size the CPU peak is measured at: ``largest``, or the largest power of
    two below it (at least 256) whose one call a 256 probe says takes at most ``call_s``. A slow
    dtype (bf16 without native support: about 1 GFLOP/s, 3 s per 1024 matmul) is measured in
    a fraction of a second instead of seconds per run."""
    probe = 256
    a = torch.randn(probe, probe).to(dtype)
    a @ a  # (warm-up)
    t0 = time.perf_counter()
    a @ a
    seconds = time.perf_counter() - t0
    n = largest
    while n > probe and seconds * (n / probe) ** 3 > call_s:
        n //= 2
    return n


# peak_flops' CPU measurements in this process: (dtype name, threads) -> FLOP/s
_MEASURED: dict[tuple[str, int], float] = {}
