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
with the host terms the timeline counts as idle, measured on the step's own host events
(:func:`trace_host`, :func:`host_terms`; not fitted to the bubble): ``post``, the host time
to post one send or receive (the comm layer's bookkeeping and gloo's ``isend`` / ``irecv``,
timed call by call), paid where the table posts each op, so a rank pays for what its table
posts between two computes; ``dispatch``, the rest of the host time between two computes;
``delivery``, the time from a message's later side posted to the end of a wait for it that
blocked (the transfer and the wake-ups of the threads involved), averaged over every message
of the step -- one done before its wait counts at most the time it was done by
(:func:`censored_mean`); ``starts``, when each rank
entered the step. With them the schedule's action tables are replayed as the executor runs
them under gloo (``schedule_cost.replay_tables``: a compute waits for the whole group of
sends and receives holding its input, each op posted after the ones before it in its group).
Each term is a mean: the model puts it on every op, message and compute. Also shown: the
earlier model (:func:`host_costs`: one host gap per compute and a delivery from the producing
compute's end to the consuming compute's start), the model with every term 0 (the closed
forms; what the planner predicts today), the tables replayed with each stage's own measured
passes (the last stage's head and loss make it the slowest), the tables replayed with every
action's own measured cost (a check of the replay: each compute's time, each op's posting,
each message's delivery) and the mean of replays with every cost drawn at random from the
step's measured ones (:func:`replayed`: what the spread of the costs adds to the means). The
step reported is the one with the lowest bubble among steps 3.. (a step that an unrelated
process slowed only looks worse); the JSON keeps every step's errors and terms, the table the
median absolute error over the steps.

Real compute (the default) runs the model below; with more ranks than CPU cores the ranks
time-share the cores and the timeline measures that sharing (an action runs slower while
other ranks compute, faster while they idle), which no schedule model holds -- and other jobs
on the machine do the same (the ``load`` column: the 1-minute load average after the run).
``--sleep F,I,W`` replaces every pass by a fixed duration (:func:`fixed_durations`: the real
passes of a dim-64 model, microseconds, then a sleep of the pass's share of a rank's
micro-batch, over the v chunks): the executor's tables, dispatch, transfers and waits run as
in training, but the cores stay free, so pp 4 on 2 cores is measured without time-sharing.

    python benchmarks/pipeline_bubble.py [--pp 2,4] [--schedules all] [--steps 8]
        [--sleep F,I,W] [--draws 20] [--json benchmarks/results/pipeline_bubble.json]
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


class _TimedWork:
    """One send's or receive's work of a posted group, its wait timed: ``waits[i]`` becomes
    (start, end) of the wait (``time.perf_counter``). Everything else goes to the work."""

    def __init__(self, work, waits: list, i: int) -> None:  # noqa: ANN001
        self.work, self.waits, self.i = work, waits, i

    def wait(self, *args) -> bool:  # noqa: ANN002
        t0 = time.perf_counter()
        out = self.work.wait(*args)
        self.waits[self.i] = (t0, time.perf_counter())
        return out

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.work, name)


