"""The planner against meshlm itself on this machine: predicted vs measured step time and memory.

    OMP_NUM_THREADS=1 python benchmarks/planner_vs_measured.py [--calibration PATH]
        [--steps 8] [--rounds 2] [--only NAME ...] [--json benchmarks/results/planner_vs_measured.json]

For each layout (``tiny``/``small``/``tiny-moe``, every dimension training supports: dp with
ZeRO 0-3, tp with and without sp, pp with 1F1B / interleaved / ZB-H1, cp ring / zigzag /
Ulysses, ep, recomputation selective / op / full, AdamW moments offloaded to disk, DiLoCo
islands, and products of these), the trainer's own ``train_step`` runs in a spawned gloo world
(one thread per rank; a one-process layout runs here with every core, as ``meshlm train``
does); with islands each step is followed by the trainer's ``outer_sync``:

- step time: the median over ``--steps`` steps after 2 warm-up steps (with islands the mean,
  so the synchronisation every H steps counts), the slowest rank's, best of ``--rounds`` runs
  (the machine is shared; others' jobs only slow a run down), each run started on a quiet
  machine;
- states: this rank's parameter, gradient and optimizer bytes (``Engine.state_bytes``, exact);
- activations: the peak, over one training step, of the bytes of tensors saved for backward
  (``torch.autograd.graph.saved_tensors_hooks``; unique storages, parameters and buffers
  excluded; a saved tensor counts until autograd releases it; op-level recomputation's
  selective-checkpoint cache counted too) -- with pipelining this includes every in-flight
  micro-batch;
- communication: the comm log's bytes per ``op/axis`` of one step (rank 0; with islands, of
  one outer round divided by H).

The planner predicts each from the calibrated ``cpu`` entry (``meshlm plan --calibrate``) and
the layout alone. Acceptance: step time within 25 %, per-rank memory (states + activations)
within 15 %; states within 5 %, activations within 25 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from meshlm.config import load_config
from meshlm.distributed.spawn import run_world
from meshlm.layout import Layout
from meshlm.models.config import ModelConfig
from meshlm.planner.calibrate import wait_for_quiet
from meshlm.planner.hardware import get_accelerator
from meshlm.planner.memory import stage_memory
from meshlm.planner.timing import comm_volumes, step_time
from meshlm.planner.workload import ModelSpec, Workload

# (name, preset, layout, extra config overrides). pp needs untied embeddings in meshlm.
UNTIE = ["--model.tie_embeddings=false"]
TINY_VOCAB = ["--data.vocab_size=512"]  # the tiny preset's vocabulary (the trainer's BPE size)
FP8 = ["--precision.dtype=fp8", "--precision.fp8_rest=fp32"]
SMALL_MOE = ["--model.moe_experts=4", "--model.moe_topk=2", "--model.moe_ffn_hidden=256",
             "--model.moe_shared_experts=1"]
LAYOUTS: list[tuple[str, str, Layout, list[str]]] = [
    ("single", "small", Layout(micro_batch=16), []),
    ("dp2", "small", Layout(dp=2, micro_batch=8), []),
    ("dp2-zero1", "small", Layout(dp=2, zero=1, micro_batch=8), []),
    ("dp2-zero2-accum2", "small", Layout(dp=2, zero=2, micro_batch=4), []),
    ("dp2-zero3", "small", Layout(dp=2, zero=3, micro_batch=8), []),
    ("dp4", "small", Layout(dp=4, micro_batch=4), []),
    ("dp4-zero3", "small", Layout(dp=4, zero=3, micro_batch=4), []),
    ("tp2", "small", Layout(tp=2, micro_batch=16), []),
    ("tp2-sp", "small", Layout(tp=2, sp=True, micro_batch=16), []),
    ("tp2-dp2-zero1", "small", Layout(tp=2, dp=2, zero=1, micro_batch=8), []),
    ("pp2-1f1b", "small", Layout(pp=2, micro_batch=4), UNTIE),
    ("pp2-interleaved", "small",
     Layout(pp=2, micro_batch=4, pp_schedule="interleaved", pp_virtual=2), UNTIE),
    ("pp2-zb", "small", Layout(pp=2, micro_batch=4, pp_schedule="zb"), UNTIE),
    ("pp2-dp2", "small", Layout(pp=2, dp=2, micro_batch=2), UNTIE),
    ("pp2-tp2-sp", "small", Layout(pp=2, tp=2, sp=True, micro_batch=4), UNTIE),
    ("tiny-dp2", "tiny", Layout(dp=2, micro_batch=8), TINY_VOCAB),
    ("tiny-tp2", "tiny", Layout(tp=2, micro_batch=16), TINY_VOCAB),
    # recomputation (one process, both cores)
    ("single-selective", "small", Layout(micro_batch=16, recompute="selective"), []),
    ("single-op", "small", Layout(micro_batch=16, recompute="op"), []),
    ("single-full", "small", Layout(micro_batch=16, recompute="full"), []),
    # context parallelism: each rank holds seq / cp tokens of every sequence
    ("cp2-zigzag", "small", Layout(cp=2, micro_batch=16, cp_attention="zigzag"), []),
    ("cp2-ring", "small", Layout(cp=2, micro_batch=16, cp_attention="ring"), []),
    ("cp2-ulysses", "small", Layout(cp=2, micro_batch=16, cp_attention="ulysses"), []),
    ("cp2-dp2-zero1", "small", Layout(cp=2, dp=2, zero=1, micro_batch=8), []),
    # expert parallelism (tiny-moe: 4 experts, top-2)
    ("moe-single", "tiny-moe", Layout(micro_batch=16), TINY_VOCAB),
    ("moe-ep2", "tiny-moe", Layout(dp=2, ep=2, micro_batch=8), TINY_VOCAB),
    ("moe-ep2-zero1", "tiny-moe", Layout(dp=2, ep=2, zero=1, micro_batch=8), TINY_VOCAB),
    # and on `small` with every MLP a MoE layer (4 experts of width 256, top-2, one shared)
    ("small-moe-single", "small", Layout(micro_batch=16), SMALL_MOE),
    ("small-moe-ep2", "small", Layout(dp=2, ep=2, micro_batch=8), SMALL_MOE),
    # AdamW moments in a memmapped file per rank (ZeRO-Infinity's NVMe tier)
    ("dp2-zero1-offload-disk", "small", Layout(dp=2, zero=1, micro_batch=8, offload="disk"),
     []),
    # DiLoCo: 2 islands of one rank, synchronising every 4 steps (the step time is the mean
    # over the steps, so one synchronisation in 4 counts a quarter)
    ("islands2-H4", "small", Layout(islands=2, micro_batch=8), ["--diloco.inner_steps=4"]),
    # FP8: the decoder linears in float8 (torchao's emulation on CPU: fp32 products); the rest
    # in fp32 on `small` (bf16 matmuls crawl on AVX2-only CPUs), in bf16 on `tiny`
    ("single-fp8", "small", Layout(micro_batch=16), FP8),
    ("single-fp8-rowwise", "small", Layout(micro_batch=16),
     [*FP8, "--precision.fp8_recipe=rowwise"]),
    ("tp2-sp-fp8", "small", Layout(tp=2, sp=True, micro_batch=16), FP8),
    ("tiny-fp8-bf16", "tiny", Layout(micro_batch=16),
     [*TINY_VOCAB, "--precision.dtype=fp8", "--precision.fp8_rest=bf16"]),
]
SEQ, BATCH = 256, 16
WARMUP = 2


def overrides(preset: str, lo: Layout, run_dir: str, extra: list[str]) -> list[str]:
    return [
        f"--model.preset={preset}", f"--data.seq_len={SEQ}", f"--train.global_batch={BATCH}",
        f"--train.micro_batch={lo.micro_batch}", "--train.steps=1000000", "--train.eval_every=0",
        f"--parallel.dp={lo.dp}", f"--parallel.tp={lo.tp}",
        f"--parallel.sp={'true' if lo.sp else 'false'}", f"--parallel.pp={lo.pp}",
        f"--parallel.pp_schedule={lo.pp_schedule}", f"--parallel.pp_virtual={lo.pp_virtual}",
        f"--parallel.zero={lo.zero}", f"--parallel.cp={lo.cp}",
        f"--parallel.cp_attention={lo.cp_attention}", f"--parallel.ep={lo.ep}",
        f"--parallel.offload={lo.offload}", f"--parallel.islands={lo.islands}",
        f"--train.recompute={lo.recompute}", f"--run.dir={run_dir}", "--run.sample_tokens=0",
        "--train.peak_flops=1e12", *extra,
    ]


class SavedBytes:
    """Live and peak bytes of tensors autograd saves (unique storages, no parameters).

    Op-level recomputation keeps its saved matmul outputs in torch's selective-checkpoint
    cache, not through autograd's saved-tensor hooks: :func:`track_sac_caches` records those
    caches, and their live tensors count too.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.live, self.peak = model, 0, 0
        self.refs: dict[int, int] = {}

    def _sac_bytes(self) -> int:
        seen, total = set(self.refs) | self._excluded(), 0
        for ref in list(SAC_CACHES):
            cache = ref()
            if cache is None:
                SAC_CACHES.remove(ref)
                continue
            for by_index in cache.values():
                for entry in by_index.values():
                    t = getattr(entry, "val", None)
                    if isinstance(t, torch.Tensor) and t.numel():
                        ptr = t.untyped_storage().data_ptr()
                        if ptr not in seen:
                            seen.add(ptr)
                            total += t.untyped_storage().nbytes()
        return total

    def _excluded(self) -> set[int]:
        return {t.untyped_storage().data_ptr()
                for t in [*self.model.parameters(), *self.model.buffers()] if t.numel()}

    def pack(self, t: torch.Tensor) -> object:
        box = _Box(t)
        if isinstance(t, torch.nn.Parameter) or t.numel() == 0:
            return box
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._excluded():
            return box
        if self.refs.get(ptr, 0) == 0:
            self.live += t.untyped_storage().nbytes()
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        self.peak = max(self.peak, self.live + (self._sac_bytes() if SAC_CACHES else 0))
        weakref.finalize(box, self._release, ptr, t.untyped_storage().nbytes())
        return box

    def _release(self, ptr: int, nbytes: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            self.live -= nbytes

    @staticmethod
    def unpack(box: _Box) -> torch.Tensor:
        return box.t


SAC_CACHES: list[weakref.ref] = []  # torch's selective-checkpoint caches of this process


def track_sac_caches() -> None:
    """Record the cache of every selective-checkpoint context meshlm creates (op-level
    recomputation), so :class:`SavedBytes` counts the outputs it keeps."""
    from meshlm.parallel import recompute

    make = recompute.create_selective_checkpoint_contexts

    def tracked(*args: Any, **kwargs: Any) -> Any:
        caching, cached = make(*args, **kwargs)
        holder = _CacheHolder(caching.storage)
        # the holder lives as long as either mode: the cached one until backward replays
        caching._meshlm_holder = cached._meshlm_holder = holder
        SAC_CACHES.append(weakref.ref(holder))
        return caching, cached

    recompute.create_selective_checkpoint_contexts = tracked


class _CacheHolder:
    """Weakly referenceable holder of one selective-checkpoint cache."""

    __slots__ = ("storage", "__weakref__")

    def __init__(self, storage: dict) -> None:
        self.storage = storage

    def values(self) -> Any:
        return self.storage.values()


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def worker(preset: str, lo_dict: dict, extra: list[str], run_dir: str, steps: int) -> dict:
    """One rank: time the trainer's steps, then measure states, activations and comm."""
    from meshlm.train.trainer import Trainer

    lo = Layout(**lo_dict)
    track_sac_caches()
    cfg = load_config(None, overrides(preset, lo, run_dir, extra))
    trainer = Trainer(cfg, log=lambda _m: None, progress=False)

    def one_step(step: int) -> None:  # the trainer's step, and DiLoCo's outer step when due
        loss, _ = trainer.train_step(step)
        if trainer.islands.diloco is not None:
            trainer.outer_sync(step, loss)

    times = []
    for step in range(1, WARMUP + steps + 1):
        t0 = time.perf_counter()
        one_step(step)
        times.append(time.perf_counter() - t0)
    # comm and saved bytes over one step -- DiLoCo: over one outer round of H steps, the
    # bytes divided by H (the planner's per-step average)
    window = cfg.diloco.inner_steps if lo.islands > 1 else 1
    trainer.comm.log.reset()
    saved = SavedBytes(trainer.model_part.model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        for step in range(WARMUP + steps + 1, WARMUP + steps + 1 + window):
            one_step(step)
    comm = {k: v / window for k, v in trainer.comm.log.bytes_by_op().items()}
    states = trainer.model_part.engine.state_bytes()
    # DiLoCo: the mean (a synchronisation every H steps is part of the cost); else the median
    pick = statistics.mean if lo.islands > 1 else statistics.median
    return {"step_time_s": pick(times[WARMUP:]), "states": states,
            "activations": saved.peak, "comm": comm, "pp_rank": trainer.mesh.local_rank("pp"),
            "model": trainer.model_part.model_cfg.to_dict(), "inner_steps": cfg.diloco.inner_steps}


def measure(name: str, preset: str, lo: Layout, extra: list[str], steps: int, rounds: int
            ) -> dict[str, Any]:
    best: dict[str, Any] | None = None
    for r in range(rounds):
        wait_for_quiet(300)
        run_dir = tempfile.mkdtemp(prefix=f"meshlm-plan-{name}-{r}-")
        args = (preset, lo.as_dict(), extra, run_dir, steps)
        if lo.world_size == 1:  # as `meshlm train` runs one process: every core
            saved_threads = torch.get_num_threads()
            torch.set_num_threads(torch.get_num_threads() if saved_threads > 1 else 2)
            try:
                res = [worker(*args)]
            finally:
                torch.set_num_threads(saved_threads)
        else:
            res = run_world(lo.world_size, worker, *args)
        step = max(x["step_time_s"] for x in res)  # the slowest rank sets the pace
        if best is None or step < best["step_time_s"]:
            best = {"step_time_s": step, "ranks": res}
    assert best is not None
    return best


def precision_of(extra: list[str]) -> tuple[str, str]:
    """(precision.dtype, precision.fp8_rest) a row's overrides set (fp32, bf16 by default)."""
    def value(key: str, default: str) -> str:
        return next((a.split("=", 1)[1] for a in extra if a.startswith(f"--{key}=")), default)

    return value("precision.dtype", "fp32"), value("precision.fp8_rest", "bf16")


def predict(lo: Layout, model: dict, inner_steps: int, hw_path: str | None,
            extra: list[str] = ()) -> tuple[Workload, Any, Any]:  # type: ignore[assignment]
    hw = get_accelerator("cpu", hw_path)
    dtype, rest = precision_of(list(extra))
    work = Workload(ModelSpec(ModelConfig.from_dict(model)), SEQ, BATCH, dtype=dtype,
                    states="fp32", profile="meshlm", inner_steps=inner_steps, fp8_rest=rest)
    return work, hw, step_time(work, lo, hw)


def rel(pred: float, meas: float) -> float:
    return pred / meas - 1 if meas else (0.0 if not pred else float("inf"))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name, preset, lo, extra in LAYOUTS:
        if args.only and name not in args.only:
            continue
        m = measure(name, preset, lo, extra, args.steps, args.rounds)
        work, hw, t = predict(lo, m["ranks"][0]["model"], m["ranks"][0]["inner_steps"],
                              args.calibration, extra)
        state_err = act_err = 0.0
        per_rank = []
        for rk in m["ranks"]:
            mem = stage_memory(work, lo, hw, rk["pp_rank"])
            st_meas = sum(rk["states"].values())
            st_pred = mem.states
            act_pred = mem.items["activations"]
            e_st, e_act = rel(st_pred, st_meas), rel(act_pred, rk["activations"])
            per_rank.append({"states_measured": st_meas, "states_predicted": st_pred,
                             "activations_measured": rk["activations"],
                             "activations_predicted": act_pred})
            state_err = max(state_err, abs(e_st))
            act_err = max(act_err, abs(e_act))
        vol_pred = comm_volumes(work, lo, 0)
        vol_meas = m["ranks"][0]["comm"]
        keys = sorted(set(vol_pred) | set(vol_meas))
        vol_err = max((abs(rel(vol_pred.get(k, 0), vol_meas.get(k, 0))) for k in keys),
                      default=0.0)
        row = {"name": name, "preset": preset, "layout": lo.describe(), "world": lo.world_size,
               "step_measured_s": m["step_time_s"], "step_predicted_s": t.step,
               "step_error": rel(t.step, m["step_time_s"]), "states_max_error": state_err,
               "activations_max_error": act_err, "comm_max_error": vol_err,
               "ranks": per_rank, "comm_measured": vol_meas, "comm_predicted": vol_pred,
               "predicted_items_s": t.items}
        rows.append(row)
        print(f"{name:<18} step {m['step_time_s']:.3f} s measured, {t.step:.3f} predicted "
              f"({row['step_error']:+.1%}); states {state_err:.1%}, activations "
              f"{act_err:.1%}, comm {vol_err:.1%}", flush=True)
    return rows


def memory_error(row: dict[str, Any]) -> float:
    """Largest relative error over the ranks of per-rank memory: states + activations."""
    return max(abs(rel(r["states_predicted"] + r["activations_predicted"],
                       r["states_measured"] + r["activations_measured"])) for r in row["ranks"])


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| layout | ranks | step measured (s) | step predicted (s) | error | memory err "
          "(max rank) | states err | activations err | comm bytes err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} (`{r['layout']}`) | {r['world']} | {r['step_measured_s']:.3f} | "
              f"{r['step_predicted_s']:.3f} | {r['step_error']:+.1%} | {memory_error(r):.1%} | "
              f"{r['states_max_error']:.2%} | {r['activations_max_error']:.1%} | "
              f"{r['comm_max_error']:.1%} |")
    ok_t = sum(abs(r["step_error"]) <= 0.25 for r in rows)
    ok_m = sum(memory_error(r) <= 0.15 for r in rows)
    ok_s = sum(r["states_max_error"] <= 0.05 for r in rows)
    ok_a = sum(r["activations_max_error"] <= 0.25 for r in rows)
    print(f"\nstep time within 25 %: {ok_t}/{len(rows)}; per-rank memory within 15 %: "
          f"{ok_m}/{len(rows)}; states within 5 %: {ok_s}/{len(rows)}; activations within "
          f"25 %: {ok_a}/{len(rows)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default=None, help="cpu calibration file (default: the "
                                                        "stored one, else the shipped entry)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="layout names to run")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--table", type=Path, default=None,
                    help="print the table of a JSON this script wrote, and run nothing")
    args = ap.parse_args(argv)
    if args.table:
        print_table(json.loads(args.table.read_text())["rows"])
        return 0
    rows = run(args)
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        hw = get_accelerator("cpu", args.calibration)
        args.json.write_text(json.dumps({"calibration": hw.sources.get("rates"),
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
