"""meshlm's single-process training step vs a plain PyTorch loop on the same model and batch.

Both sides train the same `Transformer` (same preset, seed and initial weights) on windows of
the same token memmap, with AdamW (same hyper-parameters and decay groups), gradient clipping
and a loss read back every step. The meshlm side is the trainer's own step plus its per-step
metrics record and metrics.jsonl write (everything `Trainer.fit` does per step except drawing
the progress line). A third side is the same trainer with ``train.compile=true`` (per-block
torch.compile; its compilation, in the warm-up, is reported apart). Blocks of steps alternate
between the sides so that machine noise hits all alike; the median step time decides. MFU is
against this CPU's measured fp32 (or bf16) matmul rate at the same thread count.

    python benchmarks/single_process.py [--preset small] [--steps 15] [--rounds 3]
        [--dtype fp32] [--json benchmarks/results/single_process.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from meshlm.config import load_config
from meshlm.models import build_model
from meshlm.parallel.compile import compile_stats
from meshlm.precision import DTYPES
from meshlm.train.metrics import MetricsWriter
from meshlm.train.peak import peak_flops
from meshlm.train.trainer import Trainer


def plain_loop(model, tokens, steps, batch, seq, dtype, seed, lr=3e-4):  # noqa: ANN001
    """The reference: a textbook PyTorch training loop. Returns per-step wall times."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=True,
    )
    rng = np.random.default_rng(seed)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        offsets = rng.integers(0, len(tokens) - seq - 1, size=batch)
        x = torch.from_numpy(np.stack([tokens[o : o + seq + 1] for o in offsets]).astype(np.int64))
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times


def meshlm_steps(trainer: Trainer, writer: MetricsWriter, start: int, steps: int) -> list[float]:
    times = []
    for step in range(start, start + steps):
        t0 = time.perf_counter()
        loss, grad_norm = trainer.train_step(step)
        writer.write(trainer.record(step, loss, grad_norm, time.perf_counter() - t0))
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=15, help="steps per block")
    ap.add_argument("--rounds", type=int, default=3, help="alternating blocks per side")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--json", default="benchmarks/results/single_process.json")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="meshlm-bench-"))

    def trainer_of(name: str, extra: list[str]) -> tuple[Trainer, MetricsWriter]:
        cfg = load_config(None, [
            f"--model.preset={args.preset}", f"--data.seq_len={args.seq}",
            f"--train.global_batch={args.batch}", f"--train.micro_batch={args.batch}",
            f"--train.steps={10**6}", "--train.eval_every=0", f"--precision.dtype={args.dtype}",
            f"--run.dir={root / name}", "--run.sample_tokens=0", *extra,
        ])
        return Trainer(cfg, log=lambda _m: None, progress=False), MetricsWriter(root / name)

    # the compiled trainer first: its configure_cache resets dynamo for this process
    compiled, cwriter = trainer_of("compiled", ["--train.compile=true"])
    trainer, writer = trainer_of("eager", [])
    cfg = trainer.cfg
    plain_model = build_model(trainer.model_part.model_cfg, cfg.train.seed)
    tokens, dtype = trainer.data.train_tokens, DTYPES[args.dtype]

    # Warm-up every side (allocator, thread pool, autograd caches; compilation).
    t0 = time.perf_counter()
    meshlm_steps(compiled, cwriter, 1, 1)
    compile_step_s = time.perf_counter() - t0
    compile_s = compile_stats()["compile_s"]
    meshlm_steps(compiled, cwriter, 2, 1)
    meshlm_steps(trainer, writer, 1, 2)
    plain_loop(plain_model, tokens, 2, args.batch, args.seq, dtype, 0)
    mesh_t, plain_t, comp_t, step = [], [], [], 3
    for r in range(args.rounds):
        mesh_t += meshlm_steps(trainer, writer, step, args.steps)
        comp_t += meshlm_steps(compiled, cwriter, step, args.steps)
        step += args.steps
        plain_t += plain_loop(plain_model, tokens, args.steps, args.batch, args.seq, dtype, r + 1)
    writer.close()
    cwriter.close()

    peak, source = peak_flops(torch.device("cpu"), args.dtype)
    tokens_per_step = args.batch * args.seq
    fpt = trainer.model_part.model_cfg.flops_per_token(args.seq)
    rows = []
    for name, times in (("plain PyTorch loop", plain_t), ("meshlm trainer", mesh_t),
                        ("meshlm compiled", comp_t)):
        med = statistics.median(times)
        tps = tokens_per_step / med
        rows.append({"impl": name, "step_time_s": med, "tokens_per_s": tps,
                     "mfu": tps * fpt / peak, "steps": len(times)})
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    speedup = rows[2]["tokens_per_s"] / rows[1]["tokens_per_s"]
    print(f"model {args.preset} ({trainer.model_part.model_cfg.num_params() / 1e6:.2f} M params), batch "
          f"{args.batch} x {args.seq}, {args.dtype}, {torch.get_num_threads()} thread(s), "
          f"peak {peak / 1e9:.0f} GFLOP/s ({source})")
    print(f"| {'implementation':<20} | {'step time (s)':>13} | {'tokens/s':>9} | {'MFU':>6} |")
    print(f"|{'-' * 22}|{'-' * 15}|{'-' * 11}|{'-' * 8}|")
    for r in rows:
        print(f"| {r['impl']:<20} | {r['step_time_s']:>13.4f} | {r['tokens_per_s']:>9.0f} | "
              f"{100 * r['mfu']:>5.1f}% |")
    print(f"meshlm / plain throughput ratio: {ratio:.3f} (goal >= 0.97)")
    print(f"compiled / eager meshlm: {speedup:.3f} (goal >= 1.25); compiling took "
          f"{compile_s:.1f} s of a {compile_step_s:.1f} s first step")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "peak_flops": peak, "peak_source": source,
                               "rows": rows, "ratio": ratio, "compiled_speedup": speedup,
                               "compile_s": compile_s, "compile_step_s": compile_step_s},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
