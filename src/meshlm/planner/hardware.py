"""Catalogue of accelerators and clusters: what one GPU (or CPU process) can compute and move.

Every value has a source string (``Accelerator.sources``). Peaks are dense (no sparsity)
datasheet numbers. The *achievable* fractions are the ones the time model uses:

- ``gemm_eff``: Maximum Achievable Matmul FLOPS / peak, measured with ``mamf-finder.py`` over
  a grid of shapes (S. Bekman, *Machine Learning Engineering*, compute/accelerator/README.md,
  "Maximum Achievable Matmul FLOPS comparison table").
- ``attn_eff``: fused (flash) attention forward + backward as a fraction of the 16-bit peak
  (FlashAttention-2, Dao 2023: 50-73 % on A100; FlashAttention-3, Shah et al. 2024: FA-2 reaches
  35 % on H100). meshlm calls PyTorch SDPA, whose CUDA flash backend is FlashAttention-2.
- ``hbm_eff``, ``intra_eff``, ``inter_eff``: achieved / line-rate bandwidth of elementwise
  kernels and of NCCL collectives (nccl-tests ``busbw``).

Links: ``intra_bw`` is one GPU's one-direction NVLink (or PCIe) bandwidth inside a node,
``inter_bw`` its share of the node's network (one NIC per GPU in DGX/HGX systems). Latency
follows NCCL's cost model (src/graph/tuning.cc: a base latency per collective plus a per-step
hardware latency; ring, Simple protocol: 8.4 us base, 3.4 us per NVLink step, network steps
assumed 14 us).

The ``cpu`` entry describes *this* machine: it is measured by ``meshlm plan --calibrate``
(:mod:`meshlm.planner.calibrate`), stored in ``~/.cache/meshlm/cpu_calibration.json``; the
shipped default was measured the same way on the project's 2-core CI machine. On CPU every
rank is a process with its own threads; when ranks x threads exceed the cores they time-share
them, so the per-rank compute rate falls by cores / (ranks x threads) -- 4 ranks on 2 cores
run at half speed each.

Users describe other hardware in TOML: ``name``, ``base`` (a catalogue entry to start from)
and any field below (``peak_bf16``, ``peak_fp8``, ``memory_gb``, ``hbm_tbps``,
``intra_gbps``, ``inter_gbps`` in GB/s per GPU per direction, ``gpus_per_node``, ``power_w``
for a power cap below ``tdp_w``, ...). A cap scales the compute rates by
``(power / tdp) ** POWER_EXPONENT``; memory bandwidth is left alone.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import ConfigError
from .workload import DTYPES

GIB = 2**30
T = 1e12
GBPS = 1e9

_MAMF = ("S. Bekman, ml-engineering compute/accelerator/README.md, Maximum Achievable Matmul "
         "FLOPS table")
_NCCL_LAT = ("NCCL src/graph/tuning.cc cost model: ring/Simple base 8.4 us, NVLink 3.4 us per "
             "step; network step 14 us (assumed, order of NCCL's NET Simple latency)")
_HBM_EFF = ("assumption: large elementwise kernels reach ~85 % of HBM line rate "
            "(STREAM-like copies on A100/H100 report 80-90 %)")
_NCCL_EFF = ("nccl-tests on 8x A100 NVLink: sendrecv 195 GB/s of 300 GB/s, all-reduce busbw "
             "~230 GB/s (li-plus/playground cuda/nccl.md; NVIDIA DGX A100 reports); 0.75 "
             "taken for NVLink and network alike")
_LAUNCH = ("PyTorch eager CUDA kernel launch ~5 us (CPU-side dispatch); launches overlap "
           "running kernels, so they only bound very short kernels")
# Power caps. A power-bound GEMM's rate follows the watts per SM: H100 SXM (132 SMs, 700 W)
# reaches 794.5 TFLOPS in MAMF, H100 PCIe (same GH100 die, 114 SMs, 350 W) 499.5 -- per SM
# 0.728x at 0.579x the watts per SM, so rate ~ watts ** (ln 0.728 / ln 0.579) = watts ** 0.58.
POWER_EXPONENT = math.log((499.5 / 114) / (794.5 / 132)) / math.log((350 / 114) / (700 / 132))
_POWER = ("rate ~ (cap / TDP) ** 0.58, from MAMF of H100 SXM (700 W, 132 SMs) and H100 PCIe "
          "(350 W, 114 SMs); memory bandwidth assumed unaffected")
# Eager PyTorch's memory-bound kernels on the H200, calibrated (no datasheet gives it): in
# ../shared/data/gpu_h200_2026-11.md meshlm's eager and compiled steps of the 820M shape differ
# by 0.2713 - 0.1823 = 0.0890 s, and only the memory-bound kernels differ between the two
# (compilation fuses them; the GEMMs stay ATen's, attention SDPA's, the loss and optimizer
# eager): the planner's fused traffic (18.9 ms at hbm_eff) plus 0.0890 s is the time of the
# counted eager traffic (precision_cost.py: C_TRAFFIC, each compute dtype's), 319 GB -- 2.96 TB/s, 0.62 of the line rate.
# One kernel per op: reductions, casts between fp32 and bf16, strided (transposed) rotary
# operands and short kernels with their ramp and tail keep eager kernels below a copy's rate.
_H200_EAGER = ("calibrated on the measured H200 rows (../shared/data/gpu_h200_2026-11.md): "
               "eager - compiled step = 0.0890 s = counted eager traffic at 0.62 of 4.8 TB/s "
               "- fused traffic at 0.85")
_RESERVED = ("CUDA context ~0.5 GiB + NCCL buffers and cuBLAS workspaces ~1 GiB + allocator "
             "slack; assumption: 2 GiB per GPU not available to the model")


@dataclass(frozen=True)
class CpuProfile:
    """Measured rates of this machine (see :mod:`meshlm.planner.calibrate`).

    Per thread count of one process: GEMM FLOP/s per dtype, memory bandwidth of an allocating
    elementwise op per tensor size (cache-resident tensors are faster; large fresh ones pay
    page faults), causal SDPA FLOP/s, and the seconds per fp32 logit of cross-entropy
    forward + backward.
    """

    cores: int
    peak: dict[str, dict[int, float]]  # dtype -> threads -> best n^3 matmul FLOP/s (MFU)
    gemm: dict[str, dict[int, float]]  # dtype -> threads -> linear-layer fwd+bwd FLOP/s
    mem_bw: dict[int, dict[int, float]]  # threads -> tensor bytes -> bytes/s
    attn: dict[int, dict[int, float]]  # threads -> head dim -> FLOP/s of causal SDPA fwd+bwd
    ce: dict[int, float]  # threads -> seconds per logit element (cross-entropy fwd+bwd)
    ce_tp: dict[int, float]  # the same for meshlm's vocab-parallel cross-entropy
    adam: dict[int, float]  # threads -> seconds per parameter (clip + foreach AdamW + zero)
    op_overhead: float  # seconds per eager aten op (dispatch + autograd bookkeeping)
    # op -> group size -> (latency s, bytes/s); bytes are the comm log's (full buffer)
    collectives: dict[str, dict[int, tuple[float, float]]]
    source: str = ""
    # the same as ``adam`` with torch's fused AdamW (meshlm's default); empty: ``adam`` scaled
    # by the kernels' bytes per parameter (``timing.ADAMW_BYTES``)
    adam_fused: dict[int, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cores": self.cores,
            "peak": {d: {str(k): v for k, v in r.items()} for d, r in self.peak.items()},
            "gemm": {d: {str(k): v for k, v in r.items()} for d, r in self.gemm.items()},
            "mem_bw": {str(t): {str(k): v for k, v in r.items()} for t, r in self.mem_bw.items()},
            "attn": {str(t): {str(k): v for k, v in r.items()} for t, r in self.attn.items()},
            "ce": {str(k): v for k, v in self.ce.items()},
            "ce_tp": {str(k): v for k, v in self.ce_tp.items()},
            "adam": {str(k): v for k, v in self.adam.items()},
            "adam_fused": {str(k): v for k, v in self.adam_fused.items()},
            "op_overhead": self.op_overhead,
            "collectives": {op: {str(n): list(v) for n, v in by_n.items()}
                            for op, by_n in self.collectives.items()},
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CpuProfile:
        return cls(
            cores=int(d["cores"]),
            peak={dt: {int(k): float(v) for k, v in r.items()} for dt, r in d["peak"].items()},
            gemm={dt: {int(k): float(v) for k, v in r.items()} for dt, r in d["gemm"].items()},
            mem_bw={int(t): {int(k): float(v) for k, v in r.items()}
                    for t, r in d["mem_bw"].items()},
            attn={int(t): {int(k): float(v) for k, v in r.items()} for t, r in d["attn"].items()},
            ce={int(k): float(v) for k, v in d["ce"].items()},
            ce_tp={int(k): float(v) for k, v in d["ce_tp"].items()},
            adam={int(k): float(v) for k, v in d["adam"].items()},
            op_overhead=float(d["op_overhead"]),
            collectives={op: {int(n): (float(v[0]), float(v[1])) for n, v in by_n.items()}
                         for op, by_n in d["collectives"].items()},
            source=str(d.get("source", "")),
            adam_fused={int(k): float(v) for k, v in d.get("adam_fused", {}).items()},
        )


@dataclass(frozen=True)
class Rates:
    """What one rank achieves: FLOP/s per dtype for GEMMs and attention, memory bandwidth by
    tensor size, cross-entropy cost per logit (CPU; None: bandwidth-bound), op overhead."""

    gemm: dict[str, float]
    attn: dict[int, float]  # head dim -> FLOP/s (one entry on a GPU)
    mem_bw: dict[int, float]  # tensor bytes -> bytes/s (one entry on a GPU)
    op_overhead: float
    serial_ops: bool  # CPU: op overhead adds to compute; GPU: launches hide behind kernels
    ce: float | None = None
    ce_tp: float | None = None  # vocab-parallel cross-entropy (CPU, measured)
    adam: float | None = None  # seconds per parameter (CPU, measured); None: bandwidth-bound
    adam_fused: float | None = None  # the same with the fused AdamW (CPU, when measured)
    eager_scale: float = 1.0  # eager memory-bound kernels' bandwidth / ``mem_bw`` (GPU)
    sgemm: float = 0.0  # FLOP/s of an fp32 GEMM without TF32 (GPU; 0: ``gemm["fp32"]``)

    def bandwidth(self, nbytes: float) -> float:
        """Bandwidth for tensors of ``nbytes`` (log-linear between measured sizes)."""
        return _interpolate(self.mem_bw, nbytes)

    def attention(self, head_dim: int) -> float:
        """Fused attention FLOP/s at this head dimension (log-linear between measured ones)."""
        return _interpolate(self.attn, head_dim)


def _interpolate(table: dict[int, float], x: float) -> float:
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    for lo, hi in zip(keys, keys[1:], strict=False):
        if x <= hi:
            w = math.log(x / lo) / math.log(hi / lo)
            return table[lo] ** (1 - w) * table[hi] ** w
    return table[keys[-1]]


@dataclass(frozen=True)
class Accelerator:
    """One accelerator type and the cluster it sits in (GPUs per node, links)."""

    name: str
    description: str
    peak: dict[str, float]  # dense FLOP/s per dtype
    gemm_eff: dict[str, float]  # achievable fraction of peak for large GEMMs, per dtype
    attn_eff: float
    memory: float  # bytes per GPU
    hbm_bw: float  # bytes/s
    hbm_eff: float = 0.85
    # achieved / line rate of eager PyTorch's memory-bound kernels (one kernel per op, the
    # traffic counted by ``precision_cost``'s ``C_TRAFFIC``); 0: ``hbm_eff``. Calibrated where measured.
    eager_eff: float = 0.0
    # FP32 on the CUDA cores (FLOP/s): torch's fp32 matmuls when TF32 is off, its default
    # (``torch.backends.cuda.matmul.allow_tf32 = False``); ``peak["fp32"]`` is TF32's. 0: that.
    peak_fp32_simt: float = 0.0
    gpus_per_node: int = 8
    intra_bw: float = 0.0  # bytes/s per GPU per direction
    inter_bw: float = 0.0
    intra_eff: float = 0.75
    inter_eff: float = 0.75
    coll_latency: float = 8.4e-6  # s per collective
    intra_step_latency: float = 3.4e-6  # s per ring step
    inter_step_latency: float = 14e-6
    launch: float = 5e-6
    overlap: bool = True  # collectives run beside compute (separate streams / SMs)
    reserved: float = 2 * GIB
    tdp: float = 0.0  # W, the board power the peaks and gemm_eff were measured at (0: unknown)
    power: float = 0.0  # W, a power cap below ``tdp`` (0: none)
    cpu: CpuProfile | None = None
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def is_cpu(self) -> bool:
        return self.cpu is not None

    def peak_flops(self, dtype: str) -> float:
        """Datasheet peak for ``dtype`` (fp8 falls back to 16-bit where there is none)."""
        if dtype in self.peak:
            return self.peak[dtype]
        return self.peak["fp16" if dtype == "fp8" else "bf16"]

    @property
    def power_scale(self) -> float:
        """Sustained compute rate under ``power`` relative to ``tdp``: ``(power / tdp) **
        POWER_EXPONENT`` (tensor-core work is power-bound; see ``POWER_EXPONENT``)."""
        if not self.tdp or not self.power or self.power >= self.tdp:
            return 1.0
        return (self.power / self.tdp) ** POWER_EXPONENT

    def rates(self, procs: int = 1, threads: int = 1) -> Rates:
        """Per-rank rates with ``procs`` ranks of ``threads`` threads on one node (CPU)."""
        if self.cpu is None:
            cap = self.power_scale
            gemm = {d: self.peak_flops(d) * self.gemm_eff.get(d, self.gemm_eff["bf16"]) * cap
                    for d in DTYPES}
            # attn_eff is quoted in FlashAttention's FLOP convention (backward = 2.5 forwards);
            # the time model counts forward + backward as 3 forwards: the same seconds
            attn = self.peak_flops("bf16") * self.attn_eff * cap * 3 / (1 + FA_BWD_FLOPS)
            return Rates(gemm, {1: attn},
                         {1: self.hbm_bw * self.hbm_eff}, self.launch, serial_ops=False,
                         eager_scale=(self.eager_eff or self.hbm_eff) / self.hbm_eff,
                         sgemm=(self.peak_fp32_simt or self.peak_flops("fp32"))
                         * self.gemm_eff["fp32"] * cap)
        c = self.cpu
        t = threads
        # Time-sharing: ranks x threads above the core count share the cores evenly.
        share = min(1.0, c.cores / max(1, procs * t))
        gemm = {d: _nearest(r, t) * share for d, r in c.gemm.items()}
        gemm.setdefault("bf16", gemm["fp32"])
        gemm.setdefault("fp16", gemm["bf16"])
        # meshlm's float8 matmuls on a CPU are torchao's emulation: float8 operands
        # dequantised and multiplied in fp32 (parallel/float8.py)
        gemm.setdefault("fp8", gemm["fp32"])
        # Ranks on cores of their own do not slow each other measurably (tiny, 2 ranks of 8
        # sequences vs 1: +7 %): memory-bound work here is bounded by page faults of fresh
        # buffers, a per-core cost, more than by shared DRAM bandwidth. So a rank gets its
        # single-process rate, time-shared when ranks outnumber cores.
        bw = {size: v * share for size, v in _nearest(c.mem_bw, t).items()}
        attn = {hd: r * share for hd, r in _nearest(c.attn, t).items()}
        return Rates(gemm, attn, bw, c.op_overhead / share, serial_ops=True,
                     ce=_nearest(c.ce, t) / share, ce_tp=_nearest(c.ce_tp, t) / share,
                     adam=_nearest(c.adam, t) / share,
                     adam_fused=(_nearest(c.adam_fused, t) / share if c.adam_fused else None))

    def with_(self, **changes: Any) -> Accelerator:
        return replace(self, **changes)


# FlashAttention's backward recomputes the scores: 5 matmuls to the forward's 2, so its
# benchmarks count backward FLOPs as 2.5 forwards (flash-attention's
# benchmarks/benchmark_flash_attention.py, ``flops(..., mode="bwd")``; FlashAttention-2 paper,
# sec. 4.1) -- the convention of every published attention efficiency (``attn_eff``).
FA_BWD_FLOPS = 2.5


def _nearest(table: dict[int, float], key: int) -> float:
    """Value at ``key``, else at the closest measured key."""
    if key in table:
        return table[key]
    return table[min(table, key=lambda k: (abs(k - key), k))]


# ---------------------------------------------------------------------- the catalogue
def _gpu(name: str, description: str, bf16: float, fp8: float | None, fp32: float,
         mem_gib: float, hbm_tbps: float, intra_gbps: float, inter_gbps: float,
         gemm_bf16: float, gemm_fp8: float | None, attn: float,
         sources: dict[str, str], **kw: Any) -> Accelerator:
    peak = {"bf16": bf16 * T, "fp16": bf16 * T, "fp32": fp32 * T}
    eff = {"bf16": gemm_bf16, "fp16": gemm_bf16, "fp32": gemm_bf16}
    if fp8 is not None:
        peak["fp8"] = fp8 * T
        eff["fp8"] = gemm_fp8 if gemm_fp8 is not None else gemm_bf16
    common = {"hbm_eff": _HBM_EFF, "intra_eff/inter_eff": _NCCL_EFF, "latency": _NCCL_LAT,
              "launch": _LAUNCH, "reserved": _RESERVED}
    return Accelerator(name, description, peak, eff, attn, mem_gib * GIB, hbm_tbps * T,
                       intra_bw=intra_gbps * GBPS, inter_bw=inter_gbps * GBPS,
                       sources={**common, **sources}, **kw)


_A100_SRC = {
    "peak": "NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 312 TFLOPS dense, "
            "TF32 156 TFLOPS, FP32 (CUDA cores) 19.5; no FP8",
    "links": "A100 datasheet: NVLink 600 GB/s bidirectional (300 per direction); DGX A100 "
             "datasheet: 8x ConnectX-6 HDR 200 Gb/s for compute = 25 GB/s per GPU",
    "gemm_eff": f"{_MAMF}: A100 SXM 271.2 / 312 TFLOPS = 0.869",
    "attn_eff": "FlashAttention-2 (Dao 2023, fig. 4): causal fwd+bwd 50-73 % of A100 peak; "
                "0.55 for causal head-dim 64-128 at 2k-8k tokens (low end of that range)",
}
_H100_SRC = {
    "peak": "NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 989 TFLOPS dense "
            "(1979 with sparsity), FP8 1979 dense, TF32 495, FP32 (CUDA cores) 67 (PCIe: 51)",
    "links": "H100 datasheet: NVLink 4 900 GB/s bidirectional (450 per direction); DGX H100: "
             "8x ConnectX-7 400 Gb/s = 50 GB/s per GPU",
    "gemm_eff": f"{_MAMF}: H100 SXM BF16 794.5 / 989 = 0.803, FP8 1402.6 / 1979 = 0.709",
    "attn_eff": "FlashAttention-3 (Shah et al. 2024, figs. 4-6, H100 SXM5, head dim 128): "
                "FlashAttention-2 (PyTorch SDPA's CUDA flash backend) runs causal forward at "
                "298 TFLOP/s and backward at 291 at 2k tokens (333 / 318 at 8k); forward + "
                "backward in FlashAttention's convention 3.5 / (1/298 + 2.5/291) = 293 TFLOP/s "
                "= 0.30 of peak (the paper's '35 %' is the forward's best)",
}

CATALOGUE: dict[str, Accelerator] = {
    "a100-40gb": _gpu(
        "a100-40gb", "NVIDIA A100 SXM4 40GB (DGX A100 node)", 312, None, 156, 40, 1.555,
        300, 25, 0.869, None, 0.55,
        {**_A100_SRC, "memory": "A100 datasheet: 40 GB HBM2, 1555 GB/s"}, tdp=400.0,
        peak_fp32_simt=19.5 * T),
    "a100-80gb": _gpu(
        "a100-80gb", "NVIDIA A100 SXM4 80GB (DGX A100 node)", 312, None, 156, 80, 2.039,
        300, 25, 0.869, None, 0.55,
        {**_A100_SRC, "memory": "A100 datasheet: 80 GB HBM2e, 2039 GB/s"}, tdp=400.0,
        peak_fp32_simt=19.5 * T),
    "h100-sxm": _gpu(
        "h100-sxm", "NVIDIA H100 SXM5 80GB (DGX H100 node)", 989, 1979, 495, 80, 3.35,
        450, 50, 0.803, 0.709, 0.30,
        {**_H100_SRC, "memory": "H100 datasheet: 80 GB HBM3, 3.35 TB/s"}, tdp=700.0,
        peak_fp32_simt=67 * T),
    "h100-sxm-500w": _gpu(
        "h100-sxm-500w", "NVIDIA H100 SXM 96GB HBM2e at 500 W (Meta Grand Teton)", 989, 1979,
        495, 96, 2.41, 450, 50, 0.803, 0.709, 0.30,
        {**_H100_SRC, "power": _POWER,
         "memory": "96 GB HBM2e; 2.41 TB/s, the HBM2e H100's bandwidth in Ujeniya et al. "
                   "2026 (arXiv:2604.11391, setup); consistent with 6 HBM2e stacks where the "
                   "PCIe card's 5 give 2.0 TB/s",
         "variant": "torchtitan (Liang et al. 2024): H100 with 96 GB HBM2e and a 500 W TDP, "
                    "400 Gb/s RDMA per GPU"},
        tdp=700.0, power=500.0, peak_fp32_simt=67 * T),
    "h100-pcie": _gpu(
        "h100-pcie", "NVIDIA H100 PCIe 80GB (8 per node over PCIe Gen5)", 756, 1513, 378, 80,
        2.0, 64, 50, 0.661, None, 0.30,
        {**_H100_SRC,
         "peak": "H100 datasheet (PCIe): BF16 756 TFLOPS dense, FP8 1513, TF32 378",
         "memory": "H100 datasheet (PCIe): 80 GB HBM2e, 2.0 TB/s",
         "links": "PCIe Gen5 x16: 64 GB/s per direction (NVLink bridges join pairs only); "
                  "network assumed 400 Gb/s per GPU",
         "gemm_eff": "mag-/gpu_benchmark README (mamf-finder.py): H100 PCIe 499.5 / 756 = "
                     "0.661"}, tdp=350.0, peak_fp32_simt=51 * T),
    "h800": _gpu(
        "h800", "NVIDIA H800 SXM5 80GB (export H100: NVLink 400 GB/s)", 989, 1979, 495, 80, 3.35,
        200, 50, 0.803, 0.709, 0.30,
        {**_H100_SRC, "memory": "H800 = H100 SXM5 die: 80 GB HBM3, 3.35 TB/s",
         "links": "NVLink 400 GB/s bidirectional (200 per direction); DeepSeek-V3 report "
                  "(2024, sec. 3.2.2): IB 50 GB/s per GPU, NVLink 160 GB/s achievable",
         "gemm_eff": f"{_MAMF}: H100 SXM values (same die; no H800 measurement)"}, tdp=700.0,
        peak_fp32_simt=67 * T),
    "h200": _gpu(
        "h200", "NVIDIA H200 SXM 141GB (HGX H200 node)", 989, 1979, 495, 139.8, 4.8,
        450, 50, 0.803, 0.734, 0.30,
        {**_H100_SRC, "memory": "H200 datasheet: 141 GB HBM3e, 4.8 TB/s; capacity as the device "
                               "reports it (torch.cuda.get_device_properties: 139.8 GiB, "
                               "meshlm's H200 run of 2026-11)",
         "gemm_eff": f"{_MAMF}: 'H200 is the same' as H100 for BF16 (0.803); FP8 "
                     "1453.4 / 1979 = 0.734",
         "eager_eff": _H200_EAGER}, tdp=700.0, eager_eff=0.62, peak_fp32_simt=67 * T),
    "b200": _gpu(
        "b200", "NVIDIA B200 180GB (DGX B200 node)", 2250, 4500, 1100, 180, 8.0,
        900, 50, 0.776, 0.763, 0.30,
        {"peak": "DGX B200 datasheet: 72 PFLOPS FP8 training / 8 GPUs with sparsity -> 4.5 "
                 "PFLOPS FP8 and 2.25 PFLOPS BF16 dense per GPU",
         "memory": "DGX B200 datasheet: 1440 GB HBM3e, 64 TB/s per 8 GPUs",
         "links": "NVLink 5 1.8 TB/s bidirectional (900 per direction); DGX B200: 8x "
                  "ConnectX-7 400 Gb/s = 50 GB/s per GPU",
         "gemm_eff": f"{_MAMF}: B200 SXM BF16 1745 / 2250 = 0.776, FP8 3432.5 / 4500 = 0.763",
         "attn_eff": "no published FlashAttention-2 utilisation on B200; H100's 0.30 assumed"},
        tdp=1000.0),
    "mi300x": _gpu(
        "mi300x", "AMD Instinct MI300X 192GB (8 per node, Infinity Fabric)", 1307.4, 2614.9,
        653.7, 192, 5.3, 448, 50, 0.514, None, 0.30,
        {"peak": "AMD Instinct MI300X datasheet: BF16 1307.4 TFLOPS dense, FP8 2614.9",
         "memory": "MI300X datasheet: 192 GB HBM3, 5.3 TB/s",
         "links": "MI300X datasheet: 896 GB/s aggregate peer-to-peer Infinity Fabric "
                  "(448 per direction); network assumed 400 Gb/s per GPU",
         "gemm_eff": f"{_MAMF}: MI300X 668.4 / 1300 = 0.514 (ROCm 6.3, TunableOp)",
         "attn_eff": "no like-for-like FlashAttention-2 figure; H100's 0.30 assumed"},
        tdp=750.0),
}

# The shipped `cpu` entry: `meshlm plan --calibrate` on the project's CI machine (2-core Xeon
# with AVX-512, torch 2.13 CPU). Recalibrate on any other machine.
MIB = 2**20
DEFAULT_CPU = CpuProfile(
    cores=2,
    peak={"fp32": {1: 178e9, 2: 356e9}, "bf16": {1: 1.41e12, 2: 1.40e12}},
    gemm={"fp32": {1: 158e9, 2: 306e9}, "bf16": {1: 0.85e12, 2: 1.63e12}},
    mem_bw={1: {MIB: 13.8e9, 4 * MIB: 14.1e9, 16 * MIB: 13.5e9, 64 * MIB: 5.6e9},
            2: {MIB: 27.3e9, 4 * MIB: 26.2e9, 16 * MIB: 25.1e9, 64 * MIB: 9.1e9}},
    attn={1: {8: 15.8e9, 32: 36.2e9, 128: 42.9e9}, 2: {8: 29.6e9, 32: 62.2e9, 128: 85.0e9}},
    ce={1: 6.0e-9, 2: 3.5e-9},
    ce_tp={1: 6.7e-9, 2: 3.6e-9},
    adam={1: 4.5e-9, 2: 2.4e-9},
    op_overhead=3.0e-6,
    # collectives timed as a step issues them (fresh buffers, between computation), 2026-11-25,
    # on a 2-core AMD EPYC
    collectives={
        "all_reduce": {2: (2.34e-3, 1.38e9), 4: (7.45e-3, 0.75e9)},
        "all_gather": {2: (0.93e-3, 1.53e9), 4: (5.30e-3, 0.86e9)},
        "reduce_scatter": {2: (1.41e-3, 1.03e9), 4: (7.59e-3, 0.75e9)},
        "all_to_all": {2: (0.23e-3, 2.33e9), 4: (2.78e-3, 1.39e9)},
    },
    source="meshlm plan --calibrate on the project CI machine (2-core Xeon with AVX-512 and "
           "AMX-BF16, torch 2.13.0+cpu), 2026-11-22, mean of two calibrations; collectives "
           "(in a step's pattern, all-to-all added) on a 2-core AMD EPYC, 2026-11-25",
)


def cpu_accelerator(profile: CpuProfile) -> Accelerator:
    """The ``cpu`` entry built from measured rates: one 'node' holding every local rank."""
    return Accelerator(
        "cpu", f"this machine's CPU ({profile.cores} cores), gloo over loopback",
        peak={d: max(r.values()) for d, r in profile.peak.items()},
        gemm_eff={"fp32": 1.0, "bf16": 1.0}, attn_eff=1.0,
        memory=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        if hasattr(os, "sysconf") else 8 * GIB,
        hbm_bw=max(max(r.values()) for r in profile.mem_bw.values()), hbm_eff=1.0, gpus_per_node=1 << 30,
        overlap=False, reserved=0.0, cpu=profile,
        sources={"rates": profile.source,
                 "overlap": "gloo runs its transport on the same cores as compute: no overlap",
                 "memory": "physical memory of this machine (os.sysconf)"},
    )


def calibration_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "meshlm" / "cpu_calibration.json"


def load_cpu(path: str | Path | None = None) -> Accelerator:
    """The ``cpu`` entry: from ``path``, else the stored calibration, else the shipped default."""
    p = Path(path).expanduser() if path else calibration_path()
    if p.is_file():
        try:
            return cpu_accelerator(CpuProfile.from_dict(json.loads(p.read_text())))
        except (KeyError, ValueError, TypeError) as e:
            raise ConfigError(f"CPU calibration {str(p)!r} is unreadable ({e}); "
                              "rerun meshlm plan --calibrate") from None
    if path:
        raise ConfigError(f"CPU calibration file {str(p)!r} does not exist")
    return cpu_accelerator(DEFAULT_CPU)


_TOML_FIELDS = {
    "peak_bf16": ("peak", "bf16", T), "peak_fp16": ("peak", "fp16", T),
    "peak_fp8": ("peak", "fp8", T), "peak_fp32": ("peak", "fp32", T),
    "memory_gb": ("memory", None, 1e9), "memory_gib": ("memory", None, GIB),
    "hbm_tbps": ("hbm_bw", None, T), "intra_gbps": ("intra_bw", None, GBPS),
    "inter_gbps": ("inter_bw", None, GBPS), "power_w": ("power", None, 1.0),
    "tdp_w": ("tdp", None, 1.0),
}


def accelerator_from_toml(path: Path) -> Accelerator:
    """A user-described accelerator: ``base`` entry plus overridden fields (see module doc)."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--gpu {str(path)!r} is not valid TOML: {e}") from None
    data = dict(data.get("hardware", data))
    base_name = str(data.pop("base", "h100-sxm"))
    if base_name not in CATALOGUE:
        raise ConfigError(f"--gpu {str(path)!r}: base={base_name!r} is not in the catalogue "
                          f"({', '.join(CATALOGUE)})")
    hw = CATALOGUE[base_name]
    changes: dict[str, Any] = {"name": str(data.pop("name", path.stem)),
                               "sources": {**hw.sources, "user": f"values from {path}"}}
    peak, eff = dict(hw.peak), dict(hw.gemm_eff)
    for key, value in data.items():
        if key in _TOML_FIELDS:
            attr, sub, scale = _TOML_FIELDS[key]
            if attr == "peak":
                peak[sub] = float(value) * scale
            else:
                changes[attr] = float(value) * scale
        elif key.startswith("gemm_eff_"):
            eff[key.removeprefix("gemm_eff_")] = float(value)
        elif key in Accelerator.__dataclass_fields__ and key not in ("cpu", "sources"):
            changes[key] = type(getattr(hw, key))(value)
        else:
            raise ConfigError(f"--gpu {str(path)!r}: unknown field {key!r}")
    return hw.with_(peak=peak, gemm_eff=eff, **changes)


def get_accelerator(kind: str, calibration: str | Path | None = None) -> Accelerator:
    """A catalogue name (``h100-sxm``, ``cpu``, ...) or a TOML file describing one."""
    key = kind.lower()
    if key == "cpu":
        return load_cpu(calibration)
    if key in CATALOGUE:
        return CATALOGUE[key]
    path = Path(kind).expanduser()
    if path.suffix == ".toml" and path.is_file():
        return accelerator_from_toml(path)
    raise ConfigError(f"--gpu {kind!r} is not in the catalogue ({', '.join([*CATALOGUE, 'cpu'])})"
                      " nor a TOML file")
