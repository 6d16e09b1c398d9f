"""The pipeline bubble the executor measures against the planner's prediction, every schedule.

Each schedule trains a few steps at each pp (gloo, one thread per rank) through meshlm's
trainer. From the executor's timeline of a step (``PipelineExecutor.timeline``: every compute
action's start and end on the rank's clock, here started when the step starts -- the executor
starts it at the rank's first compute, so its own ``pp_bubble`` leaves out a rank's wait for
its first input) come the measured bubble -- each rank's idle share of the step, ``1 - busy /
step``, the step running from the first rank's start to the last rank's end on the machine's
one monotonic clock, averaged over the ranks as the trainer's ``pp_bubble`` -- and
the measured pass times: ``f``, ``i``, ``w`` per micro-batch and rank (forward, input gradient,
weight gradient; a full ``B`` is split in the ratio of the step's own I and W passes, half and
half where there are none). The model (``parallel/schedule_cost.py``, ``ScheduleCost.bubble``
as the planner calls it, ``planner/timing.py``): the slowest rank's micro-batches plus the
bubble of the ranks' measured micro-batch times, as the ranks' mean idle share of the step,
with two host terms the timeline counts as idle: the executor's host time between two
computes of a rank (``host gap``: posting the sends and receives between them, dispatch --
paid once per compute, so v times per micro-batch with v chunks per rank) and the time from
the compute that made an input on another rank to the start of the compute waiting for it
(``delivery``: the transfer, wake-ups included), both means measured on the step's own
timeline (:func:`host_costs`: gaps and edges, not fitted to the bubble); with either set the
schedule's action tables are replayed as the executor runs them under gloo
(``schedule_cost.replay_tables``: a compute waits for the whole group of sends and receives
holding its input). ``quiet link``: the one-way time of an activation between two idle ranks
(gloo send / receive, best of 20), for reference: the delivery inside a step is longer (the
receiving rank's threads must wake). Also shown: the model with both terms 0 (the closed
forms; what the planner predicts today) and the tables replayed with each stage's own
measured passes (the last stage's head and loss make it the slowest). The step reported is
the one with the lowest bubble among steps 3.. (a step that an unrelated process slowed
only looks worse); the JSON keeps every step's error, the table their median.

Real compute (the default) runs the model below; with more ranks than CPU cores the ranks
time-share the cores and the timeline measures that sharing (an action runs slower while
other ranks compute, faster while they idle), which no schedule model holds -- and other jobs
on the machine do the same (the ``load`` column: the 1-minute load average after the run).
``--sleep F,I,W`` replaces every pass by a fixed duration (:func:`fixed_durations`: the real
passes of a dim-64 model, microseconds, then a sleep of the pass's share of a rank's
micro-batch, over the v chunks): the executor's tables, dispatch, transfers and waits run as
in training, but the cores stay free, so pp 4 on 2 cores is measured without time-sharing.

    python benchmarks/pipeline_bubble.py [--pp 2,4] [--schedules all] [--steps 8]
        [--sleep F,I,W] [--json benchmarks/results/pipeline_bubble.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from meshlm.config import load_config
from meshlm.data import build_data
from meshlm.layout import LOOPED_SCHEDULES, SCHEDULES, V_SCHEDULES, schedule_problems
from meshlm.parallel import pipeline
from meshlm.parallel.schedule_cost import SCHEDULES as COSTS
from meshlm.parallel.schedule_cost import replay_tables
from meshlm.parallel.schedules import rank_stages
from meshlm.testing import run_world
from meshlm.train.trainer import Trainer


def chunks(schedule: str) -> int:
    return 2 if schedule in (*V_SCHEDULES, *LOOPED_SCHEDULES) else 1


def config(args: dict, schedule: str, pp: int, run_dir: str):  # noqa: ANN201
    m = args["microbatches"] or 2 * pp
    if args.get("sleep"):  # fixed-duration passes: a tiny model whose own compute is ~0
        args = {**args, "dim": 64, "ffn": 172, "seq": 32}
    return load_config(None, [
        "--model.preset=small", f"--model.dim={args['dim']}", f"--model.n_layers={args['layers']}",
        f"--model.ffn_hidden={args['ffn']}",
        "--model.tie_embeddings=false", f"--data.seq_len={args['seq']}",
        f"--train.global_batch={m * args['micro_batch']}",
        f"--train.micro_batch={args['micro_batch']}", "--train.steps=1000000",
        "--train.eval_every=0", f"--parallel.pp={pp}", f"--parallel.pp_schedule={schedule}",
        f"--parallel.pp_virtual={chunks(schedule)}", f"--run.dir={run_dir}",
        "--run.sample_tokens=0", "--train.peak_flops=1e12",
    ])


ORIGINS: list[float] = []  # each step's start on this rank's host clock (CLOCK_MONOTONIC)


class _StepClock(pipeline._Clock):
    """The executor's clock with its first mark when the step starts, not at the first
    compute: a rank's wait for its first input (the fill of the pipeline) is then idle time
    of the step, as it is for the schedule models. The start is kept in :data:`ORIGINS`
    (``time.perf_counter``, one clock for every process of the machine) to line the ranks'
    timelines up."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.mark()
        ORIGINS.append(self.marks[0])


