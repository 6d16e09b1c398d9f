"""Expert parallelism: tokens/s, peak memory per rank and all-to-all time for ep = 1, 2, 4.

Two MoE models (fp32, top-2, dropless, aux balancing): ``tiny`` -- the tests' tiny MoE with 8
experts (dim 64, expert width 64, 2 layers) -- and ``wide`` -- 16 experts of width 512 at dim
256 (4 layers, 3 of them MoE). Each trains in a spawned gloo world of 4 ranks (one thread
each) with dp = 4 and ep = 1 (plain data parallelism: every rank holds every expert), 2 and 4,
through meshlm's ``Trainer`` (the real step: sampler, forward, backward, DDP, clipping, AdamW,
router statistics); and in one process (``meshlm``'s one-process path, the plain loop).
Global batch ``4 x --micro`` sequences of ``--seq`` tokens. Measured per layout:

- step time: the slowest rank's, median over ``--steps`` steps after one warm-up step;
  tokens/s = global batch tokens / step time;
- all-to-all time: wall time inside ``Comm.all_to_all`` per step (dispatch + combine, forward
  and backward; blocking calls), the slowest rank's; and the bytes of the last step's log;
- memory: each rank's peak RSS growth over its RSS after construction (the peak reset through
  ``/proc/self/clear_refs``), and its parameter + gradient + optimizer bytes (engine count);
  the largest rank of each.

    OMP_NUM_THREADS=1 python benchmarks/expert_parallel.py [--steps 3] [--seq 256]
        [--micro 4] [--models tiny wide] [--out benchmarks/results/expert_parallel.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from meshlm.testing import run_world

MIB = 2**20
MODELS = {
    "tiny": ["--model.preset=tiny-moe", "--model.moe_experts=8", "--model.moe_shared_experts=0"],
    "wide": ["--model.preset=tiny-moe", "--model.dim=256", "--model.n_layers=4",
             "--model.n_heads=8", "--model.n_kv_heads=4", "--model.moe_experts=16",
             "--model.moe_ffn_hidden=512", "--model.moe_first_dense=1",
             "--model.ffn_hidden=688", "--model.moe_shared_experts=0"],
}


def resident() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    return 0


def peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    return 0


def body(args: list[str], steps: int) -> dict[str, Any]:
    """World body: warm-up + ``steps`` timed training steps of one layout on this rank."""
    import torch
    import torch.distributed as dist

    from meshlm.config import load_config
    from meshlm.distributed.comm import Comm, CommLog
    from meshlm.train.trainer import Trainer, pin_malloc_mmap_threshold

    pin_malloc_mmap_threshold()
    torch.set_num_threads(1)
    spent = [0.0]
    plain = Comm.all_to_all

    def timed(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        plain(self, *a, **k)
        spent[0] += time.perf_counter() - t0

    Comm.all_to_all = timed
    log = CommLog()
    trainer = Trainer(load_config(None, args), log=lambda _m: None, progress=False,
                      comm_log=log)
    base = resident()
    Path("/proc/self/clear_refs").write_text("5")
    times, a2a = [], []
    for step in range(1, steps + 2):
        log.reset()
        spent[0] = 0.0
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step(step)
        dt = time.perf_counter() - t0
        if step > 1:
            times.append(dt)
            a2a.append(spent[0])
    Comm.all_to_all = plain
    state = trainer.model_part.engine.state_bytes()
    return {"step_s": times, "a2a_s": a2a, "growth": peak() - base,
            "state_bytes": sum(state.values()), "params_bytes": state["params"],
            "comm": log.bytes_by_op()}


def measure(model: str, ep: int | None, a: argparse.Namespace) -> dict[str, Any]:
    world = 1 if ep is None else 4
    args = MODELS[model] + [
        f"--data.seq_len={a.seq}", f"--train.global_batch={4 * a.micro}",
        f"--train.micro_batch={a.micro * (4 if ep is None else 1)}", "--train.steps=100",
        "--run.sample_tokens=0", "--train.eval_every=0", "--train.checkpoint_every=0",
        f"--run.dir={a.tmp / f'{model}-{ep}'}"]
    if ep is not None:
        args += ["--parallel.dp=4", f"--parallel.ep={ep}"]
    ranks = run_world(world, body, args, a.steps, timeout=1800.0)
    step = statistics.median(max(r["step_s"][i] for r in ranks) for i in range(a.steps))
    a2a = statistics.median(max(r["a2a_s"][i] for r in ranks) for i in range(a.steps))
    return {"model": model, "world": world, "ep": ep or 1,
            "layout": "one process" if ep is None else f"dp=4 ep={ep}",
            "step_s": step, "tokens_per_s": 4 * a.micro * a.seq / step, "a2a_s": a2a,
            "a2a_bytes": max(r["comm"].get("all_to_all/ep", 0) for r in ranks),
            "peak_growth_mib": max(r["growth"] for r in ranks) / MIB,
            "state_mib": max(r["state_bytes"] for r in ranks) / MIB,
            "params_mib": max(r["params_bytes"] for r in ranks) / MIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--out", default="benchmarks/results/expert_parallel.json")
    a = ap.parse_args()
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        a.tmp = Path(tmp)
        for model in a.models:
            for ep in (None, 1, 2, 4):
                rows.append(measure(model, ep, a))
                r = rows[-1]
                print(f"{r['model']:5} {r['layout']:12} {r['tokens_per_s']:9,.0f} tok/s  "
                      f"step {r['step_s']:.3f} s  all-to-all {r['a2a_s']:.3f} s "
                      f"({r['a2a_bytes'] / MIB:.1f} MiB)  peak +{r['peak_growth_mib']:.0f} MiB  "
                      f"params {r['params_mib']:.1f} MiB  states {r['state_mib']:.1f} MiB",
                      flush=True)
    del a.tmp
    print("\n| model | layout | tokens/s | step (s) | all-to-all (s) | all-to-all MiB/step "
          "| peak growth (MiB) | params (MiB) | params+grads+Adam (MiB) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['layout']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | "
              f"{r['a2a_s']:.3f} | {r['a2a_bytes'] / MIB:.1f} | {r['peak_growth_mib']:.0f} | "
              f"{r['params_mib']:.1f} | {r['state_mib']:.1f} |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "dtype": "fp32", "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
