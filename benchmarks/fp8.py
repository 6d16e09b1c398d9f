"""FP8 against its 16-bit baseline: validation loss after the same steps, and tokens/s.

One process, the default corpus, the ``small`` preset (or ``--preset``), the same seed, data
and schedule for every run (``meshlm train`` command lines):

- ``baseline``: ``precision.dtype=<--baseline>`` (bf16 by default);
- ``fp8-<recipe>``: ``precision.dtype=fp8`` with ``precision.fp8_recipe=<recipe>`` for each of
  ``--recipes``, everything outside the float8 linears in ``--rest`` (default: the baseline's
  dtype, so the float8 linears are the only difference).

Reported per run: the validation loss at the end (``--eval-batches`` batches), its relative
difference to the baseline's (the issue's bound: 2 % after 200 steps of ``small``), the median
tokens/s of the steps after the first two, and its ratio to the baseline. On a CPU without
native bf16 matmul (AVX2-only x86), bf16 runs through a slow fallback: use
``--baseline fp32`` there (``--rest`` follows), which compares the float8 linears against fp32
ones. Speed on a CPU says nothing about a GPU (``torch._scaled_mm`` on CPU is a reference
kernel); GPU rows are ``benchmarks/gpu.py``'s.

    python benchmarks/fp8.py [--steps 200] [--baseline bf16|fp32] [--rest bf16|fp32]
        [--recipes tensorwise rowwise] [--json benchmarks/results/fp8.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import run_train  # noqa: E402

from meshlm.train.metrics import read_metrics  # noqa: E402


def common(preset: str, steps: int, eval_batches: int) -> list[str]:
    return [f"--model.preset={preset}", f"--train.steps={steps}", f"--train.eval_every={steps}",
            f"--train.eval_batches={eval_batches}", "--run.sample_tokens=0",
            "--train.log_every=25"]


def runs(baseline: str, rest: str, recipes: list[str]) -> dict[str, list[str]]:
    out = {"baseline": [f"--precision.dtype={baseline}"]}
    for recipe in recipes:
        out[f"fp8-{recipe}"] = ["--precision.dtype=fp8", f"--precision.fp8_recipe={recipe}",
                                f"--precision.fp8_rest={rest}"]
    return out


def measure(name: str, args: list[str], run_dir: Path) -> dict[str, Any]:
    res = run_train([*args, f"--run.dir={run_dir}"], run_dir.with_suffix(".log"))
    if res["rc"] != 0:
        return {"run": name, "error": res["tail"][-1500:]}
    recs = read_metrics(run_dir / "metrics.jsonl")
    val = [r["val_loss"] for r in recs if r.get("val_loss") is not None]
    speeds = [r["tokens_per_s"] for r in recs[2:]] or [recs[-1]["tokens_per_s"]]
    return {"run": name, "args": args, "final_loss": recs[-1]["loss"],
            "val_loss": val[-1] if val else None, "tokens_per_s": statistics.median(speeds),
            "wall_s": res["wall_s"], "max_rss_bytes": res["time_max_rss"]}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    for r in rows:
        if "error" in r or "error" in base:
            continue
        r["val_rel_diff"] = (r["val_loss"] - base["val_loss"]) / base["val_loss"]
        r["speed_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| run | validation loss | vs baseline | tokens/s | speed ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['run']} | error | - | - | - |")
            continue
        print(f"| {r['run']} | {r['val_loss']:.4f} | {r['val_rel_diff']:+.2%} | "
              f"{r['tokens_per_s']:,.0f} | {r['speed_ratio']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--baseline", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--rest", choices=("bf16", "fp32"), default=None,
                    help="dtype outside the float8 linears (default: the baseline's)")
    ap.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"])
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rest = a.rest or a.baseline
    tmp = Path(tempfile.mkdtemp(prefix="meshlm-fp8-"))
    rows = []
    t0 = time.perf_counter()
    for name, args in runs(a.baseline, rest, a.recipes).items():
        rows.append(measure(name, common(a.preset, a.steps, a.eval_batches) + args, tmp / name))
        print(f"{name}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    add_ratios(rows)
    print(f"\n{a.preset}, {a.steps} steps, baseline {a.baseline}, fp8 rest {rest}\n")
    print_table(rows)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"preset": a.preset, "steps": a.steps,
                                      "baseline": a.baseline, "rest": rest, "rows": rows},
                                     indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
