"""Context parallelism: tokens/s and peak memory per rank vs sequence length, cp and mode.

A tiny-width Llama (dim 128, 2 layers, 8 heads, 4 KV heads, vocabulary 512, fp32) trains on
one sequence per step (micro-batch 1) of 1k ... 16k tokens, at cp = 1 (one process) and at
cp = 2 and 4 in each ``parallel.cp_attention`` mode (zigzag, ring, ulysses). One spawned gloo
world per cp (one thread per rank) runs every sequence length and mode in turn, each on a
fresh model (``build_model`` + ``parallelize``): one warm-up step, then ``--steps`` timed steps
of forward + backward + ``finish_grads`` + clipping + AdamW step + ``zero_grad``. Every rank
draws the same random token ids (same seed) and keeps its share with ``cp.shard``. Measured:

- step time: per step, the slowest rank; the median over the timed steps. tokens/s = sequence
  length / step time (the whole cp group's throughput; per rank it is that / cp);
- memory: growth of each rank's peak RSS during the steps (warm-up included; the peak is reset
  through ``/proc/self/clear_refs`` by ``PhasePeaks``) over its RSS right after construction;
  glibc's mmap threshold is pinned as in ``meshlm train``, so freed buffers leave the process;
- communication: the comm log of the last timed step -- sends on the cp axis (ring modes) or
  all-to-all input bytes (ulysses), against the formulas of ``ring_attention.py`` and
  ``ulysses.py``, and the gradient all-reduce over ``dp_cp`` (= cp here);
- a parity check: the first step's loss (the mean of the cp ranks' losses) and global gradient
  norm vs the one-process run on the same weights and tokens;
- the machine's other load: CPU time the machine spent busy (``/proc/stat``) minus the ranks'
  own, over the wall time of the run, in cores; rows above 0.2 are flagged (a shared box).

Then the longest sequence whose step fits a per-rank memory budget (``--budget-mib`` of peak
growth, largest rank), per cp in ``--budget-modes``: a line through the two longest measured
points predicts it on a 1k grid; the prediction is then run (warm-up + 1 step: AdamW's moments
exist from the second step on, and raise its peak), and the sequence is moved by 1k until the
largest one that fits and the next one that does not have both been run (capped at
``--budget-max``).

torch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``)
is tried in the cp = 2 world on the same model (its SDPA patched in, the same zigzag / head-tail
shares and rotary positions, meshlm's DDP engine for the gradients), with SDPA's default backend
choice and then forced to the math backend: measured like the others if it runs; otherwise
the errors are recorded.

    OMP_NUM_THREADS=1 python benchmarks/context_parallel.py [--quick] [--steps 3]
        [--seqs 1024 2048 ...] [--cps 1 2 4] [--budget-mib 256]
        [--out benchmarks/results/context_parallel.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from meshlm.testing import run_world

MIB = 2**20
MODES = ("zigzag", "ring", "ulysses")
SEED = 1234
OTHER_LOAD = 0.2  # cores busy outside the benchmark above which a row's timing is flagged
MODEL = {"name": "cp-bench", "vocab_size": 512, "dim": 128, "n_layers": 2, "n_heads": 8,
         "n_kv_heads": 4, "ffn_hidden": 352, "max_seq_len": 65536}


# ------------------------------------------------------------------------- one rank's work

def _portable(text: str) -> str:
    """A traceback with the repository and site-packages prefixes cut from its paths."""
    root = str(Path(__file__).resolve().parents[1]) + "/"
    text = text.replace(root, "")
    return re.sub(r'"[^"]*/site-packages/', '"', text)

def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores, ``/proc/stat``)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def rss_bytes() -> int:
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class Rank:
    """This rank's mesh, comm (with log) and the runs of one world."""

    def __init__(self, cp: int) -> None:
        from meshlm.distributed.comm import Comm, CommLog
        from meshlm.distributed.mesh import Mesh
        from meshlm.layout import Layout
        from meshlm.models.config import ModelConfig
        from meshlm.train.metrics import PhasePeaks
        from meshlm.train.trainer import pin_malloc_mmap_threshold

        pin_malloc_mmap_threshold()  # as ``meshlm train``: freed buffers go back to the OS
        self.cp = cp
        self.mesh = Mesh(Layout(cp=cp))
        self.comm = Comm(self.mesh, CommLog(enabled=False))
        self.model_cfg = ModelConfig(**MODEL)
        self.peaks = PhasePeaks(torch.device("cpu"))

    def world_max(self, value: float) -> float:
        return self.comm.max_scalar(value) if self.cp > 1 else value

    def gather(self, value: float) -> list[float]:
        """``value`` of every rank, in rank order (a collective)."""
        if self.cp == 1:
            return [value]
        mine = torch.tensor([float(value)], dtype=torch.float64)
        every = torch.empty(self.cp, dtype=torch.float64)
        self.comm.all_gather(every, mine, "world")
        self.comm.log.records.clear()
        return [float(x) for x in every.tolist()]

    def build(self, mode: str, torch_cp: str = ""):  # noqa: ANN201
        """A fresh model parallelised over cp in ``mode`` (under ``torch_cp``: meshlm's
        shares, positions and DDP engine, attention back to plain SDPA for torch's CP)."""
        from meshlm.config import ParallelSection, TrainSection
        from meshlm.models.llama import build_model
        from meshlm.parallel import parallelize

        model = build_model(self.model_cfg, SEED)
        par = parallelize(model, self.comm, ParallelSection(cp=self.cp, cp_attention=mode, dp=1),
                          TrainSection(grad_clip=1.0))
        if torch_cp:
            for layer in model.layers.values():
                del layer.attention.core  # the class's SDPA, which torch's CP patches
        return model, par

    def run(self, seq: int, mode: str, steps: int, torch_cp: str = "") -> dict[str, Any]:
        """Warm-up + ``steps`` timed steps of ``seq`` tokens; this rank's measurements.
        ``torch_cp``: "" (meshlm), or torch's context_parallel with SDPA's "default" backend
        choice or forced to "math"."""
        model, par = self.build(mode, torch_cp)
        engine, cpar = par.engine, par.cp
        cp_mesh = self.mesh.device_mesh["cp"] if torch_cp else None
        base = rss_bytes()
        self.peaks.reset()
        times, losses, norms, comm = [], [], [], {}
        self.comm.barrier()
        cpu0, busy0, wall0 = own_cpu_s(), machine_busy_s(), time.perf_counter()
        for step in range(steps + 1):
            g = torch.Generator().manual_seed(SEED * 1000 + step)  # same ids on every rank
            ids = torch.randint(0, self.model_cfg.vocab_size, (1, seq + 1), generator=g)
            inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
            last = step == steps
            self.comm.log.records.clear()
            self.comm.log.enabled = last
            self.comm.barrier()
            t0 = time.perf_counter()
            if torch_cp:
                from torch.distributed.tensor.experimental import context_parallel
                from torch.nn.attention import SDPBackend, sdpa_kernel

                backend = (sdpa_kernel(SDPBackend.MATH) if torch_cp == "math"
                           else contextlib.nullcontext())
                # torch shards the whole-sequence buffers itself (head-tail = zigzag shares)
                with backend, context_parallel(cp_mesh, buffers=[inputs, targets],
                                               buffer_seq_dims=[1, 1],
                                               no_restore_buffers={inputs, targets}):
                    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                    loss.backward()
            else:
                if cpar is not None:
                    inputs, targets = cpar.shard(inputs), cpar.shard(targets)
                engine.set_sync(True)
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                loss.backward()
            engine.finish_grads()
            norms.append(float(engine.clip_grad_norm(1.0)))
            engine.step(1e-3)
            engine.zero_grad()
            losses.append(float(loss.detach()))
            times.append(time.perf_counter() - t0)
            if last:
                comm = self.comm.log.bytes_by_op()
            self.comm.log.enabled = False
        grown = self.peaks.measure("steps") - base
        del model, par, engine, cpar
        return {"seq": seq, "mode": mode if self.cp > 1 else "-", "times": times[1:],
                "warmup_s": times[0], "growth": grown, "base_rss": base,
                "cpu_s": own_cpu_s() - cpu0, "machine_busy_s": machine_busy_s() - busy0,
                "wall_s": time.perf_counter() - wall0,
                "loss1": losses[0], "grad_norm1": norms[0], "comm": comm}