def transfer_time(shape: tuple[int, ...], rounds: int = 20) -> float:
    """One-way time of one activation between pipeline ranks 0 and 1 (gloo send / receive,
    half a round trip, best of ``rounds``); 0 on the other ranks."""
    import torch.distributed as dist

    rank = dist.get_rank()
    x = torch.zeros(shape)
    best = float("inf")
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        best = min(best, (time.perf_counter() - t0) / 2)
    return best if rank < 2 else 0.0


def fixed_durations(executor: pipeline.PipelineExecutor, v: int,
                    f: float, i: float, w: float) -> None:
    """Each compute action of ``executor`` (this rank's process only) runs its real passes --
    of a tiny model, microseconds -- then sleeps its pass's fixed share of a rank's
    micro-batch: ``f``, ``i``, ``w`` seconds over the v chunks, ``i + w`` for a full ``B``.
    The executor's dispatch, transfers and waits run as in training; the cores stay free."""
    sleep = {"F": f / v, "B": (i + w) / v, "I": i / v, "W": w / v}

    def timed(op: str, run):  # noqa: ANN001, ANN202
        def action(a) -> None:  # noqa: ANN001
            run(a)
            time.sleep(sleep[op])
        return action

    executor.dispatch = {op: timed(op, run) for op, run in executor.dispatch.items()}


def worker(schedule: str, pp: int, args: dict, run_dir: str) -> dict:
    """Every step's timeline of this rank and the transfer time of an activation."""
    pipeline._Clock = _StepClock  # (this rank's process only)
    cfg = config(args, schedule, pp, run_dir)
    trainer = Trainer(cfg, log=lambda _m: None, progress=False)
    if args.get("sleep"):
        fixed_durations(trainer.runner.executor, chunks(schedule),
                        *(x / 1e3 for x in args["sleep"]))
    out = []
    for step in range(1, args["steps"] + 1):
        trainer.train_step(step)
        out.append({**trainer.runner.timeline(), "origin": ORIGINS[-1]})
    shape = (args["micro_batch"], cfg.data.seq_len, cfg.model.dim)
    return {"steps": out, "latency": transfer_time(shape)}


def passes(actions: list[dict], m: int, share_of: list[dict] | None = None
           ) -> tuple[float, float, float]:
    """(f, i, w) of one micro-batch, from a step's actions (a ``B`` split in the ratio of the
    I and W passes of ``share_of``, default the same actions)."""
    def total(acts: list[dict], op: str) -> float:
        return sum(a["end"] - a["start"] for a in acts if a["op"] == op)

    t = {op: total(actions, op) for op in ("F", "B", "I", "W")}
    ref = share_of if share_of is not None else actions
    i, w = total(ref, "I"), total(ref, "W")
    share = i / (i + w) if i + w > 0 else 0.5
    return t["F"] / m, (t["I"] + share * t["B"]) / m, (t["W"] + (1 - share) * t["B"]) / m


def host_costs(lines: list[dict], n_stages: int) -> tuple[float, float]:
    """(overhead, delivery) in seconds, measured on one step's timelines, not fitted to its
    bubble. ``overhead``: the executor's host time between two computes of a rank (posting
    the sends and receives between them, dispatch, the clock), the mean gap before each
    compute whose input was made on its rank, or on another before the previous compute
    started (so it had arrived). ``delivery``: the mean time from the end of the compute
    that made an input on another rank to the start of the compute that waited for it (its
    rank idle since before the input was made): the transfer to a waiting rank, wake-ups
    included. Means, not medians: the model adds them up along the step."""
    start = min(t["origin"] for t in lines)
    made: dict[tuple[str, int, int], tuple[int, float]] = {}
    for r, t in enumerate(lines):
        for a in t["actions"]:
            key = ("B" if a["op"] in ("B", "I") else a["op"], a["mb"], a["stage"])
            made[key] = (r, t["origin"] - start + a["end"])
    gaps, waits = [], []
    for r, t in enumerate(lines):
        acts = sorted(t["actions"], key=lambda a: a["start"])
        at = t["origin"] - start
        for prev, a in zip(acts, acts[1:], strict=False):
            s = a["stage"]
            dep = (("F", a["mb"], s - 1) if a["op"] == "F" and s > 0 else
                   ("B", a["mb"], s + 1) if a["op"] in ("B", "I") and s < n_stages - 1 else
                   None)
            if dep is None or made[dep][0] == r or made[dep][1] < at + prev["start"]:
                gaps.append(a["start"] - prev["end"])
            elif made[dep][1] > at + prev["end"]:
                waits.append(at + a["start"] - made[dep][1])
    return (statistics.mean(gaps) if gaps else 0.0, statistics.mean(waits) if waits else 0.0)