def trace_host(executor: pipeline.PipelineExecutor, events: list[dict]) -> None:
    """Record, on the host clock (``time.perf_counter``), each group of sends and receives
    ``executor`` posts -- when its posting began and ended, its ops, and when the wait for
    each op's work began and ended (gloo: one work per op, waited in the posted order, by a
    compute needing the group or at the end of the step) -- and each wait for a compute's
    input (when it began and ended, and for which compute): the pieces of a rank's host
    time between two computes. Wraps this rank's executor only (its ``_p2p`` and
    ``_wait_input``, and the works of each group's handle); the executor runs as before."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    post, wait = executor._p2p, executor._wait_input
    calls: list[tuple[float, float]] = []  # each isend / irecv call of the group posted now

    def timed(fn):  # noqa: ANN001, ANN202
        def op(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            calls.append((t0, time.perf_counter()))
            return out
        return op

    # (both names: batch_isend_irecv tells a send by ``op is isend``)
    isend, irecv = timed(c10d.isend), timed(c10d.irecv)
    dist.isend = c10d.isend = isend
    dist.irecv = c10d.irecv = irecv

    def p2p(acts) -> None:  # noqa: ANN001
        calls.clear()
        t0 = time.perf_counter()
        post(acts)
        t1 = time.perf_counter()
        handle = executor.sends[-1]  # (the group's handle: _p2p appends it)
        waits: list = [None] * len(handle.works)
        handle.works = [_TimedWork(w, waits, i) for i, w in enumerate(handle.works)]
        events.append({"kind": "post", "t0": t0, "t1": t1,
                       "ops": [(a.op, a.mb, a.stage, a.peer) for a in acts], "waits": waits,
                       "calls": list(calls)})

    def wait_input(a) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        wait(a)
        events.append({"kind": "wait", "t0": t0, "t1": time.perf_counter(), "op": a.op,
                       "mb": a.mb, "stage": a.stage})

    executor._p2p, executor._wait_input = p2p, wait_input


def worker(schedule: str, pp: int, args: dict, run_dir: str) -> dict:
    """Every step's timeline of this rank, its host events (:func:`trace_host`) and the
    transfer time of an activation."""
    pipeline._Clock = _StepClock  # (this rank's process only)
    cfg = config(args, schedule, pp, run_dir)
    trainer = Trainer(cfg, log=lambda _m: None, progress=False)
    if args.get("sleep"):
        fixed_durations(trainer.runner.executor, chunks(schedule),
                        *(x / 1e3 for x in args["sleep"]))
    events: list[dict] = []
    trace_host(trainer.runner.executor, events)
    out = []
    for step in range(1, args["steps"] + 1):
        events.clear()
        trainer.train_step(step)
        origin = ORIGINS[-1]
        host = [{**e, "t0": e["t0"] - origin, "t1": e["t1"] - origin,
                 **({"waits": [None if w is None else (w[0] - origin, w[1] - origin)
                               for w in e["waits"]],
                     "calls": [(c[0] - origin, c[1] - origin) for c in e["calls"]]}
                    if "waits" in e else {})}
                for e in events]
        out.append({**trainer.runner.timeline(), "origin": origin, "host": host})
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
    """The earlier model's two terms (kept for comparison; the model now takes
    :func:`host_terms`): (overhead, delivery) in seconds, measured on one step's timelines,
    not fitted to its bubble. ``overhead``: the executor's host time between two computes of a rank (posting
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


BLOCKED = 1e-4  # s: a wait longer than this blocked (one on a completed handle: < 0.1 ms here)


def _sender(op: str, stage: int) -> int:
    """The sending stage of a send or receive action's message."""
    kind = op[-1]
    return stage if op.startswith("SEND") else stage - 1 if kind == "F" else stage + 1


