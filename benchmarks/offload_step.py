"""Host AdamW step of ``parallel.offload``: seconds per 100 M parameters, foreach vs fused.

``parallel.offload=cpu`` keeps the AdamW moments in host memory and steps them there
(``parallel/offload.py``): each chunk of weights and gradients is staged into a host buffer,
stepped, and copied back. On a GPU run the host step dominates the step time (820M on one H200:
14,389 tokens/s with offload against 60,388 without, ``shared/data/gpu_h200_2026-11.md``).
This benchmark times that host step alone, on this machine's CPU, with the two AdamW kernel
families torch offers (``train.adamw_impl``): ``foreach`` (multi-tensor: about ten passes over
memory) and ``fused`` (one vectorised pass), alternating them ``--rounds`` times (best round
counts). Staging goes CPU to CPU here (the copies a GPU run makes device to host); a
``plain`` row steps torch's own ``AdamW`` on the same tensors in place, without chunks.

    OMP_NUM_THREADS=1 python benchmarks/offload_step.py --params 100e6 \\
        --json benchmarks/results/offload_step_1t.json

No communication; memory: 16 bytes per parameter (weights, gradients, two moments) plus one
chunk of staging.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from meshlm.parallel.offload import OffloadedAdamW


def tensors(n: int, shapes: int = 16) -> list[torch.nn.Parameter]:
    """``n`` parameters in ``shapes`` equal matrices, each with a gradient."""
    g = torch.Generator().manual_seed(0)
    rows = max(1, n // shapes // 1024)
    out = []
    for _ in range(shapes):
        p = torch.nn.Parameter(torch.randn(rows, 1024, generator=g) * 0.02)
        p.grad = torch.randn(rows, 1024, generator=g) * 1e-3
        out.append(p)
    return out


def optimizer(kind: str, kernels: str, params: list[torch.nn.Parameter]):  # noqa: ANN201
    groups = [{"params": params[:-1], "weight_decay": 0.1},
              {"params": params[-1:], "weight_decay": 0.0}]
    base = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                             **{kernels: True})
    if kind == "plain":
        return base
    return OffloadedAdamW.like(base, "cpu", staged=True)


def time_steps(opt, steps: int) -> float:  # noqa: ANN001
    opt.step()  # first step: state allocation (not timed)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=100e6, help="parameters stepped")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    params = tensors(int(args.params))
    n = sum(p.numel() for p in params)
    rows: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for kind in ("offload", "plain"):
            for kernels in ("foreach", "fused"):
                s = time_steps(optimizer(kind, kernels, params), args.steps)
                key = (kind, kernels)
                rows[key] = min(rows.get(key, float("inf")), s)
    out = [{"step": kind, "kernels": kernels, "params": n, "step_s": s,
            "s_per_100m": s * 1e8 / n} for (kind, kernels), s in rows.items()]
    base = {r["step"]: r["s_per_100m"] for r in out if r["kernels"] == "foreach"}
    print(f"host AdamW step, {n / 1e6:.1f} M parameters, {torch.get_num_threads()} thread(s)")
    print("| step | kernels | s per step | s per 100 M parameters | vs foreach |")
    print("|---|---|---:|---:|---:|")
    for r in out:
        r["speedup_vs_foreach"] = base[r["step"]] / r["s_per_100m"]
        print(f"| {r['step']} | {r['kernels']} | {r['step_s']:.3f} | {r['s_per_100m']:.3f} | "
              f"{r['speedup_vs_foreach']:.2f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": out},
                                        indent=1))


if __name__ == "__main__":
    main()