def planner_bubble(schedule: str, p: int, v: int, m: int,
                   per_rank: list[tuple[float, float, float]], overhead: float = 0.0,
                   latency: float = 0.0) -> float:
    """The planner's bubble (``planner/timing.py``) for the measured pass times of each rank:
    the slowest rank sets the pace, the others' micro-batch times summed are what the schedule
    idles a share of (``ScheduleCost.bubble``); returned as the ranks' mean idle share of the
    step, as the trainer reports it."""
    t = [sum(x) for x in per_rank]
    slow = max(t)
    split = tuple(statistics.mean(x[j] for x in per_rank) for j in range(3))
    step = m * slow + COSTS[schedule].bubble(sum(t) - slow, v, p, m, split, t, overhead,
                                             latency, ordered=False)  # (gloo)
    return 1 - statistics.mean(m * x for x in t) / step


def stage_bubble(schedule: str, p: int, v: int, m: int, lines: list[dict], latency: float,
                 overhead: float) -> float:
    """The tables replayed with each stage's own measured passes, the measured transfer
    time between ranks and host time between computes (``schedule_cost.replay_tables``,
    gloo's unordered groups), as the ranks' mean idle share of the step."""
    stages: dict[int, tuple[float, float, float]] = {}
    for r, t in enumerate(lines):
        acts = t["actions"]
        for s in rank_stages(schedule, r, p, v):
            mine = [a for a in acts if a["stage"] == s]
            stages[s] = passes(mine, m, share_of=acts)
    step, busy = replay_tables(schedule, p, v, m, [stages[s] for s in range(p * v)],
                               latency, overhead)
    return statistics.mean(1 - b / step for b in busy)


