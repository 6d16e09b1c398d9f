"""meshlm DDP vs torch DDP, and meshlm ZeRO-1/2/3 vs torch FSDP2, same model, world and batch.

Each implementation runs in its own spawned gloo world (so a rank's peak memory is its own),
twice, alternating, and the faster run counts. Every side trains the same model (same preset,
seed, weights) on the same rank slices of the same global batches, with AdamW and clipping.
Reported per rank: median step time, and the growth of peak resident memory over the rank's
resident memory just before the model was built (the torch runtime itself excluded).

    python benchmarks/data_parallel.py [--world 2] [--preset small] [--steps 8]
        [--json benchmarks/results/data_parallel.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import best_of, meshlm_step_times, print_rows, rss_bytes, split_compiled, summary

from meshlm.config import load_config
from meshlm.data import build_data
from meshlm.data.sampler import StepSampler
from meshlm.models import build_model


def config(args: dict, impl: str, run_dir: str):  # noqa: ANN201
    impl, extra = split_compiled(impl)
    zero = {"meshlm-ddp": 0, "meshlm-zero1": 1, "meshlm-zero2": 2, "meshlm-zero3": 3}.get(impl, 0)
    return load_config(None, [
        f"--model.preset={args['preset']}", f"--data.seq_len={args['seq']}",
        f"--train.global_batch={args['batch']}", f"--train.micro_batch={args['batch'] // args['world']}",
        "--train.steps=1000000", "--train.eval_every=0", f"--parallel.dp={args['world']}",
        f"--parallel.zero={zero}", f"--run.dir={run_dir}", "--run.sample_tokens=0",
        "--train.peak_flops=1e12", *extra,
    ])


def torch_side(impl: str, cfg, steps: int) -> list[float]:  # noqa: ANN001
    """torch DDP or FSDP2 training loop over the same rank slices."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = build_data(cfg.data, log=lambda _m: None)
    model = build_model(cfg.model_config(vocab_size=data.tokenizer.vocab_size), cfg.train.seed)
    if impl == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        wrapped = fully_shard(model)
    decay = [p for p in wrapped.parameters() if p.ndim >= 2]
    rest = [p for p in wrapped.parameters() if p.ndim < 2]
    t = cfg.train
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)
    sampler = StepSampler(data.train_tokens, cfg.data.seq_len, t.global_batch, t.seed)
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        (x, y), = sampler.rank_micro_batches(step, rank, world, t.micro_batch)
        loss = F.cross_entropy(wrapped(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.detach().clone()
        dist.all_reduce(lv)  # the loss meshlm reports is the global mean: same work here
        times.append(time.perf_counter() - t0)
    return times


def worker(impl: str, args: dict, run_dir: str) -> dict:
    base = rss_bytes()
    cfg = config(args, impl, run_dir)
    if impl.startswith("meshlm"):
        times = meshlm_step_times(cfg, args["steps"])
    else:
        times = torch_side(impl, cfg, args["steps"])
    return summary(times, base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/data_parallel.json")
    ap.add_argument("--only", default="", help="comma-separated implementations to run "
                    "(default: all)")
    a = ap.parse_args()
    args = vars(a)
    build_data(config(args, "meshlm-ddp", "unused").data)  # cache the data once
    impls = ["meshlm-ddp", "torch-ddp", "meshlm-zero1", "meshlm-zero2", "meshlm-zero3",
             "torch-fsdp2", "meshlm-ddp-compiled", "meshlm-zero3-compiled"]
    if a.only:
        unknown = set(a.only.split(",")) - set(impls)
        if unknown:
            ap.error(f"--only: unknown implementation(s) {', '.join(sorted(unknown))}")
        impls = [i for i in impls if i in a.only.split(",")]
    best = best_of(a.world, worker, impls, args, a.rounds)
    tokens = a.batch * a.seq
    pairs = {"meshlm-ddp": "torch-ddp", "meshlm-zero1": "torch-fsdp2",
             "meshlm-zero2": "torch-fsdp2", "meshlm-zero3": "torch-fsdp2",
             "meshlm-ddp-compiled": "torch-ddp", "meshlm-zero3-compiled": "torch-fsdp2"}
    print(f"model {a.preset}, world {a.world} (gloo, 1 thread/rank), global batch {a.batch} x "
          f"{a.seq}, fp32, median of steps 3..{a.steps}, best of {a.rounds} runs")
    rows = []
    for impl in impls:
        b = best[impl]
        ref = best.get(pairs.get(impl, ""))
        rows.append(dict(b, tokens_per_s=tokens / b["step_time_s"], vs=pairs.get(impl),
                         time_ratio=b["step_time_s"] / ref["step_time_s"] if ref else None,
                         memory_ratio=b["peak_rss_growth"] / ref["peak_rss_growth"] if ref
                         else None))
    print_rows(rows, 14)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": args, "rows": rows}, indent=1))
    print(f"ratios: meshlm / torch counterpart (DDP vs DDP, ZeRO vs FSDP2); wrote {out}")


if __name__ == "__main__":
    main()