def collect(rank: Rank, r: dict[str, Any]) -> dict[str, Any]:
    """Every rank's numbers of one run on every rank (collectives: all ranks call)."""
    r["growth_ranks"] = rank.gather(r["growth"])
    r["step_time_ranks"] = [rank.gather(t) for t in r["times"]]
    r["loss1_ranks"] = rank.gather(r["loss1"])
    # cores kept busy by anything but this world's ranks during the run (a shared machine)
    others = r["machine_busy_s"] - sum(rank.gather(r["cpu_s"]))
    r["other_load"] = rank.world_max(others / r["wall_s"])
    return r


def budget_search(rank: Rank, mode: str, rows: list[dict[str, Any]], budget: int, grid: int,
                  cap: int) -> dict[str, Any]:
    """Longest multiple of ``grid`` whose largest-rank step growth fits ``budget`` bytes."""
    pts = sorted((r["seq"], max(r["growth_ranks"])) for r in rows if r["mode"] in (mode, "-"))
    (s1, g1), (s2, g2) = pts[-2], pts[-1]
    slope = (g2 - g1) / (s2 - s1)
    pred = int((s2 + (budget - g2) / slope) // grid * grid) if slope > 0 else cap
    pred = max(grid, min(cap, pred))
    tried: dict[int, float] = dict(pts)

    def growth(seq: int) -> float:  # largest rank's growth at ``seq`` (measured once)
        if seq not in tried:
            # two steps: AdamW's moments exist from the second step on (they raise its peak)
            tried[seq] = max(collect(rank, rank.run(seq, mode, 1))["growth_ranks"])
        return tried[seq]

    seq = pred
    while True:
        if growth(seq) <= budget:
            if seq + grid > cap or growth(seq + grid) > budget:
                best = seq
                break
            seq += grid
        elif seq - grid < grid:
            best = 0
            break
        else:
            seq -= grid
    return {"cp": rank.cp, "mode": mode if rank.cp > 1 else "-", "budget": budget,
            "fit": {"s1": s1, "g1": g1, "s2": s2, "g2": g2, "bytes_per_token": slope},
            "predicted": pred, "longest": best, "capped": best + grid > cap,
            "tried": {str(s): g for s, g in sorted(tried.items())}}


def torch_cp_probe(rank: Rank, seq: int, steps: int) -> dict[str, Any]:
    """torch's context_parallel on the same model, with SDPA's default backend choice, then
    forced to the math backend: measured with the first that runs, else both errors."""
    errors = {}
    for backend in ("default", "math"):
        try:
            r = rank.run(seq, "zigzag", steps, torch_cp=backend)
            ok = 1.0
        except Exception as e:  # every rank fails at the same op (before any collective)
            r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                 # (paths shown relative to the installation: nothing of this machine)
                 "traceback": _portable(traceback.format_exc()[-2500:])}
            ok = 0.0
        if rank.world_max(1.0 - ok) == 0:
            return {"ran": True, "backend": backend, "errors": errors, **collect(rank, r)}
        errors[backend] = r if not ok else {"error": "failed on another rank"}
    return {"ran": False, "errors": errors}


