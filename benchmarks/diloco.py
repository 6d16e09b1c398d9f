"""DiLoCo vs DDP: validation loss after the same tokens, and the bytes sent across islands.

On the default corpus and the ``small`` preset, the same global batch and learning-rate
schedule for every run (``meshlm train`` command lines, fp32, 4 local gloo workers each):

- ``ddp``: dp = 4; every step all-reduces the gradients over all 4 ranks (each rank is its own
  "island": every byte of that all-reduce crosses islands);
- ``diloco-H``: 4 islands of one rank (``parallel.islands=4``), H inner AdamW steps alone, then
  one all-reduce of the pseudo-gradient and the outer Nesterov step (outer lr 0.7, momentum
  0.9), for H in 10, 50, 100 (and any ``--inner`` given);
- ``average-H``: the same islands with outer lr 1 and no momentum: the islands' weights are
  averaged every H steps (local SGD / FedAvg), for H = 50 (``--average``).

Reported per run: the validation loss at every evaluation (every ``--eval-every`` steps; for
DiLoCo on island 0's weights, which at a synchronisation step are the islands' common
model) and at the end; the bytes that crossed islands in all (every rank's sends: the
``all_reduce/dp`` bytes of DDP, ``island_bytes_total`` x islands for DiLoCo) per training
token; the wall time. Writes JSON and a loss-curve plot.

    python benchmarks/diloco.py [--steps 500] [--inner 10 50 100] [--average 50] [--no-ddp]
        [--merge]
        [--json benchmarks/results/diloco.json] [--plot docs/img/diloco_loss.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import run_train  # noqa: E402

from meshlm.train.metrics import read_metrics  # noqa: E402

WORKERS = 4


def common(steps: int, eval_every: int, seq_len: int, global_batch: int) -> list[str]:
    return ["--model.preset=small", f"--train.steps={steps}", f"--data.seq_len={seq_len}",
            f"--train.global_batch={global_batch}", f"--train.eval_every={eval_every}",
            "--train.eval_batches=8", "--run.sample_tokens=0", "--train.log_every=50"]


def runs(inner: list[int], averaging: list[int], ddp: bool = True) -> dict[str, list[str]]:
    """DDP, DiLoCo at each H (outer Nesterov lr 0.7, momentum 0.9), and plain averaging of
    the islands (outer lr 1, no momentum: local SGD / FedAvg) at each H of ``averaging``."""
    out = {"ddp": [f"--parallel.dp={WORKERS}"]} if ddp else {}
    islands = [f"--parallel.islands={WORKERS}", "--parallel.dp=1"]
    for h in inner:
        out[f"diloco-H{h}"] = [*islands, f"--diloco.inner_steps={h}"]
    for h in averaging:
        out[f"average-H{h}"] = [*islands, f"--diloco.inner_steps={h}", "--diloco.outer_lr=1",
                                "--diloco.outer_momentum=0"]
    return out


def cross_island_bytes(recs: list[dict[str, Any]], diloco: bool) -> int:
    """Bytes every rank sent across islands over the run (rank 0's log x the world)."""
    if diloco:
        return int(recs[-1]["island_bytes_total"]) * WORKERS  # island 0's ranks, x islands
    return sum(int(r["comm_bytes"].get("all_reduce/dp", 0)) for r in recs) * WORKERS


def measure(name: str, args: list[str], base: list[str], tmp: Path) -> dict[str, Any]:
    run_dir = tmp / name
    res = run_train([*base, *args, f"--run.dir={run_dir}"], tmp / f"{name}.log")
    row: dict[str, Any] = {"run": name, "args": args, "wall_s": res["wall_s"]}
    if res["rc"]:
        row["error"] = res["tail"]
        print(f"{name}: FAILED\n{res['tail']}", flush=True)
        return row
    recs = read_metrics(run_dir / "metrics.jsonl")
    tokens = recs[-1]["tokens_seen"]
    sent = cross_island_bytes(recs, any(a.startswith("--parallel.islands") for a in args))
    row.update(
        tokens=tokens, val=[(r["tokens_seen"], r["val_loss"]) for r in recs if "val_loss" in r],
        final_val_loss=recs[-1]["val_loss"], final_train_loss=recs[-1]["loss"],
        cross_island_bytes=sent, bytes_per_token=sent / tokens,
        outer_steps=max((r.get("outer_step", 0) for r in recs), default=0),
        step_time_s=sorted(r["step_time_s"] for r in recs)[len(recs) // 2])
    print(f"{name}: val loss {row['final_val_loss']:.4f}, {row['bytes_per_token']:,.0f} bytes "
          f"across islands per token, {res['wall_s']:.0f} s", flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        if "val" in r:
            xs, ys = zip(*r["val"], strict=True)
            ax.plot([x / 1e6 for x in xs], ys, marker="o", ms=3, label=r["run"])
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("validation loss")
    ax.set_title("small, 4 workers: DDP vs DiLoCo (4 islands)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--inner", type=int, nargs="*", default=[10, 50, 100])
    ap.add_argument("--average", type=int, nargs="*", default=[50],
                    help="H of plain-averaging runs (outer lr 1, no momentum)")
    ap.add_argument("--no-ddp", action="store_true", help="skip the DDP run")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of --json that this invocation does not rerun")
    ap.add_argument("--json", default="benchmarks/results/diloco.json")
    ap.add_argument("--plot", default="docs/img/diloco_loss.png")
    a = ap.parse_args()
    base = common(a.steps, a.eval_every, a.seq_len, a.global_batch)
    tmp = Path(tempfile.mkdtemp(prefix="meshlm-diloco-"))
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    todo = runs(a.inner, a.average, ddp=not a.no_ddp)
    if a.merge and Path(a.json).is_file():
        rows = [r for r in json.loads(Path(a.json).read_text())["rows"] if r["run"] not in todo]
    try:
        for name, args in todo.items():
            rows.append(measure(name, args, base, tmp))
            Path(a.json).write_text(json.dumps({"args": vars(a), "base": base, "rows": rows,
                                                "wall_s": time.perf_counter() - t0}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    plot(rows, Path(a.plot))
    ddp = next((r for r in rows if r["run"] == "ddp" and "final_val_loss" in r), None)
    print("\n| run | final val loss | vs DDP | bytes across islands per token | fewer than DDP "
          "| outer steps | median step (s) | wall (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "final_val_loss" not in r:
            print(f"| {r['run']} | failed | | | | | | |")
            continue
        rel = r["final_val_loss"] / ddp["final_val_loss"] - 1 if ddp else float("nan")
        fewer = ddp["bytes_per_token"] / r["bytes_per_token"] if ddp else float("nan")
        print(f"| {r['run']} | {r['final_val_loss']:.4f} | {rel:+.1%} | "
              f"{r['bytes_per_token']:,.0f} | {fewer:,.1f}x | {r['outer_steps']} | "
              f"{r['step_time_s']:.2f} | {r['wall_s']:.0f} |")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; wrote {a.json} and {a.plot}")


if __name__ == "__main__":
    main()
