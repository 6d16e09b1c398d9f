"""DualPipeV's point: exposed expert all-to-all time per step against 1F1B, with ep.

A MoE model (every layer MoE, dropless top-2) trains with pp 2 x dp 2 x ep 2 (world 4, gloo,
one thread per rank) through meshlm's trainer under three schedules at the same micro-batches:

- ``1f1b``: one pass after the other; every all-to-all is waited right after it is issued;
- ``dualpipev-serial``: DualPipeV's table with its overlapped pairs run one pass after the
  other (``PipelineExecutor.overlap = False``);
- ``dualpipev``: the pairs run as two lanes taking turns (``parallel/overlap.py``): one
  micro-batch's all-to-all is in flight while the other micro-batch computes.

Per step and rank: the exposed all-to-all time (``overlap.EXPOSED``: seconds the host waited
for an issued dispatch / combine all-to-all, forward and backward, with no other lane left to
run), the number of all-to-alls, and the step time (the slowest rank's). The table gives the
median over the steps after ``--warmup``, the mean over ranks of the exposed time, the
slowest rank's step. With 4 ranks on this machine's cores the ranks time-share the cores: an
all-to-all waits for its peers' compute as well as for its bytes, so the exposed time here is
what a CPU world hides, not a GPU's (CUDA streams: a GPU-only path, not measured here).

    OMP_NUM_THREADS=1 python benchmarks/pipeline_overlap.py [--steps 6] [--warmup 2]
        [--dim 256] [--seq 256] [--experts 8] [--json benchmarks/results/pipeline_overlap.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

VARIANTS = ("1f1b", "dualpipev-serial", "dualpipev")


def config_args(a: dict, variant: str, run_dir: str) -> list[str]:
    schedule = variant.split("-")[0]
    v = 2 if schedule == "dualpipev" else 1
    return [
        "--model.preset=tiny-moe", f"--model.dim={a['dim']}", f"--model.n_layers={a['layers']}",
        "--model.n_heads=8", "--model.n_kv_heads=4", f"--model.moe_experts={a['experts']}",
        f"--model.moe_ffn_hidden={a['expert_ffn']}", "--model.moe_shared_experts=0",
        f"--data.seq_len={a['seq']}",
        f"--train.global_batch={2 * a['microbatches']}", "--train.micro_batch=1",
        "--train.steps=1000000", "--train.eval_every=0", "--run.sample_tokens=0",
        "--train.peak_flops=1e12", "--parallel.pp=2", "--parallel.dp=2", "--parallel.ep=2",
        f"--parallel.pp_schedule={schedule}", f"--parallel.pp_virtual={v}",
        f"--run.dir={run_dir}"]


def worker(variant: str, a: dict, run_dir: str) -> list[dict[str, Any]]:
    """Every step's exposed all-to-all seconds, all-to-all count and step time on this rank."""
    from meshlm.config import load_config
    from meshlm.parallel import overlap
    from meshlm.train.trainer import Trainer

    trainer = Trainer(load_config(None, config_args(a, variant, run_dir)), log=lambda _m: None,
                      progress=False)
    executor = trainer.runner.executor
    if variant == "dualpipev-serial":
        executor.overlap = False
    out = []
    for step in range(1, a["steps"] + 1):
        overlap.EXPOSED.reset()
        trainer.train_step(step)
        out.append({"exposed_s": overlap.EXPOSED.seconds, "all_to_alls": overlap.EXPOSED.count,
                    "step_s": executor.step_time, "overlap": executor.overlap})
    return out


def measure(variant: str, a: dict, tmp: Path) -> dict[str, Any]:
    from meshlm.testing import run_world

    ranks = run_world(4, worker, variant, a, str(tmp / variant))
    steps = range(a["warmup"], a["steps"])
    exposed = [statistics.mean(r[k]["exposed_s"] for r in ranks) for k in steps]
    step = [max(r[k]["step_s"] for r in ranks) for k in steps]
    return {"variant": variant, "exposed_ms": 1e3 * statistics.median(exposed),
            "step_ms": 1e3 * statistics.median(step),
            "all_to_alls": ranks[0][-1]["all_to_alls"], "overlap": ranks[0][-1]["overlap"],
            "exposed_ms_all": [1e3 * x for x in exposed], "step_ms_all": [1e3 * x for x in step]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--expert-ffn", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=8, help="per dp rank (>= 2 pp)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every variant, alternating")
    ap.add_argument("--only", default=",".join(VARIANTS))
    ap.add_argument("--json", default="benchmarks/results/pipeline_overlap.json")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    a = {k: getattr(args, k) for k in ("steps", "warmup", "dim", "layers", "seq", "experts",
                                       "expert_ffn", "microbatches")}
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for variant in args.only.split(","):
                got = measure(variant, a, Path(tmp) / f"round{r}")
                if variant not in rows or got["step_ms"] < rows[variant]["step_ms"]:
                    rows[variant] = got
    base = rows.get("1f1b")
    print(f"pp 2 x dp 2 x ep 2, dim {args.dim}, {args.layers} MoE layers of {args.experts} "
          f"experts (top-2, width {args.expert_ffn}), seq {args.seq}, "
          f"{args.microbatches} micro-batches of 1 per dp rank")
    print(f"{'schedule':18} {'overlap':>7} {'all-to-alls':>11} {'exposed a2a (ms)':>16} "
          f"{'vs 1f1b':>7} {'step (ms)':>9} {'vs 1f1b':>7}")
    for row in rows.values():
        ex = f"{row['exposed_ms'] / base['exposed_ms']:.2f}" if base else "-"
        st = f"{row['step_ms'] / base['step_ms']:.2f}" if base else "-"
        print(f"{row['variant']:18} {str(row['overlap']):>7} {row['all_to_alls']:>11} "
              f"{row['exposed_ms']:>16.1f} {ex:>7} {row['step_ms']:>9.1f} {st:>7}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": a, "rows": list(rows.values())}, indent=1))


if __name__ == "__main__":
    main()
