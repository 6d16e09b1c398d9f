"""Peak memory of the largest rank per phase, for an ~80 M and a ~300 M model, six layouts.

Every run is the real command line, ``meshlm train`` (one process, or 4 local workers started by
its launcher), seq 128, fp32, global batch 4, 2 steps and the final checkpoint. From the run's
``metrics.jsonl`` (the largest rank's peak RSS per phase; the peak is reset between phases):

- construction: shard-only build of the model (``mem_construction_bytes``, step 1's record);
- steps: the largest ``mem_peak_bytes`` of steps 1-2;
- save: writing the final sharded checkpoint (``mem_save_bytes``);
- load: a resharding resume -- a copy of another layout's run directory (checkpoint files
  hard-linked, they are never written in place) resumed under this layout for one more step
  (``--train.steps=3 --run.resume=true``; ``mem_load_bytes`` of step 3's record). Every layout
  loads the one-process checkpoint; the one-process run loads the dp=4 zero=3 one.

Beside them: ``/usr/bin/time -v``'s "Maximum resident set size" of the run (the largest process
of the tree; see the note printed with the table), and the planner's predicted per-rank bytes
for the same layout (``meshlm train --dry-run``'s estimate: states + activations + transient +
buffers; the planner's ``cpu`` entry reserves nothing for the process runtime itself, which is
measured here separately as the baseline: the peak of a one-process run of the ``tiny`` preset
on the same data -- torch, meshlm, the data and a model of almost nothing).

Before each run the script waits until the machine has enough free memory for it (the
prediction plus the baseline, per rank); a run that never gets it is recorded as skipped.

    python benchmarks/scale.py [--models 80M 300M] [--layouts single dp4-zero3 ...]
        [--json benchmarks/results/scale.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshlm.config import load_config
from meshlm.planner.cli import config_workload, hardware_here
from meshlm.planner.memory import memory
from meshlm.train.metrics import read_metrics

MIB = 2**20
SEQ, BATCH, VOCAB, STEPS = 128, 4, 4096, 2
MESHLM = str(Path(sys.executable).with_name("meshlm"))
TIME = "/usr/bin/time"

# model name -> overrides of the ``small`` preset (tied embeddings, as the preset)
MODELS: dict[str, list[str]] = {
    "80M": ["--model.n_layers=12", "--model.dim=768", "--model.n_heads=12",
            "--model.n_kv_heads=4", "--model.ffn_hidden=2048"],
    "300M": ["--model.n_layers=24", "--model.dim=1024", "--model.n_heads=16",
             "--model.n_kv_heads=16", "--model.ffn_hidden=2816"],
}
# layout name -> (ranks, overrides); micro-batch: the global batch over the data-parallel ranks,
# and 1 under pipelining (4 micro-batches for the schedule)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, ["--train.micro_batch=4"]),
    "dp4-zero1": (4, ["--parallel.dp=4", "--parallel.zero=1", "--train.micro_batch=1"]),
    "dp4-zero2": (4, ["--parallel.dp=4", "--parallel.zero=2", "--train.micro_batch=1"]),
    "dp4-zero3": (4, ["--parallel.dp=4", "--parallel.zero=3", "--train.micro_batch=1"]),
    "tp4": (4, ["--parallel.tp=4", "--train.micro_batch=4"]),
    "tp2-pp2": (4, ["--parallel.tp=2", "--parallel.pp=2", "--train.micro_batch=1"]),
}
# whose checkpoint each layout loads in its resharding resume
RESUME_FROM = {name: "single" for name in LAYOUTS} | {"single": "dp4-zero3"}


def train_args(model: str, layout: str, run_dir: Path, steps: int, resume: bool) -> list[str]:
    return ["--model.preset=small", *MODELS[model], *LAYOUTS[layout][1],
            f"--data.seq_len={SEQ}", f"--data.vocab_size={VOCAB}",
            f"--train.global_batch={BATCH}", f"--train.steps={steps}", "--train.eval_every=0",
            "--run.sample_tokens=0", f"--run.dir={run_dir}",
            f"--run.resume={'true' if resume else 'false'}"]


def predicted(model: str, layout: str) -> dict[str, Any]:
    """The planner's per-rank bytes (most loaded pipeline stage), as ``train --dry-run``."""
    cfg = load_config(None, train_args(model, layout, Path("unused"), STEPS, False),
                      check_paths=False)
    work = config_workload(cfg, VOCAB)
    m = memory(work, cfg.layout(), hardware_here("scale benchmark"))
    return {"params": work.model.num_params(), "total": m.total,
            "items": {k: float(v) for k, v in m.items.items()}}