def host_terms(lines: list[dict]) -> dict:
    """The host terms of the model, measured on one step's timelines and host events
    (:func:`trace_host`), not fitted to its bubble; seconds, means (the model adds them up
    along the step):

    - ``post``: the host time to post one send or receive -- every group's posting time
      (the comm layer's bookkeeping and gloo's ``isend`` / ``irecv`` calls) over the ops
      it posted, all ranks;
    - ``dispatch``: the rest of a rank's host time between two computes -- each gap between
      consecutive computes less the postings and waits inside it;
    - ``latency``: a message's delivery -- from the return of the later of its two sides'
      ``isend`` / ``irecv`` calls to the end of a wait for it that blocked (the transfer,
      the wake-ups of the threads involved: on this machine mostly the latter) -- as the
      mean over every message (:func:`censored_mean`: a message done before its waits is
      seen only as a bound); ``latency_blocked``, the mean over the blocked waits alone;
    - ``starts``: when each rank entered the step, after the first (the previous step's
      end and the optimizer step differ between ranks by a few ms).

    A delivery is taken at each wait for one send's or receive's work that blocked (longer
    than :data:`BLOCKED`: the message was done when the wait ended), ``n_latency`` of them;
    for information, their means by which side was posted first (``latency_recv_first``,
    ``latency_send_first``: gloo's rendezvous, the sender hands the data over once the
    receiver's notice reached it) and their median. Also kept, for the replays of
    :func:`replayed`: every posting (``postings``: per op, its call plus its share of the
    group's bookkeeping, by (rank, op, micro-batch, stage)), every compute's time
    (``computes``), every delivery taken (``deliveries``; ``delivered``: by the receive's
    (kind, micro-batch, stage)) and, for a message whose waits did not block, when it was
    done at the latest (``done_by``)."""
    first = min(t["origin"] for t in lines)
    side: dict[tuple[str, int, int, str], float] = {}  # message side -> its posting
    postings: dict[tuple[int, str, int, int], float] = {}
    computes: dict[tuple[int, str, int, int], float] = {}
    ops = posted = 0.0
    gaps: list[float] = []
    for r, t in enumerate(lines):
        at = t["origin"] - first
        for e in t["host"]:
            if e["kind"] != "post":
                continue
            ops, posted = ops + len(e["ops"]), posted + e["t1"] - e["t0"]
            share = (e["t1"] - e["t0"] - sum(c[1] - c[0] for c in e["calls"])) / len(e["ops"])
            for (op, mb, s, _), call in zip(e["ops"], e["calls"], strict=True):
                side[(op[-1], mb, _sender(op, s), op[:4])] = at + call[1]
                postings[(r, op, mb, s)] = call[1] - call[0] + share
        acts = sorted(t["actions"], key=lambda a: a["start"])
        for a in acts:
            computes[(r, a["op"], a["mb"], a["stage"])] = a["end"] - a["start"]
        for prev, a in zip(acts, acts[1:], strict=False):
            inside = sum(e["t1"] - e["t0"] for e in t["host"]
                         if e["t0"] >= prev["end"] and e["t1"] <= a["start"])
            gaps.append(a["start"] - prev["end"] - inside)
    early: list[float] = []
    late: list[float] = []
    delivered: dict[tuple[str, int, int], float] = {}
    done_by: dict[tuple[str, int, int], float] = {}
    for t in lines:
        at = t["origin"] - first
        for e in t["host"]:
            if e["kind"] != "post":
                continue
            for (op, mb, s, _), w in zip(e["ops"], e["waits"], strict=True):
                if w is None:
                    continue
                sender = _sender(op, s)
                send, recv = side[(op[-1], mb, sender, "SEND")], side[(op[-1], mb, sender, "RECV")]
                receiver = sender + 1 if op[-1] == "F" else sender - 1
                key = (op[-1], mb, receiver)
                if w[1] - w[0] <= BLOCKED:  # (done before its wait: by then, at the latest)
                    done_by[key] = min(done_by.get(key, float("inf")), at + w[0] - max(send, recv))
                    continue
                (early if recv <= send else late).append(at + w[1] - max(send, recv))
                delivered[key] = max(delivered.get(key, float("-inf")), at + w[1] - max(send, recv))
    deliveries = early + late
    latency = censored_mean(delivered, done_by)
    return {"post": posted / ops if ops else 0.0,
            "dispatch": statistics.mean(gaps) if gaps else 0.0,
            "latency": latency, "starts": [t["origin"] - first for t in lines],
            "n_latency": len(deliveries),
            "latency_blocked": statistics.mean(deliveries) if deliveries else 0.0,
            "latency_median": statistics.median(deliveries) if deliveries else 0.0,
            "latency_recv_first": statistics.mean(early) if early else None,
            "latency_send_first": statistics.mean(late) if late else None,
            "n_recv_first": len(early), "n_send_first": len(late),
            "postings": postings, "computes": computes, "deliveries": deliveries,
            "delivered": delivered, "done_by": done_by}


def censored_mean(delivered: dict, done_by: dict, rounds: int = 100) -> float:
    """The mean delivery over every message of the step (:func:`host_terms`): a message whose
    wait blocked took its measured delivery (``delivered``); one that was done before any
    wait for it took at most ``done_by`` -- what it took is not seen, only that bound. The
    mean ``L`` solves ``L = mean(delivered, min(L, done_by))`` (the unseen deliveries are
    taken as the mean, capped by their bound; iterated from the blocked ones' mean, which it
    never exceeds). The blocked waits alone over-state it: a wait blocks because its message
    was slow."""
    seen = [max(0.0, d) for d in delivered.values()]  # (a wait can end inside the later
    # side's isend / irecv call, the data moved during it: nothing left to deliver)
    bounds = [max(0.0, b) for key, b in done_by.items() if key not in delivered]
    if not seen:
        return 0.0
    mean = statistics.mean(seen)
    for _ in range(rounds):
        mean = (sum(seen) + sum(min(mean, b) for b in bounds)) / (len(seen) + len(bounds))
    return mean


def planner_bubble(schedule: str, p: int, v: int, m: int,
                   per_rank: list[tuple[float, float, float]], **host: object) -> float:
    """The planner's bubble (``planner/timing.py``) for the measured pass times of each rank:
    the slowest rank sets the pace, the others' micro-batch times summed are what the schedule
    idles a share of (``ScheduleCost.bubble``, with the host terms ``host``: its
    ``overhead``, ``latency``, ``post``, ``starts``); returned as the ranks'
    mean idle share of the step, as the trainer reports it."""
    t = [sum(x) for x in per_rank]
    slow = max(t)
    split = tuple(statistics.mean(x[j] for x in per_rank) for j in range(3))
    step = m * slow + COSTS[schedule].bubble(sum(t) - slow, v, p, m, split, t,
                                             ordered=False, **host)  # (gloo)
    return 1 - statistics.mean(m * x for x in t) / step


