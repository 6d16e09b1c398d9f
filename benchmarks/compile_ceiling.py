"""How much `train.compile` can speed up a step on this CPU: the step split by kernel, and levers.

Compilation fuses the elementwise work of a block (RMSNorm, rotary, SiLU gate, residual adds,
log-softmax); it does not change the matrix multiplications (inductor calls the same BLAS
``mm`` on CPU) nor the fused CPU flash-attention kernel. So if eager spends a share ``f`` of
its step in those two, no compilation can make the step faster than ``1 / f``. This script
measures ``f`` with ``torch.profiler`` (self CPU time per ATen op, summed over a few steps of
the eager and the compiled trainer), then times the two trainers alternating step by step.

Two levers that act on the matmul and attention share are measured too:

- ``--gemm``: each of the step's linear shapes (forward + both backward matmuls) eager, compiled
  by default, and compiled with ``max_autotune`` over the ``CPP,ATEN`` GEMM backends (in torch
  2.13 the C++ template needs a constant weight, so training matmuls stay ATen's ``mm``);
- ``--chunked-attention``: a third trainer, compiled, whose attention is written as matmuls and
  a softmax over query chunks that skip the keys above the diagonal (8 chunks: 56 % of the
  dense score FLOPs), which inductor fuses instead of the CPU flash kernel.

``--malloc-keep`` runs every side with freed memory kept in the process (``run.malloc_keep``):
no buffer is faulted in afresh, so what is left of the speed-up is the fusion's own.

    python benchmarks/compile_ceiling.py [--preset small] [--batch 8] [--steps 10]
        [--rounds 3] [--gemm] [--chunked-attention] [--malloc-keep]
        [--json benchmarks/results/compile_ceiling.json]

Single process: no communication. Memory: two (three) trainers of the preset in one process.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from meshlm.config import load_config
from meshlm.models import llama
from meshlm.train.trainer import Trainer, keep_freed_memory

MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::matmul")
ATTENTION_MARK = "scaled_dot_product"


def classify(name: str) -> str:
    """Kernel class of a profiler row: ``matmul``, ``attention`` or ``other``."""
    if name in MATMUL_OPS:
        return "matmul"
    if ATTENTION_MARK in name:
        return "attention"
    return "other"


def split_by_kernel(rows: list[tuple[str, float]]) -> dict[str, float]:
    """Self time (any unit) per kernel class, and each class's share of the total."""
    out = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for name, self_time in rows:
        out[classify(name)] += self_time
    total = sum(out.values())
    return {**out, "total": total,
            **{f"{k}_share": (v / total if total else 0.0) for k, v in list(out.items())}}