def baseline_rss(tmp: Path) -> int:
    """Peak RSS of one process running the trainer with a model of almost nothing: the
    ``tiny`` preset (0.4 M parameters) on the same data, one step."""
    run_dir = tmp / "baseline"
    args = ["--model.preset=tiny", f"--data.seq_len={SEQ}", f"--data.vocab_size={VOCAB}",
            f"--train.global_batch={BATCH}", f"--train.micro_batch={BATCH}", "--train.steps=1",
            "--train.eval_every=0", "--run.sample_tokens=0", f"--run.dir={run_dir}"]
    res = run_train(args, tmp / "baseline.log")
    if res["rc"]:
        raise RuntimeError(f"baseline run failed:\n{res['tail']}")
    rec = read_metrics(run_dir / "metrics.jsonl")[0]
    shutil.rmtree(run_dir, ignore_errors=True)
    return max(rec["mem_construction_bytes"], rec["mem_peak_bytes"], rec["mem_save_bytes"])


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def wait_for_memory(need: float, limit_s: float) -> bool:
    """Wait (up to ``limit_s``) until the machine has ``need`` bytes available."""
    t0 = time.monotonic()
    while mem_available() < need:
        if time.monotonic() - t0 > limit_s:
            return False
        time.sleep(10)
    return True


def run_train(args: list[str], log: Path) -> dict[str, Any]:
    """``meshlm train ARGS`` under ``/usr/bin/time -v``: exit status, wall time, max RSS."""
    timed = [TIME, "-v"] if os.access(TIME, os.X_OK) else []
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run([*timed, MESHLM, "train", *args], stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {"rc": rc, "wall_s": wall, "time_max_rss": int(m.group(1)) * 1024 if m else None,
            "tail": "" if rc == 0 else text[-3000:]}


def copy_run(src: Path, dst: Path) -> None:
    """A copy of a run directory; checkpoint shards hard-linked (written once, never edited)."""
    def link_or_copy(s: str, d: str) -> None:
        if s.endswith(".safetensors"):
            os.link(s, d)
        else:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=link_or_copy)


