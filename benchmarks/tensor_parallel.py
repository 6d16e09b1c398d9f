"""meshlm tensor parallelism vs torch's DTensor tensor parallelism, same model, world and batch.

torch side: ``parallelize_module`` with the Megatron plan torchtitan uses -- q/k/v and gate/up
``ColwiseParallel``, attention output and down ``RowwiseParallel``, the embedding
``RowwiseParallel`` over the vocabulary, the LM head ``ColwiseParallel`` with its logits kept
sharded and the loss computed under ``loss_parallel()`` (both sides avoid gathering logits).
meshlm side: the trainer's own step with ``parallel.tp`` (and a row with sequence parallelism).
Each implementation runs in its own spawned gloo world, twice, alternating; the faster run
counts, a step counting at the pace of the slowest rank. Memory: growth of peak resident
memory over the resident memory before the model was built (max over ranks).

    python benchmarks/tensor_parallel.py [--world 2] [--preset small] [--steps 8]
        [--json benchmarks/results/tensor_parallel.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _harness import best_of, meshlm_step_times, print_rows, rss_bytes, split_compiled, summary

from meshlm.config import load_config
from meshlm.data import build_data
from meshlm.data.sampler import StepSampler
from meshlm.models import build_model


def config(args: dict, impl: str, run_dir: str):  # noqa: ANN201
    impl, extra = split_compiled(impl)
    return load_config(None, [
        f"--model.preset={args['preset']}", f"--data.seq_len={args['seq']}",
        f"--train.global_batch={args['batch']}", f"--train.micro_batch={args['batch']}",
        "--train.steps=1000000", "--train.eval_every=0", f"--parallel.tp={args['world']}",
        f"--parallel.sp={'true' if impl == 'meshlm-tp-sp' else 'false'}",
        f"--run.dir={run_dir}", "--run.sample_tokens=0", "--train.peak_flops=1e12", *extra,
    ])


def clip_mixed(params: list[torch.Tensor], max_norm: float) -> None:
    """Clip a model holding DTensor (sharded) and plain (replicated norm) parameters."""
    from torch.distributed.tensor import DTensor

    groups = ([p for p in params if isinstance(p, DTensor)],
              [p for p in params if not isinstance(p, DTensor)])
    norms = []
    for group in groups:
        n = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.stack(norms).norm()
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def dtensor_side(cfg, steps: int) -> list[float]:  # noqa: ANN001
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    data = build_data(cfg.data, log=lambda _m: None)
    model = build_model(cfg.model_config(vocab_size=data.tokenizer.vocab_size), cfg.train.seed)
    layer_plan = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for layer in model.layers.values():
        parallelize_module(layer, mesh, layer_plan)
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    t = cfg.train
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)
    sampler = StepSampler(data.train_tokens, cfg.data.seq_len, t.global_batch, t.seed)
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        (x, y), = sampler.rank_micro_batches(step, 0, 1, t.micro_batch)
        with loss_parallel():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        clip_mixed(list(model.parameters()), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
        times.append(time.perf_counter() - t0)
    return times


def worker(impl: str, args: dict, run_dir: str) -> dict:
    base = rss_bytes()
    cfg = config(args, impl, run_dir)
    if impl.startswith("meshlm"):
        times = meshlm_step_times(cfg, args["steps"])
    else:
        times = dtensor_side(cfg, args["steps"])
    return summary(times, base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/tensor_parallel.json")
    ap.add_argument("--only", default="", help="comma-separated implementations to run "
                    "(default: all)")
    a = ap.parse_args()
    args = vars(a)
    build_data(config(args, "meshlm-tp", "unused").data)
    impls = ["meshlm-tp", "torch-dtensor-tp", "meshlm-tp-sp", "meshlm-tp-compiled",
             "meshlm-tp-sp-compiled"]
    if a.only:
        unknown = set(a.only.split(",")) - set(impls)
        if unknown:
            ap.error(f"--only: unknown implementation(s) {', '.join(sorted(unknown))}")
        impls = [i for i in impls if i in a.only.split(",")]
    best = best_of(a.world, worker, impls, args, a.rounds)
    ref = best["torch-dtensor-tp"]
    tokens = a.batch * a.seq
    print(f"model {a.preset}, tp {a.world} (gloo, 1 thread/rank), batch {a.batch} x {a.seq}, "
          f"fp32, median of steps 3..{a.steps}, best of {a.rounds} runs")
    rows = [dict(best[i], tokens_per_s=tokens / best[i]["step_time_s"],
                 time_ratio=best[i]["step_time_s"] / ref["step_time_s"],
                 memory_ratio=best[i]["peak_rss_growth"] / ref["peak_rss_growth"])
            for i in impls]
    print_rows(rows)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": args, "rows": rows}, indent=1))
    print(f"ratios: / torch DTensor TP; wrote {out}")


if __name__ == "__main__":
    main()
