"""bf16 against fp32 matmul on this CPU, natively and with the instruction set capped at AVX2.

A CPU without native bf16 matmul (AVX2-only x86: no AVX512-BF16 or AMX) runs
``precision.dtype=bf16`` through a slow fallback, and meshlm's start-up check warns about it
(``train/peak.py``, a 128 x 128 matmul). How much slower depends on the matrix size, so this
measures the square sizes meshlm itself times -- 128 (the start-up check), 1024 (the trainer's
CPU peak and ``meshlm plan --calibrate``) and those between -- with the same function
(:func:`meshlm.matmul_rate.measure_matmul_flops`, best call over ``--seconds``), one thread.

Each ``--isa`` runs in a process of its own, because the libraries read the cap once:
``native`` leaves them alone; ``avx2`` sets ``ATEN_CPU_CAPABILITY=avx2``,
``ONEDNN_MAX_CPU_ISA=AVX2`` (bf16 matmuls go through oneDNN) and
``MKL_ENABLE_INSTRUCTIONS=AVX2`` (fp32 matmuls through MKL): the kernels an AVX2-only CPU gets,
on this CPU's cores, caches and clock -- a stand-in for an AVX2-only machine, not one.

    OMP_NUM_THREADS=1 python benchmarks/bf16_matmul.py --json benchmarks/results/bf16_matmul.json

No communication; memory: three n x n matrices per dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ISA_ENV = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def measure(sizes: list[int], seconds: float) -> dict[str, object]:
    """This process's rates (GFLOP/s) at each size, fp32 and bf16, one thread."""
    import torch

    from meshlm.matmul_rate import measure_matmul_flops

    torch.set_num_threads(1)
    rows = []
    for n in sizes:
        fp32 = measure_matmul_flops(torch.float32, n, seconds)
        bf16 = measure_matmul_flops(torch.bfloat16, n, seconds)
        rows.append({"n": n, "fp32_gflops": fp32 / 1e9, "bf16_gflops": bf16 / 1e9,
                     "fp32_over_bf16": fp32 / bf16})
    return {"capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "rows": rows}


def run_isa(isa: str, sizes: list[int], seconds: float) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **ISA_ENV[isa]}
    out = subprocess.run([sys.executable, __file__, "--child", "--sizes", *map(str, sizes),
                          "--seconds", str(seconds)], env=env, capture_output=True, text=True,
                         check=True)
    return {"isa": isa, "env": ISA_ENV[isa], **json.loads(out.stdout.splitlines()[-1])}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--isa", nargs="+", choices=sorted(ISA_ENV), default=["native", "avx2"])
    ap.add_argument("--seconds", type=float, default=1.0, help="timing per size and dtype")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.sizes, args.seconds)))
        return
    results = [run_isa(isa, args.sizes, args.seconds) for isa in args.isa]
    print(f"{cpu_name()}, 1 thread; GFLOP/s of an n x n matmul (best call)\n")
    print("| instructions | n | fp32 GFLOP/s | bf16 GFLOP/s | fp32 / bf16 |")
    print("|---|---:|---:|---:|---:|")
    for res in results:
        for row in res["rows"]:
            print(f"| {res['isa']} ({res['capability']}) | {row['n']} | "
                  f"{row['fp32_gflops']:.1f} | {row['bf16_gflops']:.2f} | "
                  f"{row['fp32_over_bf16']:.1f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu_name(), "threads": 1, "results": results},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
