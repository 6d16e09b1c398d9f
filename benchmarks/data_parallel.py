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
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshlm.config import load_config
from meshlm.data import build_data
from meshlm.data.sampler import StepSampler
from meshlm.models import build_model
from meshlm.testing import run_world
from meshlm.train.trainer import Trainer


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def config(args: dict, impl: str, run_dir: str):  # noqa: ANN201
    zero = {"meshlm-ddp": 0, "meshlm-zero1": 1, "meshlm-zero2": 2, "meshlm-zero3": 3}.get(impl, 0)
    return load_config(None, [
        f"--model.preset={args['preset']}", f"--data.seq_len={args['seq']}",
        f"--train.global_batch={args['batch']}", f"--train.micro_batch={args['batch'] // args['world']}",
        "--train.steps=1000000", "--train.eval_every=0", f"--parallel.dp={args['world']}",
        f"--parallel.zero={zero}", f"--run.dir={run_dir}", "--run.sample_tokens=0",
        "--train.peak_flops=1e12",
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
        trainer = Trainer(cfg, log=lambda _m: None, progress=False)
        times = []
        for step in range(1, args["steps"] + 1):
            t0 = time.perf_counter()
            trainer.train_step(step)
            times.append(time.perf_counter() - t0)
    else:
        times = torch_side(impl, cfg, args["steps"])
    warm = times[2:]  # the first steps allocate buffers and warm the thread pool
    return {"step_time_s": statistics.median(warm), "peak_rss_growth": peak_rss_bytes() - base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/data_parallel.json")
    a = ap.parse_args()
    args = vars(a)
    build_data(config(args, "meshlm-ddp", "unused").data)  # cache the data once
    impls = ["meshlm-ddp", "torch-ddp", "meshlm-zero1", "meshlm-zero2", "meshlm-zero3",
             "torch-fsdp2"]
    best: dict[str, dict] = {}
    tmp = Path(tempfile.mkdtemp(prefix="meshlm-dp-bench-"))
    for r in range(a.rounds):
        for impl in impls:
            res = run_world(a.world, worker, impl, args, str(tmp / f"{impl}-{r}"))
            step = max(x["step_time_s"] for x in res)  # the slowest rank sets the pace
            mem = max(x["peak_rss_growth"] for x in res)
            if impl not in best or step < best[impl]["step_time_s"]:
                best[impl] = {"impl": impl, "step_time_s": step, "peak_rss_growth": mem}
            else:
                best[impl]["peak_rss_growth"] = min(best[impl]["peak_rss_growth"], mem)
    tokens = a.batch * a.seq
    pairs = {"meshlm-ddp": "torch-ddp", "meshlm-zero1": "torch-fsdp2",
             "meshlm-zero2": "torch-fsdp2", "meshlm-zero3": "torch-fsdp2"}
    print(f"model {a.preset}, world {a.world} (gloo, 1 thread/rank), global batch {a.batch} x "
          f"{a.seq}, fp32, median of steps 3..{a.steps}, best of {a.rounds} runs")
    print(f"| {'implementation':<14} | {'step (s)':>8} | {'tokens/s':>8} | {'peak RSS growth':>15} "
          f"| {'time ratio':>10} | {'memory ratio':>12} |")
    print(f"|{'-' * 16}|{'-' * 10}|{'-' * 10}|{'-' * 17}|{'-' * 12}|{'-' * 14}|")
    rows = []
    for impl in impls:
        b = best[impl]
        ref = best.get(pairs.get(impl, ""))
        tr = b["step_time_s"] / ref["step_time_s"] if ref else None
        mr = b["peak_rss_growth"] / ref["peak_rss_growth"] if ref else None
        row = dict(b, tokens_per_s=tokens / b["step_time_s"], vs=pairs.get(impl),
                   time_ratio=tr, memory_ratio=mr)
        rows.append(row)
        print(f"| {impl:<14} | {b['step_time_s']:>8.3f} | {row['tokens_per_s']:>8.0f} | "
              f"{b['peak_rss_growth'] / 2**20:>11.1f} MiB | "
              f"{(f'{tr:.3f}' if tr else '-'):>10} | {(f'{mr:.3f}' if mr else '-'):>12} |")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": args, "rows": rows}, indent=1))
    print(f"ratios: meshlm / torch counterpart (DDP vs DDP, ZeRO vs FSDP2); wrote {out}")


if __name__ == "__main__":
    main()