def measure(schedule: str, pp: int, args: dict, tmp: Path) -> dict:
    m = args["microbatches"] or 2 * pp
    v = chunks(schedule)
    res = run_world(pp, worker, schedule, pp, args, str(tmp / f"{schedule}-{pp}"))
    load = os.getloadavg()[0]  # (the machine's 1-minute load right after: other jobs' share)
    ranks = [r["steps"] for r in res]
    link = max(r["latency"] for r in res)  # (the quiet link's one-way time, for reference)
    steps = []
    for k in range(2, args["steps"]):  # (steps 1-2 warm up allocators and thread pools)
        lines = [r[k] for r in ranks]
        start = min(t["origin"] for t in lines)  # the first rank's start of the step
        end = max(t["origin"] + t["step_time"] for t in lines) - start  # the last's end
        bubble = statistics.mean(1 - sum(a["end"] - a["start"] for a in t["actions"]) / end
                                 for t in lines)
        per_rank = [passes(t["actions"], m) for t in lines]
        split = tuple(statistics.mean(x[j] for x in per_rank) for j in range(3))
        overhead, latency = host_costs(lines, pp * v)
        predicted = planner_bubble(schedule, pp, v, m, per_rank, overhead, latency)
        steps.append({"step": k + 1, "measured": bubble, "split": split, "per_rank": per_rank,
                      "overhead": overhead, "latency": latency, "predicted": predicted,
                      "error": (predicted - bubble) / bubble,
                      "replayed": stage_bubble(schedule, pp, v, m, lines, latency, overhead),
                      "step_time_s": end})
    best = min(steps, key=lambda s: s["measured"])
    predicted = best["predicted"]
    free = planner_bubble(schedule, pp, v, m, best["per_rank"])
    f, i, w = best["split"]
    return {"schedule": schedule, "pp": pp, "v": v, "m": m,
            "ranks_per_core": pp / (os.cpu_count() or 1), "load": load, "step": best["step"],
            "step_time_s": best["step_time_s"], "f_ms": f * 1e3, "i_ms": i * 1e3,
            "w_ms": w * 1e3, "measured": best["measured"], "predicted": predicted,
            "replayed": best["replayed"], "latency_ms": best["latency"] * 1e3,
            "overhead_ms": best["overhead"] * 1e3, "link_ms": link * 1e3,
            "predicted_free": free,
            "median_abs_error": statistics.median(abs(s["error"]) for s in steps),
            "free_error": (free - best["measured"]) / best["measured"],
            "compute": "fixed" if args.get("sleep") else "real",
            "replayed_error": (best["replayed"] - best["measured"]) / best["measured"],
            "rel_error": (predicted - best["measured"]) / best["measured"],
            "measured_all": [s["measured"] for s in steps],
            "error_all": [s["error"] for s in steps]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default="2,4", help="comma-separated pipeline sizes")
    ap.add_argument("--schedules", default="all", help="comma-separated, or all")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1376)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", dest="micro_batch", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=0, help="per step (0: 2 pp)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", default="benchmarks/results/pipeline_bubble.json")
    ap.add_argument("--sleep", default="", metavar="F,I,W",
                    help="fixed-duration passes: ms of a rank's forward, input-gradient and "
                         "weight-gradient passes per micro-batch, slept (a dim-64 model; the "
                         "cores stay free); default: real compute")
    a = ap.parse_args()
    args = vars(a)
    if a.sleep:
        try:
            args["sleep"] = [float(x) for x in a.sleep.split(",")]
            assert len(args["sleep"]) == 3 and min(args["sleep"]) >= 0
        except (ValueError, AssertionError):
            ap.error(f"--sleep: expected three durations in ms, F,I,W (got {a.sleep!r})")
    names = list(SCHEDULES) if a.schedules == "all" else a.schedules.split(",")
    if unknown := set(names) - set(SCHEDULES):
        ap.error(f"--schedules: unknown {', '.join(sorted(unknown))} (valid: "
                 f"{', '.join(SCHEDULES)})")
    pps = [int(x) for x in a.pp.split(",")]
    build_data(config(args, "1f1b", 2, "unused").data)
    tmp = Path(tempfile.mkdtemp(prefix="meshlm-bubble-"))
    rows = []
    for pp in pps:
        for name in names:
            m = a.microbatches or 2 * pp
            if why := schedule_problems(name, pp, m, chunks(name)):
                print(f"skip {name} at pp {pp}: {why[0]}")
                continue
            rows.append(measure(name, pp, args, tmp))
            r = rows[-1]
            print(f"{name:15s} pp {pp}: measured {r['measured']:.4f} predicted "
                  f"{r['predicted']:.4f} ({r['rel_error']:+.1%}; host gap "
                  f"{r['overhead_ms']:.2f} ms, delivery {r['latency_ms']:.2f} ms)", flush=True)
    shape = config(args, "1f1b", 2, "unused")
    what = (f"passes slept: f / i / w = {a.sleep} ms per rank and micro-batch" if a.sleep else
            "real compute")
    print(f"\n{what}; model: {a.layers} layers, dim {shape.model.dim}, vocab 4096 (untied), "
          f"seq {shape.data.seq_len} x micro-batch {a.micro_batch}, fp32, gloo, 1 thread per "
          f"rank, {os.cpu_count()} CPU cores; steps 3..{a.steps}, the lowest-bubble step")
    head = ("| schedule | pp | v | m | ranks/cores | load | f / i / w per micro-batch (ms) "
            "| step (s) "
            "| host gap (ms) | delivery (ms) | quiet link (ms) | measured bubble | model "
            "| vs measured | all steps: median abs error | model, host and transfers free "
            "| vs measured | stages replayed | vs measured |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(f"| {r['schedule']} | {r['pp']} | {r['v']} | {r['m']} | {r['ranks_per_core']:.0f} "
              f"| {r['load']:.1f} | {r['f_ms']:.1f} / {r['i_ms']:.1f} / {r['w_ms']:.1f} | {r['step_time_s']:.3f} "
              f"| {r['overhead_ms']:.2f} | {r['latency_ms']:.2f} | {r['link_ms']:.2f} "
              f"| {r['measured']:.4f} | {r['predicted']:.4f} | {r['rel_error']:+.1%} "
              f"| {r['median_abs_error']:.1%} "
              f"| {r['predicted_free']:.4f} | {r['free_error']:+.1%} "
              f"| {r['replayed']:.4f} | {r['replayed_error']:+.1%} |")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": args, "cpu_cores": os.cpu_count(), "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
