"""The data loader's share of a training step, at steady state.

One process, the default corpus prepared as a sharded dataset, the ``small`` preset with its
default batch (``train.global_batch`` sequences of ``data.seq_len``). Side by side in one run:

- ``step``: the median time of a ``small`` training step (``meshlm train``, steps after the
  second, from the metrics' tokens/s);
- the loader: the median time to draw one step's global batch and read this rank's
  micro-batches from the memory-mapped shards (``StepSampler.rank_micro_batches``, what the
  trainer calls each step), for one source, one source with document ids (``data.doc_mask``),
  a mixture of two sources (0.7 / 0.3) with and without document ids, and a context-parallel
  share (cp 2, zigzag: only those positions are read).

The loader's share is loader / step; the goal is under 1 %.

    python benchmarks/loader.py [--draws 300] [--train-steps 8] [--json benchmarks/results/loader.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from meshlm.config import load_config
from meshlm.data import build_data
from meshlm.data.sampler import Source, StepSampler
from meshlm.parallel.context import share_positions
from meshlm.train.metrics import read_metrics
from meshlm.train.parts.batches import sources
from meshlm.train.trainer import train


def step_time(args: list[str], steps: int, run_dir: Path) -> float:
    """Median seconds per training step of ``small`` (steps after the second)."""
    cfg = load_config(None, [*args, f"--train.steps={steps}", f"--run.dir={run_dir}",
                             "--train.eval_every=0", "--run.sample_tokens=0",
                             "--train.log_every=1"])
    train(cfg, log=lambda _m: None, progress=False)
    recs = read_metrics(run_dir / "metrics.jsonl")
    tokens = cfg.train.global_batch * cfg.data.seq_len
    return statistics.median(tokens / r["tokens_per_s"] for r in recs[2:])


def loader_time(sampler: StepSampler, micro: int, draws: int, positions: Any = None) -> float:
    """Median seconds to produce one step's micro-batches of rank 0 (dp 1)."""
    for k in range(5):  # (warm: pages of the mapped shards, numpy's first calls)
        sampler.rank_micro_batches(k, 0, 1, micro, positions)
    times = []
    for k in range(5, 5 + draws):
        t0 = time.perf_counter()
        sampler.rank_micro_batches(k, 0, 1, micro, positions)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--train-steps", type=int, default=8)
    ap.add_argument("--json", default="benchmarks/results/loader.json")
    a = ap.parse_args()
    args = ["--model.preset=small"]
    cfg = load_config(None, args)
    data = build_data(cfg.data, log=lambda _m: None)
    seq, g, seed = cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed
    micro = g  # (what one process with the default micro-batch reads per step)
    one = sources(data, "train")
    mix = [Source(one[0].tokens, 0.7, one[0].doc_starts, "a"),
           Source(one[0].tokens, 0.3, one[0].doc_starts, "b")]
    cases = {
        "one source": (StepSampler(one, seq, g, seed), None),
        "one source, doc_mask": (StepSampler(one, seq, g, seed, doc_mask=True), None),
        "mix 0.7/0.3": (StepSampler(mix, seq, g, seed), None),
        "mix 0.7/0.3, doc_mask": (StepSampler(mix, seq, g, seed, doc_mask=True), None),
        "cp 2 zigzag share, doc_mask": (StepSampler(one, seq, g, seed, doc_mask=True),
                                        share_positions(seq, 2, 0, "zigzag")),
    }
    with tempfile.TemporaryDirectory() as tmp:
        step = step_time(args, a.train_steps, Path(tmp) / "run")
    rows = []
    for name, (sampler, positions) in cases.items():
        t = loader_time(sampler, micro, a.draws, positions)
        rows.append({"loader": name, "ms_per_step": 1e3 * t, "share_of_step": t / step})
    print(f"small: {g} x {seq} tokens per step, step {step * 1e3:.0f} ms "
          f"({len(data.train_tokens):,} train tokens in "
          f"{len(getattr(data.train_tokens, 'doc_starts', []))} documents)")
    print(f"{'loader':32s} {'ms / step':>10s} {'share of step':>14s}")
    for r in rows:
        print(f"{r['loader']:32s} {r['ms_per_step']:10.3f} {100 * r['share_of_step']:13.3f}%")
    out = {"preset": "small", "global_batch": g, "seq_len": seq, "step_s": step, "rows": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