def measure(model: str, layouts: list[str], tmp: Path, base: int, wait_s: float,
            out: list[dict[str, Any]], on_row: Callable[[], None]) -> None:
    """Run ``model`` under every layout, then the resharding resumes; rows are appended to
    ``out`` as they start and filled in place (``on_row`` after each finished run)."""
    rows: dict[str, dict[str, Any]] = {}
    for layout in layouts:  # the training runs (each writes the checkpoint others load)
        ranks = LAYOUTS[layout][0]
        pred = predicted(model, layout)
        row = {"model": model, "params": pred["params"], "layout": layout, "ranks": ranks,
               "predicted_bytes": pred["total"], "predicted_items": pred["items"]}
        rows[layout] = row
        out.append(row)
        need = ranks * (pred["total"] + base) * 1.1
        if not wait_for_memory(need, wait_s):
            row["skipped"] = f"less than {need / 2**30:.1f} GiB available for {wait_s:.0f} s"
            print(f"{model} {layout}: skipped ({row['skipped']})", flush=True)
            continue
        run_dir = tmp / f"{model}-{layout}"
        res = run_train(train_args(model, layout, run_dir, STEPS, False),
                        tmp / f"{model}-{layout}.log")
        row.update(wall_s=res["wall_s"], time_max_rss=res["time_max_rss"])
        if res["rc"]:
            row["error"] = res["tail"]
            print(f"{model} {layout}: FAILED (exit {res['rc']})\n{res['tail']}", flush=True)
            continue
        recs = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
        row.update(construction=recs[1]["mem_construction_bytes"],
                   steps=max(recs[s]["mem_peak_bytes"] for s in range(1, STEPS + 1)),
                   save=recs[STEPS]["mem_save_bytes"],
                   step_time_s=[recs[s]["step_time_s"] for s in range(1, STEPS + 1)],
                   states_rank0={k: recs[STEPS][f"{k}_bytes"] for k in
                                 ("params", "grads", "optim")},
                   checkpoint_bytes=sum(p.stat().st_size for p in
                                        (run_dir / "checkpoints").rglob("*.safetensors")))
        print(f"{model} {layout}: construction {row['construction'] / MIB:.0f} MiB, steps "
              f"{row['steps'] / MIB:.0f} MiB, save {row['save'] / MIB:.0f} MiB, "
              f"{res['wall_s']:.0f} s", flush=True)
        if layout not in RESUME_FROM.values():  # (disk: no one loads it)
            shutil.rmtree(run_dir, ignore_errors=True)
        on_row()
    for layout in layouts:  # the resharding resumes
        row, src = rows[layout], RESUME_FROM[layout]
        row["load_from"] = src
        src_dir = tmp / f"{model}-{src}"
        if "construction" not in row or not (src_dir / "checkpoints").is_dir():
            continue
        need = row["ranks"] * (row["predicted_bytes"] + base) * 1.1
        if not wait_for_memory(need, wait_s):
            continue
        run_dir = tmp / f"{model}-{layout}-from-{src}"
        copy_run(src_dir, run_dir)
        res = run_train(train_args(model, layout, run_dir, STEPS + 1, True),
                        tmp / f"{model}-{layout}-from-{src}.log")
        if res["rc"]:
            row["load_error"] = res["tail"]
            print(f"{model} {layout} resuming {src}: FAILED (exit {res['rc']})\n{res['tail']}",
                  flush=True)
            continue
        rec = next(r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] == STEPS + 1)
        row.update(load=rec["mem_load_bytes"], load_construction=rec["mem_construction_bytes"],
                   load_step=rec["mem_peak_bytes"], load_wall_s=res["wall_s"])
        print(f"{model} {layout} resuming {src}: load {row['load'] / MIB:.0f} MiB", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        on_row()
    for layout in layouts:
        shutil.rmtree(tmp / f"{model}-{layout}", ignore_errors=True)


def peak(row: dict[str, Any]) -> int | None:
    """The run's largest-rank peak over construction, steps and save."""
    vals = [row.get(k) for k in ("construction", "steps", "save")]
    return max(vals) if None not in vals else None  # type: ignore[type-var]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    single = {r["model"]: r for r in rows if r["layout"] == "single" and peak(r)}
    for r in rows:
        ref = single.get(r["model"])
        if ref and peak(r):
            r["peak"] = peak(r)
            r["peak_vs_single"] = r["peak"] / ref["peak"]
            r["steps_vs_single"] = r["steps"] / ref["steps"]


def acceptance(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """dp=4 zero=3's peak at most half the one-process peak at 80 M, and lower still (relative
    to one process) at 300 M."""
    z3 = {r["model"]: r.get("peak_vs_single") for r in rows if r["layout"] == "dp4-zero3"}
    a, b = z3.get("80M"), z3.get("300M")
    return {"zero3_vs_single_80M": a, "zero3_vs_single_300M": b,
            "half_at_80M": a is not None and a <= 0.5,
            "falls_at_300M": a is not None and b is not None and b < a}


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x / MIB:,.0f}"


def print_table(rows: list[dict[str, Any]], base: int) -> None:
    print("\n| model | layout | ranks | construction | steps | save | load (from) | "
          "time -v max RSS | planner per rank | planner + baseline | peak / one process |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        load = f"{fmt(r.get('load'))} ({r.get('load_from', '-')})"
        ratio = f"{r['peak_vs_single']:.2f}" if r.get("peak_vs_single") else "-"
        note = f" ({r['skipped']})" if r.get("skipped") else (" (failed)" if r.get("error")
                                                              else "")
        print(f"| {r['model']} ({r['params'] / 1e6:.1f} M) | {r['layout']}{note} | {r['ranks']} "
              f"| {fmt(r.get('construction'))} | {fmt(r.get('steps'))} | {fmt(r.get('save'))} | "
              f"{load} | {fmt(r.get('time_max_rss'))} | {fmt(r['predicted_bytes'])} | "
              f"{fmt(r['predicted_bytes'] + base)} | {ratio} |")
    print(f"\nMiB, largest rank. baseline: a one-process run of the tiny preset (0.4 M "
          f"parameters), {base / MIB:.0f} MiB. peak = max(construction, steps, save). time -v: "
          "the kernel's peak at exit, which the trainer's per-phase resets of the peak "
          "(/proc/self/clear_refs) bring down to the peak since the last reset (after the "
          "save), so it is not the run's maximum.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--wait", type=float, default=900.0,
                    help="seconds to wait for enough free memory before a run")
    ap.add_argument("--json", default="benchmarks/results/scale.json")
    a = ap.parse_args()
    # the resume sources must run too
    layouts = [x for x in LAYOUTS if x in a.layouts or x in {RESUME_FROM[y] for y in a.layouts}]
    tmp = Path(tempfile.mkdtemp(prefix="meshlm-scale-"))
    base = baseline_rss(tmp)
    print(f"baseline RSS {base / MIB:.0f} MiB; models {a.models}; layouts {layouts}", flush=True)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def save() -> None:
        add_ratios(rows)
        out.write_text(json.dumps({
            "args": {"models": a.models, "layouts": layouts, "seq": SEQ, "global_batch": BATCH,
                     "vocab": VOCAB, "steps": STEPS, "dtype": "fp32"},
            "baseline_rss": base, "wall_s": time.perf_counter() - t0,
            "acceptance": acceptance(rows), "rows": rows}, indent=1))

    try:
        for model in a.models:
            measure(model, layouts, tmp, base, a.wait, rows, save)
            save()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows, base)
    acc = acceptance(rows)
    print(f"\ndp=4 zero=3 peak / one-process peak: 80M {acc['zero3_vs_single_80M']}, 300M "
          f"{acc['zero3_vs_single_300M']}; at most half at 80M: {acc['half_at_80M']}; lower "
          f"at 300M: {acc['falls_at_300M']}")
    print(f"total {time.perf_counter() - t0:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