def world(cp: int, plan: dict[str, Any]) -> dict[str, Any]:
    """Every measurement of one cp world (runs on every rank; rank 0's result is used)."""
    rank = Rank(cp)
    modes = plan["modes"] if cp > 1 else ["zigzag"]
    for mode in modes:  # one-time costs (gloo buffers, lazy init) out of the first row
        collect(rank, rank.run(plan["seqs"][0], mode, 0))
    rows = []
    for seq in plan["seqs"]:
        for mode in modes:
            t0 = time.perf_counter()
            rows.append(collect(rank, rank.run(seq, mode, plan["steps"])))
            if rank.mesh.rank == 0 and plan["verbose"]:
                r = rows[-1]
                med = statistics.median(max(x) for x in r["step_time_ranks"])
                print(f"  cp={cp} {r['mode']:>7} seq {seq:>6}: step {med:.3f} s, growth "
                      f"{max(r['growth_ranks']) / MIB:.0f} MiB ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
    budgets = []
    if plan["budget"]:
        for mode in (plan["budget_modes"] if cp > 1 else ["zigzag"]):
            t0 = time.perf_counter()
            budgets.append(budget_search(rank, mode, rows, plan["budget"], plan["grid"],
                                         plan["budget_max"]))
            if rank.mesh.rank == 0 and plan["verbose"]:
                b = budgets[-1]
                print(f"  cp={cp} {b['mode']:>7} budget {plan['budget'] / MIB:.0f} MiB: longest "
                      f"{b['longest']} (predicted {b['predicted']}; "
                      f"{time.perf_counter() - t0:.0f} s)", flush=True)
    probe = torch_cp_probe(rank, plan["torch_seq"], plan["steps"]) if cp in plan["torch_cps"] else None
    return {"rows": rows, "budgets": budgets, "torch_cp": probe}


# ------------------------------------------------------------------------- theory and tables
def expected_cp_bytes(mode: str, cp: int, seq: int) -> int:
    """Bytes one rank sends (ring: sends; ulysses: all-to-all input) on the cp axis per step,
    from the docstrings of ``ring_attention.py`` and ``ulysses.py`` (fp32, micro-batch 1)."""
    m = MODEL
    hd = m["dim"] // m["n_heads"]
    if cp == 1:
        return 0
    if mode == "ulysses":
        t = (seq // cp) * hd * 4
        return m["n_layers"] * 2 * (2 * m["n_heads"] + 2 * m["n_kv_heads"]) * t
    kv = 2 * m["n_kv_heads"] * (seq // cp) * hd * 4
    return m["n_layers"] * 3 * (cp - 1) * kv


def summarize(cp: int, r: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    step = statistics.median(max(x) for x in r["step_time_ranks"])
    comm = r["comm"]
    cp_bytes = comm.get("send/cp", 0) + comm.get("all_to_all/cp", 0)
    out = {"cp": cp, "mode": r["mode"], "seq": r["seq"], "step_time_s": step,
           "tokens_per_s": r["seq"] / step,
           "step_time_per_rank_s": [statistics.median(x[i] for x in r["step_time_ranks"])
                                    for i in range(cp)],
           "growth_max": max(r["growth_ranks"]), "growth_ranks": r["growth_ranks"],
           "cp_bytes": cp_bytes, "cp_bytes_expected": expected_cp_bytes(r["mode"], cp, r["seq"]),
           "grad_allreduce_bytes": comm.get("all_reduce/dp_cp", 0), "comm": comm,
           "loss1": statistics.fmean(r["loss1_ranks"]), "grad_norm1": r["grad_norm1"],
           "other_load": r["other_load"]}
    if ref is not None:
        out["speedup"] = ref["step_time_s"] / step
        out["memory_ratio"] = out["growth_max"] / ref["growth_max"]
        out["loss1_rel_diff"] = abs(out["loss1"] - ref["loss1"]) / abs(ref["loss1"])
        out["grad_norm1_rel_diff"] = abs(out["grad_norm1"] - ref["grad_norm1"]) / ref["grad_norm1"]
    return out


def mib(x: float) -> str:
    return f"{x / MIB:,.1f}"


def print_tables(rows: list[dict[str, Any]], budgets: list[dict[str, Any]],
                 probe: dict[str, Any] | None, budget: int) -> None:
    print("\n| seq | cp | mode | step (s) | tokens/s | speed-up vs cp=1 | peak growth, largest "
          "rank (MiB) | all ranks (MiB) | / cp=1 | cp sends/step (MiB) | = formula | grad "
          "all-reduce (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ranks = ", ".join(f"{g / MIB:.0f}" for g in r["growth_ranks"])
        sp = f"{r['speedup']:.2f}" if "speedup" in r else "-"
        mr = f"{r['memory_ratio']:.2f}" if "memory_ratio" in r else "-"
        ok = "yes" if r["cp_bytes"] == r["cp_bytes_expected"] else "NO"
        print(f"| {r['seq']} | {r['cp']} | {r['mode']} | {r['step_time_s']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {sp} | {mib(r['growth_max'])} | {ranks} | {mr} | "
              f"{mib(r['cp_bytes'])} | {ok if r['cp'] > 1 else '-'} | "
              f"{mib(r['grad_allreduce_bytes'])} |")
    order = {m: i for i, m in enumerate(("-", *MODES))}
    cols = sorted({(r["cp"], r["mode"]) for r in rows}, key=lambda c: (c[0], order[c[1]]))
    seqs = sorted({r["seq"] for r in rows})
    by = {(r["cp"], r["mode"], r["seq"]): r for r in rows}
    head = " | ".join("cp=1" if cp == 1 else f"cp={cp} {m}" for cp, m in cols)
    for title, key, fmt in (("tokens/s", "tokens_per_s", "{:,.0f}"),
                            ("peak RSS growth of the largest rank, MiB", "growth_max", None)):
        print(f"\n{title}:\n\n| seq | {head} |\n|---|{'---|' * len(cols)}")
        for s in seqs:
            cells = []
            for cp, m in cols:
                r = by.get((cp, m, s))
                cells.append("-" if r is None else
                             (fmt.format(r[key]) if fmt else f"{r[key] / MIB:,.0f}"))
            print(f"| {s} | " + " | ".join(cells) + " |")
    worst = max((max(r.get("loss1_rel_diff", 0), r.get("grad_norm1_rel_diff", 0)) for r in rows),
                default=0.0)
    busy = [f"cp={r['cp']} {r['mode']} {r['seq']}: {r['other_load']:.2f}" for r in rows
            if r["other_load"] > OTHER_LOAD]
    print(f"\nother load on the machine during a run (cores busy outside this benchmark's ranks):"
          f" largest {max(r['other_load'] for r in rows):.2f}"
          + (f"; above {OTHER_LOAD} (timings not clean): {', '.join(busy)}" if busy else ""))
    print(f"\nparity with cp=1 (first step's loss and gradient norm, same weights and tokens): "
          f"largest relative difference {worst:.1e}")
    if budgets:
        print(f"\nlongest sequence (1k grid) whose step fits {budget / MIB:.0f} MiB of peak growth "
              "on the largest rank:\n\n| cp | mode | predicted | longest that fits (run) | its "
              "growth (MiB) | next (MiB) | MiB per 1k tokens |\n|---|---|---|---|---|---|---|")
        for b in budgets:
            tried = {int(k): v for k, v in b["tried"].items()}
            nxt = tried.get(b["longest"] + 1024)
            print(f"| {b['cp']} | {b['mode']} | {b['predicted']} | {b['longest']}"
                  f"{' (cap)' if b['capped'] else ''} | {mib(tried.get(b['longest'], 0))} | "
                  f"{mib(nxt) if nxt is not None else '-'} | "
                  f"{b['fit']['bytes_per_token'] * 1024 / MIB:.1f} |")
    if probe is not None:
        if probe["ran"]:
            print(f"\ntorch context_parallel (cp=2, SDPA {probe['backend']}), seq {probe['seq']}: "
                  f"step {probe['step_time_s']:.3f} s, {probe['tokens_per_s']:,.0f} tokens/s, "
                  f"peak growth {mib(probe['growth_max'])} MiB (largest rank)")
        else:
            print("\ntorch context_parallel (cp=2, CPU, gloo) did not run:\n" + "\n".join(
                f"- SDPA backend {b}: {e['error']}" for b, e in probe["errors"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--cps", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    ap.add_argument("--budget-mib", type=float, default=256.0,
                    help="per-rank peak growth budget; 0 skips the search")
    ap.add_argument("--budget-modes", nargs="*", default=["zigzag"], choices=MODES)
    ap.add_argument("--budget-max", type=int, default=65536)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1k-4k, 1 timed step, budget search capped at 8k")
    ap.add_argument("--out", default="benchmarks/results/context_parallel.json")
    a = ap.parse_args()
    if a.quick:
        a.seqs, a.steps, a.budget_max = [1024, 2048, 4096], 1, 8192
    grid = 1024
    bad = [s for s in a.seqs if s % (2 * max(a.cps)) or s > MODEL["max_seq_len"]]
    if bad or len(a.seqs) < 2:
        ap.error(f"need >= 2 sequence lengths, multiples of 2 * cp up to max_seq_len: {bad}")
    plan = {"seqs": sorted(a.seqs), "modes": a.modes, "steps": a.steps,
            "budget": int(a.budget_mib * MIB), "budget_modes": a.budget_modes, "grid": grid,
            "budget_max": min(a.budget_max, MODEL["max_seq_len"]), "torch_cps": [2],
            "torch_seq": min(a.seqs), "verbose": True}
    print(f"model {MODEL}, fp32, micro-batch 1; cp {a.cps}, modes {a.modes}; seqs {plan['seqs']}; "
          f"{a.steps} timed steps after 1 warm-up; gloo, 1 thread per rank, "
          f"{torch.get_num_threads()} thread(s) here", flush=True)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    raw: dict[int, dict[str, Any]] = {}
    for cp in a.cps:
        t1 = time.perf_counter()
        raw[cp] = run_world(cp, world, cp, plan, timeout=1800.0)[0]
        print(f"cp={cp}: {time.perf_counter() - t1:.0f} s", flush=True)
    ref = {r["seq"]: summarize(1, r, None) for r in raw[1]["rows"]} if 1 in raw else {}
    rows = [summarize(cp, r, ref.get(r["seq"]) if cp > 1 else None)
            for cp in a.cps for r in raw[cp]["rows"]]
    budgets = [b for cp in a.cps for b in raw[cp]["budgets"]]
    probe = next((raw[cp]["torch_cp"] for cp in a.cps if raw[cp]["torch_cp"] is not None), None)
    if probe is not None and probe["ran"]:
        probe = {"ran": True, "backend": probe["backend"],
                 **summarize(2, probe, ref.get(probe["seq"]))}
    print_tables(rows, budgets, probe, plan["budget"])
    wall = time.perf_counter() - t0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "model": MODEL, "dtype": "fp32",
                               "torch": torch.__version__, "wall_s": wall,
                               "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                               "rows": rows,
                               "budgets": budgets, "torch_context_parallel": probe}, indent=1))
    print(f"\ntotal {wall:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
