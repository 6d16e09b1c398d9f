"""The routed experts of one MoE layer, forward + backward: the per-expert Python loop meshlm ran
before issue 49 against the grouped GEMM (``torch._grouped_mm``) and the padded-``bmm``
fallback of ``models/moe.py``.

Each case routes ``--tokens`` tokens to ``k`` of ``E`` experts (a random router: each token
picks k distinct experts uniformly), sorts the copies by expert as the layer does, and times
the expert computation alone -- ``GroupedExperts`` on the sorted copies -- forward, then
backward of a fixed output gradient, one thread, fp32. The median over ``--repeats`` runs
after a warm-up counts. Every implementation's output and gradients (input, w1, w3, w2) are
compared with the loop's: ``max rel diff`` is the largest ``max |a - b| / max |b|`` of them.

Cases (hidden ``--dim`` 512, expert width ``--ffn`` 256, top-8 as DeepSeek-V3 and Qwen3-MoE):
``64 x 4096`` (64 experts, 4,096 tokens; the default) and ``256 x 8192`` (``--cases``: the
loop alone takes about 85 s per run on one core there); ``--tiny`` runs 8 experts x 64
tokens of dim 64 (a test's smoke run).

The loop (kept here as the baseline, as ``models/moe.py`` had it) runs one matmul chain per
expert on its slice and indexes each expert's weights with ``w[e]``: the backward of each
such index writes a full-size zero gradient of the stacked weight and adds it, E times per
weight -- the grouped GEMM writes each expert's gradient once.

    OMP_NUM_THREADS=1 python benchmarks/moe_experts.py [--cases 64x4096 [256x8192]]
        [--repeats 3] [--json benchmarks/results/moe_experts.json] [--tiny]

Single process: no communication. Memory: the layer's weights, their gradients and the
activations of ``tokens x k`` copies (the padded fallback: ``E x max rows``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from meshlm.models.moe import GroupedExperts, expert_counts, grouped_mm_supported

TOPK = 8


def loop_experts(experts: GroupedExperts, x_sorted: torch.Tensor, counts: list[int]
                 ) -> torch.Tensor:
    """meshlm's expert loop before issue 49: one matmul chain per expert, from Python."""
    outs = []
    for e, chunk in enumerate(x_sorted.split(counts)):
        hidden = F.silu(chunk @ experts.w1[e].t()) * (chunk @ experts.w3[e].t())  # (n_e, F)
        outs.append(hidden @ experts.w2[e].t())  # (n_e, H)
    return torch.cat(outs, dim=0)


def make_case(n_experts: int, tokens: int, dim: int, ffn: int, topk: int, seed: int = 0
              ) -> tuple[GroupedExperts, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts, copies sorted by expert, counts per expert, output gradient)."""
    g = torch.Generator().manual_seed(seed)
    experts = GroupedExperts(n_experts, dim, ffn)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    choice = torch.rand(tokens, n_experts, generator=g).topk(topk, dim=-1).indices  # (T, k)
    flat = choice.reshape(-1)
    order = torch.argsort(flat, stable=True)
    x = torch.randn(tokens, dim, generator=g)[order // topk]  # (T k, H) sorted by expert
    dy = torch.randn(x.shape, generator=g)
    return experts, x, expert_counts(flat, n_experts), dy


def run_once(impl: str, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor,
             dy: torch.Tensor) -> tuple[float, float, list[torch.Tensor]]:
    """(forward s, backward s, [output, dx, dw1, dw3, dw2])."""
    experts.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    t0 = time.perf_counter()
    if impl == "loop":
        y = loop_experts(experts, x, counts.tolist())
    elif impl == "grouped":
        y = experts.grouped(x, counts)
    else:
        y = experts.padded(x, counts)
    t1 = time.perf_counter()
    y.backward(dy)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, [y.detach(), x.grad, experts.w1.grad, experts.w3.grad,
                              experts.w2.grad]


def max_rel_diff(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
               for a, b in zip(got, ref, strict=True))


def measure(name: str, n_experts: int, tokens: int, dim: int, ffn: int, topk: int,
            repeats: int) -> list[dict[str, Any]]:
    experts, x, counts, dy = make_case(n_experts, tokens, dim, ffn, topk)
    impls = ["loop", "padded"] + (["grouped"] if grouped_mm_supported(x.dtype, experts.w1)
                                  else [])
    times: dict[str, list[tuple[float, float]]] = {i: [] for i in impls}
    results: dict[str, list[torch.Tensor]] = {}
    for r in range(repeats + 1):  # the first round warms up
        for impl in impls:
            fwd, bwd, res = run_once(impl, experts, x, counts, dy)
            if r:
                times[impl].append((fwd, bwd))
            results[impl] = res
    rows = []
    base = statistics.median(f + b for f, b in times["loop"])
    for impl in impls:
        fwd = statistics.median(f for f, _ in times[impl])
        bwd = statistics.median(b for _, b in times[impl])
        total = statistics.median(f + b for f, b in times[impl])
        rows.append({"case": name, "impl": impl, "experts": n_experts, "tokens": tokens,
                     "dim": dim, "ffn": ffn, "topk": topk, "forward_s": fwd, "backward_s": bwd,
                     "total_s": total, "speedup_vs_loop": base / total,
                     "max_rel_diff_vs_loop": max_rel_diff(results[impl], results["loop"]),
                     "min_rows": int(counts.min()), "max_rows": int(counts.max())})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| case | implementation | forward (s) | backward (s) | total (s) | vs loop | "
          "max rel diff vs loop |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['impl']} | {r['forward_s']:.3f} | {r['backward_s']:.3f} | "
              f"{r['total_s']:.3f} | {r['speedup_vs_loop']:.2f}x | "
              f"{r['max_rel_diff_vs_loop']:.1e} |")


CASES = {"64x4096": (64, 4096), "256x8192": (256, 8192)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["64x4096"], choices=list(CASES))
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--topk", type=int, default=TOPK)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="8 experts x 64 tokens, dim 64 (smoke)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.tiny:
        cases = {"tiny 8x64": (8, 64, 64, 32, 2)}
        repeats = 1
    else:
        cases = {c: (*CASES[c], args.dim, args.ffn, args.topk) for c in args.cases}
        repeats = args.repeats
    rows = []
    for name, (e, t, h, f, k) in cases.items():
        rows += measure(name, e, t, h, f, k, repeats)
    print_table(rows)
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": "fp32",
           "repeats": repeats, "tiny": args.tiny, "rows": rows}
    path = args.json or Path(__file__).resolve().parent / "results" / (
        "moe_experts_tiny.json" if args.tiny else "moe_experts.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
