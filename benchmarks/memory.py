"""Memory levers: peak memory per rank and step time of each, measured next to predicted.

For the ``small`` preset and a ~300 M model (``scale.py``'s), every lever alone on top of a
baseline layout, then all of them together:

- one process: ``train.recompute`` = none / selective / op / full, ``train.loss=chunked``,
  ``parallel.offload=disk``, and full + chunked + disk;
- dp = 2: ``parallel.zero`` = 0 / 1 / 2 / 3, and ZeRO-3 + full + chunked + disk;
- the whole grid recompute (none/selective/op/full) x loss (torch/chunked) x zero (0-3) x
  offload (none/disk) at dp = 2 (64 runs; ``--grid-models``, default ``small``), so every
  combination of levers is measured next to the planner, not only each lever alone.

Every run is the real command line (``meshlm train``, fp32, 3 steps and the final checkpoint).
From its ``metrics.jsonl``: the largest rank's step peak (``mem_peak_bytes``: peak resident
memory since the previous step, so it includes the process itself), rank 0's resident state
bytes (weights, gradients, AdamW moments: ``optim_bytes`` is what stays in memory, 0 when
offloaded to disk) and the median step time of steps 2-3. Next to them, the planner's per-rank
bytes for the same config (``meshlm train --dry-run``'s estimate: states + activations +
transient + buffers) plus the measured process baseline (a one-process run of the ``tiny``
preset on the same data, one sequence of 16 tokens a step: torch, meshlm and the data with
almost no model), and the
step time relative to the lever's baseline (one process, or dp = 2 ZeRO-0).

    python benchmarks/memory.py [--models small 300M] [--runs base full ...]
        [--grid-models small] [--json benchmarks/results/memory.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import MODELS as SCALE_MODELS  # noqa: E402
from scale import run_train, wait_for_memory  # noqa: E402

from meshlm.config import load_config  # noqa: E402
from meshlm.planner.cli import config_workload, hardware_here  # noqa: E402
from meshlm.planner.memory import memory  # noqa: E402
from meshlm.train.metrics import read_metrics  # noqa: E402

MIB = 2**20
STEPS = 3
# model -> (overrides of the small preset, seq, global batch = micro-batch x dp, vocabulary)
MODELS: dict[str, tuple[list[str], int, int, int]] = {
    "small": ([], 256, 8, 16384),
    "300M": (SCALE_MODELS["300M"], 128, 4, 16384),
}
ALL = ["--train.recompute=full", "--train.loss=chunked", "--parallel.offload=disk"]
# run -> (ranks, overrides, the run it is compared with)
RUNS: dict[str, tuple[int, list[str], str]] = {
    "base": (1, [], "base"),
    "selective": (1, ["--train.recompute=selective"], "base"),
    "op": (1, ["--train.recompute=op"], "base"),
    "full": (1, ["--train.recompute=full"], "base"),
    "chunked": (1, ["--train.loss=chunked"], "base"),
    "disk": (1, ["--parallel.offload=disk"], "base"),
    "all": (1, ALL, "base"),
    "dp2-zero0": (2, ["--parallel.dp=2", "--parallel.zero=0"], "dp2-zero0"),
    "dp2-zero1": (2, ["--parallel.dp=2", "--parallel.zero=1"], "dp2-zero0"),
    "dp2-zero2": (2, ["--parallel.dp=2", "--parallel.zero=2"], "dp2-zero0"),
    "dp2-zero3": (2, ["--parallel.dp=2", "--parallel.zero=3"], "dp2-zero0"),
    "dp2-zero3-all": (2, ["--parallel.dp=2", "--parallel.zero=3", *ALL], "dp2-zero0"),
}
# the lever grid at dp = 2: g-<recompute>-<loss>-z<zero>-<offload>, each against dp2-zero0
GRID_AXES = (("none", "selective", "op", "full"), ("torch", "chunked"), (0, 1, 2, 3),
             ("none", "disk"))
GRID: dict[str, tuple[int, list[str], str]] = {
    f"g-{rc}-{loss}-z{zero}-{off}": (2, ["--parallel.dp=2", f"--parallel.zero={zero}",
                                         f"--train.recompute={rc}", f"--train.loss={loss}",
                                         f"--parallel.offload={off}"], "dp2-zero0")
    for rc in GRID_AXES[0] for loss in GRID_AXES[1] for zero in GRID_AXES[2]
    for off in GRID_AXES[3]}
RUNS.update(GRID)


def train_args(model: str, run: str, run_dir: Path) -> list[str]:
    over, seq, batch, vocab = MODELS[model]
    ranks, args, _ = RUNS[run]
    return ["--model.preset=small", *over, *args, f"--data.seq_len={seq}",
            f"--data.vocab_size={vocab}", f"--train.global_batch={batch}",
            f"--train.micro_batch={batch // ranks}", f"--train.steps={STEPS}",
            "--train.eval_every=0", "--run.sample_tokens=0", f"--run.dir={run_dir}",
            "--run.malloc_mmap_kb=128"]  # freed buffers go back to the OS: RSS = live memory


def predicted(model: str, run: str) -> dict[str, Any]:
    cfg = load_config(None, train_args(model, run, Path("unused")), check_paths=False)
    work = config_workload(cfg, MODELS[model][3])
    m = memory(work, cfg.layout(), hardware_here("memory benchmark"))
    return {"params": work.model.num_params(), "total": m.total,
            "items": {k: float(v) for k, v in m.items.items()}}


def baseline_rss(model: str, tmp: Path) -> int:
    """Step peak of one process training the ``tiny`` preset on this model's data, one
    sequence of 16 tokens a step: torch, meshlm and the data with almost no model or
    activations (after a first run has filled the data cache: a BPE trained in-process
    would leave its pages in the measure)."""
    vocab = MODELS[model][3]
    run_dir = tmp / f"baseline-{model}"
    args = ["--model.preset=tiny", "--data.seq_len=16", f"--data.vocab_size={vocab}",
            "--train.global_batch=1", "--train.micro_batch=1", "--train.steps=1",
            "--train.eval_every=0", "--run.sample_tokens=0", f"--run.dir={run_dir}-warm"]
    run_train(args, tmp / f"baseline-{model}-warm.log")  # fills the data cache: not measured
    shutil.rmtree(f"{run_dir}-warm", ignore_errors=True)
    res = run_train(["--model.preset=tiny", "--data.seq_len=16", f"--data.vocab_size={vocab}",
                     "--train.global_batch=1", "--train.micro_batch=1",
                     "--train.steps=2", "--train.eval_every=0", "--run.sample_tokens=0",
                     f"--run.dir={run_dir}"], tmp / f"baseline-{model}.log")
    if res["rc"]:
        raise RuntimeError(f"baseline run failed:\n{res['tail']}")
    recs = read_metrics(run_dir / "metrics.jsonl")
    shutil.rmtree(run_dir, ignore_errors=True)
    return max(r["mem_peak_bytes"] for r in recs)


def measure(model: str, runs: list[str], tmp: Path, wait_s: float, out: list[dict]) -> None:
    base = baseline_rss(model, tmp)
    print(f"{model}: baseline {base / MIB:.0f} MiB", flush=True)
    for run in runs:
        ranks = RUNS[run][0]
        pred = predicted(model, run)
        row: dict[str, Any] = {"model": model, "params": pred["params"], "run": run,
                               "ranks": ranks, "baseline_rss": base,
                               "predicted_bytes": pred["total"] + base,
                               "predicted_items": pred["items"], "compare_with": RUNS[run][2]}
        out.append(row)
        need = ranks * (pred["total"] + base) * 1.2
        if not wait_for_memory(need, wait_s):
            row["skipped"] = f"less than {need / 2**30:.1f} GiB available"
            continue
        run_dir = tmp / f"{model}-{run}"
        res = run_train(train_args(model, run, run_dir), tmp / f"{model}-{run}.log")
        if res["rc"]:
            row["error"] = res["tail"]
            print(f"{model} {run}: FAILED\n{res['tail']}", flush=True)
            continue
        recs = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
        row.update(
            steps_peak=max(recs[s]["mem_peak_bytes"] for s in range(1, STEPS + 1)),
            step_time_s=statistics.median(recs[s]["step_time_s"] for s in range(2, STEPS + 1)),
            states={k: recs[STEPS][f"{k}_bytes"] for k in ("params", "grads", "optim")},
            # every rank's peak (the last step is a checkpoint step: listed per rank)
            peak_per_rank=recs[STEPS].get("mem_peak_per_rank", [recs[STEPS]["mem_peak_bytes"]]),
            wall_s=res["wall_s"], loss=recs[STEPS]["loss"])
        row["peak_vs_predicted"] = row["steps_peak"] / row["predicted_bytes"]
        print(f"{model} {run}: peak {row['steps_peak'] / MIB:,.0f} MiB (predicted "
              f"{row['predicted_bytes'] / MIB:,.0f}), step {row['step_time_s']:.2f} s, "
              f"optim resident {row['states']['optim'] / MIB:,.0f} MiB", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    by_run = {r["run"]: r for r in out if r["model"] == model}
    for r in by_run.values():
        ref = by_run.get(r["compare_with"])
        if ref and "steps_peak" in r and "steps_peak" in ref:
            r["peak_vs_baseline"] = r["steps_peak"] / ref["steps_peak"]
            r["time_vs_baseline"] = r["step_time_s"] / ref["step_time_s"]


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| model | run | ranks | step peak (MiB) | predicted (MiB) | measured / predicted "
          "| AdamW moments resident (MiB) | step (s) | peak vs its base | time vs its base |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["run"] in GRID:
            continue
        if "steps_peak" not in r:
            why = r.get("skipped") or "failed"
            print(f"| {r['model']} | {r['run']} ({why}) | {r['ranks']} | - | "
                  f"{r['predicted_bytes'] / MIB:,.0f} | - | - | - | - | - |")
            continue
        print(f"| {r['model']} ({r['params'] / 1e6:.0f} M) | {r['run']} | {r['ranks']} | "
              f"{r['steps_peak'] / MIB:,.0f} | {r['predicted_bytes'] / MIB:,.0f} | "
              f"{r['peak_vs_predicted']:.2f} | {r['states']['optim'] / MIB:,.0f} | "
              f"{r['step_time_s']:.2f} | {r.get('peak_vs_baseline', 0):.2f} | "
              f"{r.get('time_vs_baseline', 0):.2f} |")


def print_grid(rows: list[dict[str, Any]]) -> None:
    """The grid as one table per model: rows recompute x loss, columns zero x offload; each
    cell measured / predicted MiB of the largest rank, and the step time vs dp2 zero0."""
    for model in dict.fromkeys(r["model"] for r in rows if r["run"] in GRID):
        cells = {r["run"]: r for r in rows if r["model"] == model and r["run"] in GRID}
        cols = [(z, o) for z in GRID_AXES[2] for o in GRID_AXES[3]]
        print(f"\n{model}, dp = 2: step peak / predicted MiB (step time vs dp2 zero0)")
        print("| recompute | loss | " + " | ".join(f"zero {z} {o}" for z, o in cols) + " |")
        print("|---|---|" + "---:|" * len(cols))
        for rc in GRID_AXES[0]:
            for loss in GRID_AXES[1]:
                out = []
                for z, o in cols:
                    r = cells.get(f"g-{rc}-{loss}-z{z}-{o}", {})
                    out.append(f"{r['steps_peak'] / MIB:,.0f} / {r['predicted_bytes'] / MIB:,.0f}"
                               f" ({r.get('time_vs_baseline', 0):.2f}x)"
                               if "steps_peak" in r else "-")
                print(f"| {rc} | {loss} | " + " | ".join(out) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--runs", nargs="*", default=[r for r in RUNS if r not in GRID],
                    choices=list(RUNS))
    ap.add_argument("--grid-models", nargs="*", default=["small"], choices=list(MODELS),
                    help="models that also run the whole lever grid at dp = 2")
    ap.add_argument("--wait", type=float, default=600.0)
    ap.add_argument("--json", default="benchmarks/results/memory.json")
    a = ap.parse_args()
    runs = [r for r in RUNS if r in a.runs or r in {RUNS[x][2] for x in a.runs}]
    tmp = Path(tempfile.mkdtemp(prefix="meshlm-memory-"))
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for model in a.models:
            grid = list(GRID) if model in a.grid_models else []
            measure(model, runs + [g for g in grid if g not in runs], tmp, a.wait, rows)
            out.write_text(json.dumps({"args": {"models": a.models, "runs": runs,
                                                "steps": STEPS, "dtype": "fp32",
                                                "shapes": {k: MODELS[k] for k in a.models}},
                                       "wall_s": time.perf_counter() - t0, "rows": rows},
                                      indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)
    print_grid(rows)
    print(f"\nstep peak: the largest rank's peak resident memory in a step (the process "
          f"included); predicted: the planner's per-rank bytes + the measured baseline. "
          f"total {time.perf_counter() - t0:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