def profile_steps(trainer: Trainer, start: int, steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(start, start + steps):
            trainer.train_step(step)
    rows = [(e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()]
    split = split_by_kernel(rows)
    per_step = {k: split[k] / steps for k in ("matmul", "attention", "other")}
    shares = {k: v for k, v in split.items() if k.endswith("_share")}
    return {**per_step, **shares, "total": split["total"],
            "total_per_step_s": split["total"] / steps}


def chunked_core(self: llama.Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 chunks: int = 8) -> torch.Tensor:
    """Causal grouped-query attention as matmuls + softmax, query chunk by query chunk: chunk
    ``i`` sees only the keys up to its end (the dense scores' upper blocks are never formed)."""
    b, nh, s, hd = q.shape
    nkv = k.shape[1]
    g, c = nh // nkv, s // chunks
    qg = q.view(b, nkv, g, s, hd).transpose(2, 3).reshape(b, nkv, s * g, hd)  # rows (pos, group)
    outs = []
    for i in range(chunks):
        keys = (i + 1) * c
        scores = qg[:, :, i * c * g:(i + 1) * c * g] @ k[:, :, :keys].transpose(-1, -2)
        pos = torch.arange(c * g, device=q.device) // g + i * c
        mask = torch.arange(keys, device=q.device)[None, :] <= pos[:, None]
        p = F.softmax(scores.mul(1 / math.sqrt(hd)).masked_fill(~mask, float("-inf")), -1)
        outs.append(p @ v[:, :, :keys])
    out = torch.cat(outs, 2).view(b, nkv, s, g, hd).transpose(2, 3)
    return out.reshape(b, nh, s, hd)


def gemm_rows(cfg, tokens: int, reps: int = 10) -> list[dict]:  # noqa: ANN001
    """fwd + bwd GFLOP/s of each linear shape: eager, compiled, compiled with max-autotune."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    shapes = {"wq / wo": (cfg.n_heads * cfg.hd, cfg.dim), "wk / wv": (cfg.n_kv_heads * cfg.hd,
              cfg.dim), "w1 / w3": (cfg.ffn_hidden, cfg.dim), "w2": (cfg.dim, cfg.ffn_hidden),
              "head": (cfg.vocab_size, cfg.dim)}
    rows = []
    for name, (n, k) in shapes.items():
        x = torch.randn(tokens, k, requires_grad=True)
        w = torch.randn(n, k, requires_grad=True)
        dy = torch.randn(tokens, n)
        row = {"shape": name, "n": n, "k": k}
        for mode in ("eager", "compiled", "max_autotune"):
            torch._dynamo.reset()
            inductor_config.max_autotune = mode == "max_autotune"
            inductor_config.max_autotune_gemm_backends = "CPP,ATEN"
            fn = F.linear if mode == "eager" else torch.compile(F.linear, dynamic=False)

            def fwd_bwd(fn=fn, x=x, w=w, dy=dy) -> None:  # noqa: ANN001
                x.grad = w.grad = None
                fn(x, w).backward(dy)

            for _ in range(3):
                fwd_bwd()
            t0 = time.perf_counter()
            for _ in range(reps):
                fwd_bwd()
            row[mode] = 3 * 2 * tokens * n * k * reps / (time.perf_counter() - t0) / 1e9
        rows.append(row)
    inductor_config.max_autotune = False
    torch._dynamo.reset()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--gemm", action="store_true", help="also time each linear shape")
    ap.add_argument("--chunked-attention", action="store_true",
                    help="also a compiled trainer with chunked matmul attention")
    ap.add_argument("--malloc-keep", action="store_true",
                    help="keep freed memory in the process (run.malloc_keep): no page faults")
    ap.add_argument("--json", default="benchmarks/results/compile_ceiling.json")
    args = ap.parse_args()
    if args.malloc_keep:
        keep_freed_memory()
    root = Path(tempfile.mkdtemp(prefix="meshlm-ceiling-"))

    def trainer_of(name: str, compiled: bool) -> Trainer:
        cfg = load_config(None, [
            f"--model.preset={args.preset}", f"--data.seq_len={args.seq}",
            f"--train.global_batch={args.batch}", f"--train.micro_batch={args.batch}",
            f"--train.steps={10**6}", "--train.eval_every=0", f"--run.dir={root / name}",
            "--run.sample_tokens=0", f"--train.compile={str(compiled).lower()}"])
        return Trainer(cfg, log=lambda _m: None, progress=False)

    sides = {"eager": trainer_of("eager", False), "compiled": trainer_of("compiled", True)}
    for step in (1, 2, 3):  # warm-up; the compiled side compiles in its first step
        for trainer in sides.values():
            trainer.train_step(step)
    if args.chunked_attention:  # the instances' core, set before its first (tracing) call
        chunked = trainer_of("chunked", True)
        for block in chunked.model_part.model.layers.values():
            block.attention.core = types.MethodType(chunked_core, block.attention)
        for step in (1, 2, 3):
            chunked.train_step(step)
        sides["compiled, chunked attention"] = chunked

    times: dict[str, list[float]] = {name: [] for name in sides}
    step = 4
    for _ in range(args.rounds):
        for _ in range(args.steps):
            for name, trainer in sides.items():
                t0 = time.perf_counter()
                trainer.train_step(step)
                times[name].append(time.perf_counter() - t0)
            step += 1
    profiles = {name: profile_steps(trainer, step, args.profile_steps)
                for name, trainer in sides.items()}

    eager = statistics.median(times["eager"])
    rows = []
    for name in sides:
        med, prof = statistics.median(times[name]), profiles[name]
        rows.append({"side": name, "step_time_s": med, "speedup_vs_eager": eager / med, **prof})
    ceiling = 1 / (profiles["eager"]["matmul_share"] + profiles["eager"]["attention_share"])
    print(f"{args.preset}, batch {args.batch} x {args.seq}, fp32, {torch.get_num_threads()} "
          f"thread(s); median of {args.rounds} x {args.steps} alternating steps; per-kernel self "
          f"time from {args.profile_steps} profiled steps")
    print("| side | step (s) | vs eager | matmul (s) | attention (s) | other (s) | other share |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['side']} | {r['step_time_s']:.4f} | {r['speedup_vs_eager']:.3f}x | "
              f"{r['matmul']:.4f} | {r['attention']:.4f} | {r['other']:.4f} | "
              f"{100 * r['other_share']:.1f} % |")
    print(f"ceiling of compilation (eager step / its matmul + attention time): {ceiling:.3f}x")
    result = {"config": vars(args), "threads": torch.get_num_threads(), "rows": rows,
              "ceiling": ceiling}
    if args.gemm:
        gemm = gemm_rows(sides["eager"].model_part.model_cfg, args.batch * args.seq)
        print("| linear (fwd + bwd) | n x k | eager GFLOP/s | compiled | max-autotune |")
        print("|---|---|---:|---:|---:|")
        for r in gemm:
            print(f"| {r['shape']} | {r['n']} x {r['k']} | {r['eager']:.1f} | "
                  f"{r['compiled']:.1f} | {r['max_autotune']:.1f} |")
        result["gemm"] = gemm
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
