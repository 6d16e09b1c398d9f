"""The recorder part: the metrics record of each step, the log's start-up and end lines, and
what a run writes as it goes (metrics.jsonl, the live line, profiler traces, the timeline).

The record of a step: loss, learning rate, gradient norm, throughput and MFU, memory and state
bytes, communication bytes, then the fields of each contributor part, in order (loss scale,
pipeline bubble, context-parallel tiles, MoE routing, non-finite counts), then every rank's step
and wait times (rank 0 names stragglers from them: train/stragglers.py). Communication: one
all-reduce of 6 x world + 1 float64 per step (several ranks; logged as metrics traffic) that
also agrees on a stop request. Memory: the records of the straggler window on rank 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...config import Config, DistributedSection, RunSection, TrainSection, profile_steps
from ...distributed.comm import Comm
from ...models.config import ModelConfig
from ...optim import lr_at
from ...parallel.compile import compile_stats
from ...parallel.engine import Engine
from ...parallel.expert import router_summary, router_text
from ...precision import PrecisionPlan
from ..metrics import MetricsWriter, PhasePeaks, read_metrics
from ..peak import peak_flops
from ..profiling import StepProfiler, describe_traces
from ..progress import ProgressLine
from ..run_dir import environment
from ..stragglers import WARMUP_STEPS, detector_for, wait_clock
from . import Contributor
from .schedule import is_eval_step, is_save_step

Log = Callable[[str], None]


class Recorder:
    """Measures and writes what a run reports; ``contributors`` add their record fields."""

    SECTION = "train"

    def __init__(self, section: TrainSection, distributed: DistributedSection, comm: Comm,
                 device: torch.device, engine: Engine, model_cfg: ModelConfig, seq_len: int,
                 memory: PhasePeaks, axis: str, contributors: Sequence[Contributor],
                 run_dir: Path, log: Log, compile_cache: Path | None = None) -> None:
        self.section, self.comm, self.mesh, self.engine = section, comm, comm.mesh, engine
        self.device, self.memory, self.axis, self.log = device, memory, axis, log
        self.contributors, self.run_dir, self.compile_cache = contributors, run_dir, compile_cache
        # every rank's step and wait times ride on the metrics all-reduce; rank 0 names
        # stragglers (train/stragglers.py), ignoring a compiled run's compiling step too
        self.wait_clock = wait_clock(comm, device.type, log)
        self.stragglers = detector_for(self.mesh, distributed.straggler_threshold,
                                       distributed.straggler_steps,
                                       warmup=WARMUP_STEPS + int(section.compile))
        self.tokens_per_step = section.global_batch * seq_len
        self.flops_per_token = model_cfg.flops_per_token(seq_len)
        self.peak, self.peak_source = 0.0, ""
        self.precision = PrecisionPlan()

    def measure_peak(self, precision: PrecisionPlan) -> None:
        """The per-rank peak FLOP/s of MFU (``train.peak_flops``, or measured / datasheet) in
        ``precision``'s compute dtype (under fp8 that of the rest: the 16-bit peak, as
        torchtitan counts fp8 runs); the start-up lines name ``precision``."""
        self.precision = precision
        self.peak, self.peak_source = peak_flops(self.device, precision.compute,
                                                 self.section.peak_flops)

    # ------------------------------------------------------------------ one step
    def record(self, step: int, loss: float, grad_norm: float | None, dt: float, wait: float,
               stop_requested: bool) -> tuple[dict[str, Any], bool]:
        """The metrics record of ``step`` and whether some rank was asked to stop (then all
        stop here). Collective: with several ranks, one all-reduce of 6 x world float64
        (logged as metrics traffic) gives every rank's step peak, state bytes, step time
        ``dt`` and seconds ``wait`` spent waiting in collectives; ``mem_peak_bytes`` is the
        largest peak, and on evaluation and checkpoint steps (the last step is one) the
        record also lists them per rank for ``meshlm report``. Every record lists the step
        and wait times per rank (rank 0 looks for stragglers in them). With islands, "world"
        is this rank's island (ranks of island 0 in rank 0's record)."""
        train = self.section
        tps = self.tokens_per_step / dt
        mem = self.engine.state_bytes()
        world = self.mesh.size(self.axis)
        rank = self.mesh.local_rank(self.axis)
        table = [0.0] * (6 * world + 1)  # per rank: peak, params, grads, optim, time, wait; stop
        table[6 * rank: 6 * rank + 6] = [float(self.memory.measure("steps")), mem["params"],
                                         mem["grads"], mem["optim"], dt, wait]
        table[-1] = float(stop_requested)
        if world > 1:
            table = self.comm.reduce_scalars(table, self.axis)
        stop_agreed = table[-1] > 0
        table = table[:-1]
        per_rank = [[int(x) for x in table[i::6]] for i in range(4)]
        rec: dict[str, Any] = {
            "step": step, "loss": loss, "lr": lr_at(step, train), "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "mfu": tps * self.flops_per_token / (self.peak * self.mesh.world_size),
            "step_time_s": dt, "mem_peak_bytes": max(per_rank[0]),
            "tokens_seen": step * self.tokens_per_step,
            "params_bytes": mem["params"], "grads_bytes": mem["grads"], "optim_bytes": mem["optim"],
            **({"mem_peak_per_rank": per_rank[0], "params_bytes_per_rank": per_rank[1],
                "grads_bytes_per_rank": per_rank[2], "optim_bytes_per_rank": per_rank[3]}
               if is_eval_step(train, step) or is_save_step(train, step) else {}),
            "comm_bytes": self.comm.log.bytes_by_op(),
        }
        for part in self.contributors:
            rec.update(part.record(step))
        rec.update(self.straggler_record(step, table[4::6], table[5::6]))
        return rec, stop_agreed

    def straggler_record(self, step: int, times: list[float], waits: list[float]
                         ) -> dict[str, Any]:
        """Every rank's step and wait times (seconds, island order) for the record; rank 0
        logs what its straggler detector decides and adds the slowest named rank. The
        detector reads the times as recorded (to the microsecond), so the metrics replay to
        the same lines."""
        times, waits = [round(t, 6) for t in times], [round(w, 6) for w in waits]
        rec: dict[str, Any] = {"step_time_per_rank": times, "wait_time_per_rank": waits}
        if self.stragglers is None:
            return rec
        for line in self.stragglers.update(step, times, waits):
            self.log(line)
        if (worst := self.stragglers.current) is not None:
            rec["straggler"] = worst.record()
        return rec

    def first_step_fields(self, dt: float) -> dict[str, Any]:
        """This process's start-up peaks, once, and the compile line (``train.compile``)."""
        rec: dict[str, Any] = {f"mem_{k}_bytes": v for k, v in self.memory.phases.items()
                               if k != "steps"}
        if self.section.compile:
            rec["compile"] = self.log_compile(dt)
        return rec

    def log_compile(self, first_step_s: float) -> dict[str, float]:
        """The start-up log line of ``train.compile`` (after the first step, which compiles)."""
        stats = compile_stats()
        self.log(f"compile: {stats['compile_s']:.1f} s in the first step ({first_step_s:.1f} s), "
                 f"{stats['graphs']:.0f} graphs, {stats['graph_breaks']:.0f} graph breaks, "
                 f"FX graph cache {stats['cache_hits']:.0f} hits / {stats['cache_misses']:.0f} "
                 f"misses ({self.compile_cache})")
        return stats

    # ------------------------------------------------------------------ a run's outputs
    def open(self, run: RunSection, profile: str, start: int, show_progress: bool,
             layers: Mapping[str, nn.Module]) -> None:
        """metrics.jsonl (logging rank; resuming: the records after ``start`` are dropped),
        the live line, and the profiler of ``profile.steps``."""
        self.start, self.recent = start, []
        self.writer = (MetricsWriter(self.run_dir, run.tensorboard, keep_until=start)
                       if self.mesh.is_logging_rank else None)
        self.bar = ProgressLine(self.section.steps, start, self.section.log_every, show_progress)
        self.profile_text, self.window = profile, profile_steps(profile)
        self.profiler = StepProfiler(self.window, self.run_dir / "profile", self.mesh.rank,
                                     self.device, layers)

    def start_step(self, step: int) -> None:
        self.profiler.start_step(step)
        self.comm.log.reset()
        self.wait_clock.start()

    def end_step(self, step: int, rec: dict[str, Any] | None = None, dt: float = 0.0) -> None:
        """Write ``rec`` (metrics.jsonl, live line with the time left); end the step's trace."""
        if rec is not None:
            if self.writer is not None:
                self.writer.write(rec)
            if not (self.section.compile and step == self.start + 1):  # (compiling is not a step)
                self.recent = (self.recent + [dt])[-20:]
            mean = sum(self.recent) / len(self.recent) if self.recent else dt
            self.bar.update(rec, eta_s=mean * (self.section.steps - step))
        self.profiler.end_step(step)

    def rewind(self, step: int) -> None:
        """Drop the records after ``step`` (a rollback redoes those steps)."""
        if self.writer is not None:
            self.writer.rewind(step)

    def close(self) -> None:
        self.profiler.close()
        self.bar.close()
        if self.writer is not None:
            self.writer.close()

    def log_traces(self, last: int) -> None:
        """The line naming the profiler's traces (or saying no step of the window ran)."""
        if self.profiler.files:
            self.log(describe_traces(self.run_dir / "profile", self.window, self.mesh.world_size,
                                     self.device.type == "cuda"))
        elif self.window:
            self.log(f"profile: no step of profile.steps={self.profile_text} ran "
                     f"(this run did steps {self.start + 1}-{last}); nothing traced")

    def write_timeline(self, timeline: dict[str, Any] | None) -> None:
        """The last step's measured actions of this rank: ``timeline/rank_NNNN.json``."""
        if timeline is None:
            return
        out = self.run_dir / "timeline"
        out.mkdir(parents=True, exist_ok=True)
        rec = {"rank": self.mesh.rank, **timeline}
        (out / f"rank_{self.mesh.rank:04d}.json").write_text(json.dumps(rec))

    # ------------------------------------------------------------------ start and end lines
    def log_startup(self, cfg: Config, model_cfg: ModelConfig, lines: Sequence[str],
                    step: int) -> None:
        """What runs where: versions, layout, model, batch, the parts' own ``lines`` (context
        parallelism, islands, experts), peak FLOP/s, run dir, start-up peak memory."""
        mc, c, device = model_cfg, cfg, self.device
        env = environment()
        self.log(f"meshlm {env['meshlm']} (git {env['git_commit']}), torch {env['torch']}, "
                 f"{device.type} x{env['threads']} thread(s) per rank")
        self.log(f"layout: {self.mesh.describe()}, zero {c.parallel.zero}, "
                 f"engine {type(self.engine).__name__}, precision {self.precision.name}")
        from ...models.presets import PRESETS

        preset = PRESETS.get(c.model.preset)
        vocab = f"vocabulary {mc.vocab_size}"
        if preset is not None and preset.vocab_size != mc.vocab_size and not c.model.init_from:
            # (`meshlm info` counts the preset's own vocabulary)
            vocab += f" from the tokenizer; meshlm info counts the preset's {preset.vocab_size}"
        self.log(f"model {c.model.preset}: {mc.num_params() / 1e6:.2f} M parameters ({vocab}), "
                 f"{self.flops_per_token / 1e6:.1f} MFLOP/token at seq {c.data.seq_len}")
        self.log(f"batch: {c.train.global_batch} x {c.data.seq_len} tokens/step, "
                 f"micro-batch {c.train.micro_batch}, accumulation {c.grad_accum}")
        for line in lines:
            self.log(line)
        self.log(f"peak {self.peak / 1e9:.1f} GFLOP/s per rank ({self.peak_source})")
        if self.mesh.is_logging_rank:  # bf16 slower than fp32 on this CPU: say so
            from ..peak import check_bf16

            p = self.precision
            if warning := check_bf16(device, p.compute, p.compute_key):
                self.log(warning)
        self.log(f"run dir {self.run_dir}" + (f", resuming at step {step}" if step else ""))
        for name, peaks in self.memory.per_rank.items():
            self.log(f"peak memory at {name}: largest rank {max(peaks) / 2**20:,.0f} MiB "
                     f"(ranks: {', '.join(f'{p / 2**20:,.0f}' for p in peaks)} MiB)")

    def log_end(self, val_losses: dict[int, float], step: int, moe: bool) -> None:
        """The first and last validation loss, the last checkpoint, the routing summary."""
        if val_losses:
            first, last = min(val_losses), max(val_losses)
            self.log(f"validation loss: {val_losses[first]:.4f} (step {first})" + (
                f" -> {val_losses[last]:.4f} (step {last})" if last != first else ""))
        self.log(f"checkpoint: {self.run_dir / 'checkpoints' / f'step_{step:07d}'}")
        metrics = self.run_dir / "metrics.jsonl"
        if self.mesh.is_logging_rank and moe and metrics.exists():
            summary = router_summary(read_metrics(metrics))
            if summary:
                self.log("router:\n" + router_text(summary))