def model_terms(h: dict) -> dict:
    """``ScheduleCost.bubble``'s host terms from :func:`host_terms`'s."""
    return {"overhead": h["dispatch"], "latency": h["latency"], "post": h["post"],
            "starts": h["starts"]}


def stage_bubble(schedule: str, p: int, v: int, m: int, lines: list[dict], h: dict) -> float:
    """The tables replayed with each stage's own measured passes and the host terms
    ``h`` (:func:`host_terms`; ``schedule_cost.replay_tables``, gloo's unordered groups), as
    the ranks' mean idle share of the step."""
    stages: dict[int, tuple[float, float, float]] = {}
    for r, t in enumerate(lines):
        acts = t["actions"]
        for s in rank_stages(schedule, r, p, v):
            mine = [a for a in acts if a["stage"] == s]
            stages[s] = passes(mine, m, share_of=acts)
    step, busy = replay_tables(schedule, p, v, m, [stages[s] for s in range(p * v)],
                               h["latency"], h["dispatch"], post=h["post"],
                               starts=h["starts"])
    return statistics.mean(1 - b / step for b in busy)


def replayed(schedule: str, p: int, v: int, m: int, h: dict, draws: int = 0,
             seed: int = 0) -> float:
    """The tables replayed action by action (``replay_tables``' ``each`` and ``delivery``),
    as the ranks' mean idle share of the step. ``draws`` = 0: the step's own measured costs
    -- each compute's time, each send's and receive's posting, each message's delivery where
    a wait for it blocked (else the mean, at most the time it was done by) -- a check of the
    replay itself; ``draws`` > 0: the mean over that many replays with every cost drawn at
    random from the step's measured ones (a compute's from its rank's passes of the same
    kind and stage, a posting from all postings, a delivery from all deliveries), against
    the model's means: what the step's spread of costs adds."""
    import random

    rng = random.Random(seed)
    stages = [(0.0, 0.0, 0.0)] * (p * v)  # (every compute's time comes from ``each``)
    pool: dict[tuple[int, str, int], list[float]] = {}
    for (r, op, _, s), d in h["computes"].items():
        pool.setdefault((r, op, s), []).append(d)
    postings = list(h["postings"].values())
    deliveries = h["deliveries"] or [0.0]

    def own(r: int, a) -> float:  # noqa: ANN001
        table = h["postings"] if a.op[:4] in ("SEND", "RECV") else h["computes"]
        return table[(r, a.op, a.mb, a.stage)]

    def own_delivery(a) -> float:  # noqa: ANN001
        key = (a.op[-1], a.mb, a.stage)
        if key in h["delivered"]:
            return h["delivered"][key]
        return max(0.0, min(h["latency"], h["done_by"].get(key, h["latency"])))

    def drawn(r: int, a) -> float:  # noqa: ANN001
        if a.op[:4] in ("SEND", "RECV"):
            return rng.choice(postings)
        return rng.choice(pool[(r, a.op, a.stage)])

    def drawn_delivery(a) -> float:  # noqa: ANN001
        return rng.choice(deliveries)

    out = []
    for _ in range(max(1, draws)):
        each, delivery = (drawn, drawn_delivery) if draws else (own, own_delivery)
        step, busy = replay_tables(schedule, p, v, m, stages, overhead=h["dispatch"],
                                   starts=h["starts"], each=each, delivery=delivery)
        out.append(statistics.mean(1 - b / step for b in busy))
    return statistics.mean(out)


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
        h = host_terms(lines)
        host = model_terms(h)
        predicted = planner_bubble(schedule, pp, v, m, per_rank, **host)
        medians = planner_bubble(schedule, pp, v, m, per_rank,
                                 **{**host, "latency": h["latency_median"]})
        overhead, latency = host_costs(lines, pp * v)  # (the earlier model's two terms)
        earlier = planner_bubble(schedule, pp, v, m, per_rank, overhead=overhead,
                                 latency=latency)
        row = {"step": k + 1, "measured": bubble, "split": split, "per_rank": per_rank,
               "predicted": predicted, "step_time_s": end,
               "replayed": stage_bubble(schedule, pp, v, m, lines, h),
               "own": replayed(schedule, pp, v, m, h),
               "drawn": replayed(schedule, pp, v, m, h, draws=args["draws"], seed=k),
               "medians": medians, "earlier": earlier, "earlier_overhead": overhead,
               "earlier_latency": latency,
               **{x: h[x] for x in ("post", "dispatch", "latency", "starts", "n_latency",
                                    "latency_median", "latency_blocked", "latency_recv_first",
                                    "latency_send_first", "n_recv_first", "n_send_first")}}
        for x in ("predicted", "replayed", "own", "drawn", "medians", "earlier"):
            row[f"{x}_error"] = (row[x] - bubble) / bubble
        steps.append(row)
    best = min(steps, key=lambda s: s["measured"])
    free = planner_bubble(schedule, pp, v, m, best["per_rank"])
    f, i, w = best["split"]
    out = {"schedule": schedule, "pp": pp, "v": v, "m": m,
           "ranks_per_core": pp / (os.cpu_count() or 1), "load": load,
           "compute": "fixed" if args.get("sleep") else "real",
           "f_ms": f * 1e3, "i_ms": i * 1e3, "w_ms": w * 1e3, "link_ms": link * 1e3,
           "predicted_free": free, "free_error": (free - best["measured"]) / best["measured"],
           **{x: best[x] for x in ("step", "step_time_s", "measured", "predicted", "replayed",
                                   "own", "drawn", "medians", "earlier", "n_latency")},
           **{f"{x}_error": best[f"{x}_error"] for x in ("predicted", "replayed", "own",
                                                        "drawn", "medians", "earlier")},
           **{f"{x}_ms": best[x] * 1e3 for x in ("post", "dispatch", "latency",
                                                 "latency_median", "latency_blocked",
                                                 "earlier_overhead",
                                                 "earlier_latency")},
           "start_spread_ms": max(best["starts"]) * 1e3,
           "steps": [{x: y for x, y in s.items() if x not in ("split", "per_rank")}
                     for s in steps]}
    for x in ("predicted", "earlier", "drawn", "own"):
        out[f"{x}_median_abs_error"] = statistics.median(abs(s[f"{x}_error"]) for s in steps)
    out["rel_error"] = out["predicted_error"]  # (the earlier files' name)
    return out


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
    ap.add_argument("--draws", type=int, default=20,
                    help="replays with costs drawn from each step's measured ones")
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
                  f"{r['predicted']:.4f} ({r['predicted_error']:+.1%}; earlier model "
                  f"{r['earlier_error']:+.1%}; post {r['post_ms']:.2f} ms/op, delivery "
                  f"{r['latency_ms']:.2f} ms)", flush=True)
    shape = config(args, "1f1b", 2, "unused")
    what = (f"passes slept: f / i / w = {a.sleep} ms per rank and micro-batch" if a.sleep else
            "real compute")
    print(f"\n{what}; model: {a.layers} layers, dim {shape.model.dim}, vocab 4096 (untied), "
          f"seq {shape.data.seq_len} x micro-batch {a.micro_batch}, fp32, gloo, 1 thread per "
          f"rank, {os.cpu_count()} CPU cores; steps 3..{a.steps}, the lowest-bubble step")
    head = ("| schedule | pp | v | m | load | f / i / w (ms) | post (ms/op) | dispatch (ms) "
            "| delivery (ms) | starts (ms) | measured bubble | model "
            "| error | all steps: median abs error | earlier model: error | median abs "
            "| host and transfers free: error | stages replayed: error "
            "| own costs replayed: error | costs drawn: error |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(f"| {r['schedule']} | {r['pp']} | {r['v']} | {r['m']} | {r['load']:.1f} "
              f"| {r['f_ms']:.0f} / {r['i_ms']:.0f} / {r['w_ms']:.0f} | {r['post_ms']:.2f} "
              f"| {r['dispatch_ms']:.2f} | {r['latency_ms']:.2f} "
              f"| {r['start_spread_ms']:.1f} | {r['measured']:.3f} | {r['predicted']:.3f} "
              f"| {r['predicted_error']:+.1%} | {r['predicted_median_abs_error']:.1%} "
              f"| {r['earlier_error']:+.1%} | {r['earlier_median_abs_error']:.1%} "
              f"| {r['free_error']:+.1%} | {r['replayed_error']:+.1%} | {r['own_error']:+.1%} "
              f"| {r['drawn_error']:+.1%} |")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": args, "cpu_cores": os.cpu_count(), "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
