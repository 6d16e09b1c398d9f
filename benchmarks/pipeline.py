"""meshlm's pipeline schedules vs torch.distributed.pipelining, same model, stages and batch.

Pairs: AFAB vs ``ScheduleGPipe``, 1F1B vs ``Schedule1F1B``, interleaved 1F1B (2 chunks per
rank) vs ``ScheduleInterleaved1F1B``, ZB-V vs ``ScheduleZBVZeroBubble`` and DualPipeV vs
``ScheduleDualPipeV`` (2 chunks per rank in a V: rank r holds stages r and 2p - 1 - r, on
both sides), looped BFS vs ``ScheduleLoopedBFS`` and interleaved zero bubble vs
``ScheduleInterleavedZeroBubble`` (2 chunks round robin); torch has no ZB-H1, so meshlm's is
reported against ``Schedule1F1B``. Both sides split the same layers into the same stages
(``partition_layers``), place them the same way, train the same weights on the same
micro-batches with AdamW + clipping by the gradient norm over all stages, and read the loss
back every step. Protocol of ``_harness.py``: own world per implementation, best of
``rounds`` runs, slowest rank, peak RSS growth over the rank's resident memory before
building its model; the time ratio of a pair is
the median over the rounds of its ratio within a round (the two run one after the other, so a
load that comes and goes on a shared machine moves both alike). meshlm's side runs under the
process policies ``meshlm train`` sets, its malloc cache (``run.malloc_cache_mb``) included;
torch's under glibc's own policy, and with ``--torch-cache`` also under meshlm's (the ratio
with the same allocator policy on both sides).

    python benchmarks/pipeline.py [--world 2] [--layers 4] [--microbatches 8] [--steps 8]
        [--only meshlm-zbv,torch-zbv] [--json benchmarks/results/pipeline.json]
        [--profile DIR] [--torch-cache] [--meshlm-glibc] [--keep-freed]

The 2-chunk schedules need 2 x world stages: ``--layers`` a multiple of 2 x world.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _harness import (
    best_of,
    meshlm_step_times,
    minor_faults,
    print_rows,
    rss_bytes,
    split_compiled,
    summary,
)
from torch import nn

from meshlm.config import load_config
from meshlm.data import build_data
from meshlm.data.sampler import StepSampler
from meshlm.layout import LOOPED_SCHEDULES, V_SCHEDULES, partition_layers
from meshlm.models import build_model
from meshlm.parallel.schedules import rank_stages

TORCH = {"torch-gpipe": "ScheduleGPipe", "torch-1f1b": "Schedule1F1B",
         "torch-interleaved": "ScheduleInterleaved1F1B", "torch-zbv": "ScheduleZBVZeroBubble",
         "torch-dualpipev": "ScheduleDualPipeV", "torch-looped-bfs": "ScheduleLoopedBFS",
         "torch-interleaved-zb": "ScheduleInterleavedZeroBubble"}
MESHLM = {"meshlm-afab": "afab", "meshlm-1f1b": "1f1b", "meshlm-interleaved": "interleaved",
          "meshlm-zb": "zb", "meshlm-zbv": "zbv", "meshlm-dualpipev": "dualpipev",
          "meshlm-bfs": "bfs", "meshlm-interleaved-zb": "interleaved-zb"}
# the schedule each torch implementation runs, for the config both sides share
TORCH_AS = {"torch-gpipe": "afab", "torch-1f1b": "1f1b", "torch-interleaved": "interleaved",
            "torch-zbv": "zbv", "torch-dualpipev": "dualpipev", "torch-looped-bfs": "bfs",
            "torch-interleaved-zb": "interleaved-zb"}
PAIRS = {"meshlm-afab": "torch-gpipe", "meshlm-1f1b": "torch-1f1b",
         "meshlm-interleaved": "torch-interleaved", "meshlm-zb": "torch-1f1b",
         "meshlm-zbv": "torch-zbv", "meshlm-dualpipev": "torch-dualpipev",
         "meshlm-bfs": "torch-looped-bfs", "meshlm-interleaved-zb": "torch-interleaved-zb",
         "meshlm-1f1b-compiled": "torch-1f1b", "meshlm-zb-compiled": "torch-1f1b"}
IMPLS = ["meshlm-afab", "torch-gpipe", "meshlm-1f1b", "torch-1f1b", "meshlm-interleaved",
         "torch-interleaved", "meshlm-zb", "meshlm-zbv", "torch-zbv", "meshlm-dualpipev",
         "torch-dualpipev", "meshlm-bfs", "torch-looped-bfs", "meshlm-interleaved-zb",
         "torch-interleaved-zb", "meshlm-1f1b-compiled", "meshlm-zb-compiled"]


def config(args: dict, impl: str, run_dir: str):  # noqa: ANN201
    glibc = impl.endswith(GLIBC)  # meshlm's side under glibc's malloc policy as it comes
    impl, extra = split_compiled(impl.removesuffix(GLIBC))
    if glibc:
        extra = [*extra, "--run.malloc_cache_mb=0"]
    schedule = MESHLM.get(impl) or TORCH_AS[impl]
    v = 2 if schedule in (*V_SCHEDULES, *LOOPED_SCHEDULES) else 1
    return load_config(None, [
        f"--model.preset={args['preset']}", f"--model.n_layers={args['layers']}",
        "--model.tie_embeddings=false", f"--data.seq_len={args['seq']}",
        f"--train.global_batch={args['batch']}",
        f"--train.micro_batch={args['batch'] // args['microbatches']}",
        "--train.steps=1000000", "--train.eval_every=0", f"--parallel.pp={args['world']}",
        f"--parallel.pp_schedule={schedule}", f"--parallel.pp_virtual={v}",
        f"--run.dir={run_dir}", "--run.sample_tokens=0", "--train.peak_flops=1e12", *extra,
    ])


class TorchStage(nn.Module):
    """One pipeline stage of the plain model for torch.distributed.pipelining."""

    def __init__(self, model: nn.Module, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.emb = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[str(i)] for i in layers)
        self.norm, self.head = (model.norm, model.output) if last else (None, None)
        self.register_buffer("cos", model.rope_cos, persistent=False)
        self.register_buffer("sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        s = h.shape[1]
        for layer in self.layers:
            h = layer(h, self.cos[:s], self.sin[:s])
        return self.head(self.norm(h)) if self.head is not None else h


def torch_side(impl: str, cfg, steps: int, faults: list[int]) -> list[float]:  # noqa: ANN001
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    v = cfg.parallel.pp_virtual
    data = build_data(cfg.data, log=lambda _m: None)
    model = build_model(cfg.model_config(vocab_size=data.tokenizer.vocab_size), cfg.train.seed)
    n_stages = world * v
    parts = partition_layers(cfg.model_config().n_layers, n_stages)
    # meshlm's placement, which torch's schedules expect too (a V: stages r and 2p - 1 - r)
    stage_ids = rank_stages(cfg.parallel.pp_schedule, rank, world, v)
    stages = [pipelining.PipelineStage(
        TorchStage(model, parts[s], s == 0, s == n_stages - 1), s, n_stages,
        torch.device("cpu")) for s in stage_ids]
    params = [p for st in stages for p in st.submod.parameters()]
    t = cfg.train
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2],
                              "weight_decay": t.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)
    m = cfg.grad_accum

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    cls = getattr(pipelining, TORCH[impl])
    schedule = cls(stages if v > 1 else stages[0], m, loss_fn=loss_fn)
    sampler = StepSampler(data.train_tokens, cfg.data.seq_len, t.global_batch, t.seed)
    times = []
    for step in range(1, steps + 1):
        t0, f0 = time.perf_counter(), minor_faults()
        batch = sampler.global_batch_at(step)
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        losses: list = []
        has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids
        if has_first and has_last:
            schedule.step(x, target=y, losses=losses)
        elif has_first:
            schedule.step(x)
        elif has_last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        total = torch.tensor([float(sum(float(v.detach()) for v in losses))])
        dist.all_reduce(total)  # every rank learns the loss, as meshlm reports it
        # clipped by the norm over every stage, as meshlm (and torchtitan's pp) do: each
        # rank's squared norm summed over the pipeline
        grads = [p.grad for p in params if p.grad is not None]
        sq = torch.nn.utils.get_total_norm(grads) ** 2
        dist.all_reduce(sq)
        torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip, sq.sqrt())
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        faults.append(minor_faults() - f0)
    return times


KEEP = "+keep"  # suffix: the side keeps freed memory in its processes (run.malloc_keep's policy)
# suffix of a torch side run under meshlm's default malloc policy (run.malloc_cache_mb), which
# meshlm's side runs under as ``meshlm train`` does
CACHE = "+cache"
GLIBC = "+glibc"  # suffix of a meshlm side run under glibc's own policy (run.malloc_cache_mb=0)


def worker(impl: str, args: dict, run_dir: str) -> dict:
    base = rss_bytes()
    from meshlm.train.process import cache_freed_memory, keep_freed_memory

    if impl.endswith(KEEP):  # (before anything is allocated, on both sides alike)
        keep_freed_memory()
        impl = impl.removesuffix(KEEP)
    elif impl.endswith(CACHE):
        cache_freed_memory()
        impl = impl.removesuffix(CACHE)
    cfg = config(args, impl, run_dir)
    profile = None
    if args.get("profile"):  # (--profile DIR: each rank's cProfile of its steps)
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    faults: list[int] = []
    times = (meshlm_step_times(cfg, args["steps"], faults) if impl.startswith("meshlm")
             else torch_side(impl, cfg, args["steps"], faults))
    if profile is not None:
        import torch.distributed as dist

        profile.disable()
        out = Path(args["profile"])
        out.mkdir(parents=True, exist_ok=True)
        profile.dump_stats(out / f"{Path(run_dir).name}-rank{dist.get_rank()}.pstat")  # impl-round
    return summary(times, base, faults)


def rounds_of(world: int, impls: list[str], args: dict, rounds: int
              ) -> tuple[dict[str, dict], dict[str, list[float]]]:
    """``_harness.best_of`` that also keeps each round's step time of each implementation."""
    runs: dict[str, list[float]] = {impl: [] for impl in impls}
    return best_of(world, worker, impls, args, rounds, runs), runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/pipeline.json")
    ap.add_argument("--only", default="", help="comma-separated implementations to run "
                    "(default: all)")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="write each rank's cProfile of its steps to DIR (one .pstat per "
                         "implementation, round and rank; read with python -m pstats)")
    ap.add_argument("--keep-freed", action="store_true",
                    help="also run each implementation keeping freed memory in its processes "
                         "(glibc: run.malloc_keep's policy), as NAME+keep in the same rounds")
    ap.add_argument("--meshlm-glibc", action="store_true",
                    help="also run each meshlm side under glibc's malloc policy as it comes "
                         "(run.malloc_cache_mb=0), as NAME+glibc in the same rounds")
    ap.add_argument("--torch-cache", action="store_true",
                    help="also run each torch side under meshlm's default malloc policy "
                         "(run.malloc_cache_mb, which meshlm's side runs under), as NAME+cache "
                         "in the same rounds: the ratio with the same allocator policy")
    a = ap.parse_args()
    if a.steps < 3:  # the first two steps are warm-up: the time is the median of steps 3..N
        ap.error(f"--steps {a.steps}: at least 3 (steps 1-2 are warm-up)")
    if a.keep_freed and (a.torch_cache or a.meshlm_glibc):  # (one malloc suffix a run)
        ap.error("--keep-freed runs both sides under one policy: not with --torch-cache or "
                 "--meshlm-glibc")
    args = vars(a)
    build_data(config(args, "meshlm-1f1b", "unused").data)
    impls = list(IMPLS)
    if a.only:
        unknown = set(a.only.split(",")) - set(impls)
        if unknown:
            ap.error(f"--only: unknown implementation(s) {', '.join(sorted(unknown))}")
        impls = [i for i in impls if i in a.only.split(",")]
    if a.keep_freed:
        impls = [x for i in impls for x in (i, i + KEEP)]
    if a.meshlm_glibc:
        impls = [x for i in impls for x in ((i, i + GLIBC) if i.startswith("meshlm") else (i,))]
    if a.torch_cache:
        impls = [x for i in impls for x in ((i, i + CACHE) if i.startswith("torch") else (i,))]
    best, runs = rounds_of(a.world, impls, args, a.rounds)
    tokens = a.batch * a.seq
    rows = []
    for impl in impls:
        b, peer = best[impl], PAIRS.get(impl.removesuffix(KEEP).removesuffix(GLIBC), "")
        peer = peer + KEEP if peer and impl.endswith(KEEP) else peer
        ref = best.get(peer)
        # the pair's ratio in each round (run one after the other), the median of the rounds:
        # a load that comes and goes on a shared machine moves both sides of a round alike
        ratios = [x / y for x, y in zip(runs[impl], runs[peer], strict=True)] if ref else []
        same = (best.get(peer + CACHE) if peer and impl.startswith("meshlm")
                and not impl.endswith(GLIBC) else None)  # (+glibc: not the same policy)
        same_ratios = ([x / y for x, y in zip(runs[impl], runs[peer + CACHE], strict=True)]
                       if same else [])
        rows.append(dict(b, tokens_per_s=tokens / b["step_time_s"], vs=peer or None,
                         time_ratio=statistics.median(ratios) if ratios else None,
                         round_ratios=ratios,
                         memory_ratio=b["peak_rss_growth"] / ref["peak_rss_growth"] if ref
                         else None,
                         same_malloc_time_ratio=(statistics.median(same_ratios) if same_ratios
                                                 else None),
                         same_malloc_round_ratios=same_ratios,
                         same_malloc_memory_ratio=(b["peak_rss_growth"] / same["peak_rss_growth"]
                                                   if same else None),
                         # minor page faults a step (median of steps 3..), per round, per rank
                         faults_per_step=runs.get(f"{impl}/faults")))
    print(f"model {a.preset} ({a.layers} layers, untied), pp {a.world} (gloo, 1 thread/rank), "
          f"batch {a.batch} x {a.seq} in {a.microbatches} micro-batches, fp32, median of steps "
          f"3..{a.steps}, best of {a.rounds} runs; time ratio: the median over the rounds of "
          "the pair's ratio in a round")
    print_rows(rows, 18)
    for r in rows:
        if r["same_malloc_time_ratio"] is not None:
            print(f"{r['impl']} vs {r['vs']}{CACHE} (the same malloc policy on both sides): time "
                  f"ratio {r['same_malloc_time_ratio']:.3f}, memory ratio "
                  f"{r['same_malloc_memory_ratio']:.3f}")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": args, "rows": rows}, indent=1))
    print(f"ratios: meshlm / torch.distributed.pipelining counterpart; wrote {out}")


if __name__ == "__main__":
    main()
