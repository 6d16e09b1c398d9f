"""The training loop of one rank, assembled from parts that are each built from their own config
section (train/parts/): model and parallelisation, batches, optimizer update, checkpointer,
recorder, fault handling, collective watch, context parallelism, DiLoCo islands.

A step: this rank's micro-batches through the layout's step runner (train/steps.py; under pp
the schedule of train/pipelined.py), each loss divided by ``grad_accum`` so that the gradients
are those of the global-batch mean, then the optimizer update (reduce, clip by global norm,
AdamW step). The data of step k depends only on (seed, k) and the initial weights only on
(seed, model config), so every layout reproduces the single-process loss curve.

Memory per rank: weights + gradients + Adam moments = 16 bytes per parameter in fp32
(Ψ(4 + 4 + 8)), plus the activations of one micro-batch. Communication per step: the engine's
gradient reduction, one all-reduce of the loss over dp x cp, the recorder's of the metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import Config, resolve_world, to_toml
from ..data import build_data, cache_root
from ..distributed.comm import Comm, CommLog
from ..distributed.mesh import Mesh
from ..distributed.phases import phase, phase_of
from ..generate import generate_text
from ..parallel.training_heads import needs_target_docs
from ..precision import PrecisionPlan
from .metrics import PhasePeaks
from .oom import Advice, OutOfMemory, is_oom
from .oom import describe as describe_oom
from .parts import Stateful
from .parts.batches import Batches, load_data
from .parts.checkpointer import Checkpointer
from .parts.context import ContextShare
from .parts.faults import FaultHandling
from .parts.islands import Islands
from .parts.model import ModelPart, Routing
from .parts.optimizer import OptimizerUpdate
from .parts.recorder import Recorder
from .parts.schedule import is_eval_step, is_save_step
from .parts.watch import CollectiveWatch
from .process import keep_freed_memory, pin_malloc_mmap_threshold, set_process_policies
from .run_dir import agree_run_dir, resolve_run_dir, write_run_files
from .sampling import full_logits
from .steps import build_runner
from .stopping import StopSignals

__all__ = ["TrainResult", "Trainer", "keep_freed_memory", "pin_malloc_mmap_threshold",
           "prepare_launch", "run_worker", "train"]
Log = Callable[[str], None]


@dataclass
class TrainResult:
    run_dir: Path
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    final_step: int = 0
    sample: str | None = None
    stopped_by: str = ""  # the signal that stopped the run early ("" : it ran to the end)

    def rewind(self, step: int) -> None:
        """Forget the losses after ``step`` (a rollback redoes those steps)."""
        for table in (self.losses, self.val_losses):
            for k in [k for k in table if k > step]:
                del table[k]


def build_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
        torch.device("cpu"))


def _quiet(_msg: str) -> None:
    pass


class Trainer:
    """Runs the steps of one rank; rank 0 also logs, writes metrics and checkpoints.

    Its parts are its attributes (``model_part``, ``batches``, ``optimizer``, ``runner``...);
    ``states``: more named stateful parts (see ``train/parts``) that the checkpointer saves and
    restores after the trainer's own, under their names."""

    # its own stateful parts' names, in the order a checkpoint restores them (batches first: a
    # checkpoint of other data settings, or of weights only, is refused before a tensor is read)
    STATES = ("batches", "optimizer", "model", "islands")

    def __init__(self, cfg: Config, log: Log = print, progress: bool = True,
                 comm_log: CommLog | None = None,
                 states: Mapping[str, Stateful] | None = None) -> None:
        clash = sorted(set(self.STATES) & set(states or {}))
        if clash:
            raise ValueError(f"stateful part names {clash} are the trainer's own")
        self.device = build_device()
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        cfg = resolve_world(cfg, world)  # infers dp under torchrun/SLURM (load_config validated)
        self.mesh = Mesh(cfg.layout(), self.device.type)
        self.comm = Comm(self.mesh, comm_log if comm_log is not None else CommLog())
        self.main = self.mesh.is_logging_rank
        self.log = log if self.main else _quiet
        self.show_progress = progress and self.main
        cfg, self.run_dir = agree_run_dir(cfg, self.comm, log=self.log)
        # the resolved config every part reads: sealed, nothing writes it
        self.cfg = cfg = cfg.sealed()
        self.watch = CollectiveWatch(cfg.distributed, self.comm, self.run_dir)
        self.data = load_data(cfg.data, self.comm, self.log)
        self.memory = PhasePeaks(self.device)
        # [precision] resolved once; the parts that need it read this plan
        self.precision = PrecisionPlan.from_section(cfg.precision)
        # the parts, in the order their start-up collectives and log lines run
        m = self.model_part = ModelPart(
            cfg.model, cfg.parallel, cfg.train, self.precision, cfg.model_config,
            self.data.tokenizer.vocab_size, self.comm, self.device, self.run_dir, self.memory,
            self.log, compile_cache=cache_root(cfg.data) if cfg.train.compile else None)
        # per-step agreements run over this rank's island ("world" when there is one)
        axis = "inner" if self.mesh.islands > 1 else "world"
        self.faults = FaultHandling(cfg.train, self.comm, axis, self.log)
        self.routing = Routing(m.model, self.comm, m.model_cfg)
        self.optimizer = OptimizerUpdate(cfg.train, self.precision, m.engine, self.comm, axis,
                                         self.device.type, self.faults, self.routing)
        self.stop = StopSignals()
        self.stop_agreed = False  # some rank was asked to stop: every rank stops here
        self.runner = build_runner(cfg, m, self.optimizer.precision, self.comm, self.device,
                                   self.faults.after_micro_batch)  # pipeline or plain loop
        self.context = ContextShare(cfg.parallel, m.cp, self.comm, cfg.data.seq_len)
        self.recorder = Recorder(
            cfg.train, cfg.distributed, self.comm, self.device, m.engine, m.model_cfg,
            cfg.data.seq_len, self.memory, axis,
            [self.optimizer, self.runner, self.context, self.routing, self.faults],
            self.run_dir, self.log, m.compile_cache)
        self.islands = Islands(cfg.diloco, m.engine, self.comm, m.model_cfg.n_layers,
                               cfg.train.steps)
        self.batches = Batches(cfg.data, cfg.train, self.data, self.mesh, self.context.positions,
                               target_docs=needs_target_docs(m.model_cfg))
        own: dict[str, Stateful] = dict(zip(self.STATES, (self.batches, self.optimizer, m,
                                                           self.islands), strict=True))
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.run, lambda: to_toml(cfg),
                                         self.run_dir, {**own, **(states or {})}, self.comm,
                                         self.memory, self.log)
        self.parts = (self.watch, self.model_part, self.faults, self.optimizer, self.context,
                      self.recorder, self.islands, self.batches, self.checkpointer)
        self.step = self.checkpointer.resume() or 0
        self.recorder.measure_peak(self.precision)
        if self.main:
            write_run_files(self.run_dir, cfg, self.data.tokenizer,
                            {"peak_flops": self.recorder.peak,
                             "peak_flops_source": self.recorder.peak_source,
                             "layout": self.mesh.describe()})
        self.recorder.log_startup(cfg, m.model_cfg, [*self.context.startup_lines(),
                                                     *self.islands.startup_lines(),
                                                     *m.startup_lines()], self.step)

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> tuple[float, float | None]:
        """Forward + backward over this rank's share of the global batch, reduce, clip, step.

        Returns (global mean loss, global gradient norm; None when fp16 skipped the step).
        """
        self.faults.begin_step(step)
        micro = self.batches.micro_batches(step)
        self.context.begin_step()
        loss = self.runner.forward_backward(micro)  # this rank's (this pipeline's) mean
        grad_norm = self.optimizer.update(step, loss)  # (reduce, clip, step: every layout)
        n = self.mesh.size("dp_cp")  # each cp rank's loss is the mean over its equal share
        return self.comm.reduce_scalars([loss], "dp_cp")[0] / n, grad_norm

    @torch.no_grad()
    @phase("evaluation")
    def evaluate(self) -> float:
        """Token-weighted mean loss over the fixed validation batches (every rank runs all;
        under context parallelism each on its share of every sequence)."""
        model = self.model_part.model
        model.eval()
        total, count = 0.0, 0
        for batch, doc_ids in self.batches.val:
            batch = batch.to(self.device)
            inputs, targets = self.context.shard(batch[:, :-1]), self.context.shard(batch[:, 1:])
            total += self.runner.eval_loss(inputs, targets, doc_ids) * batch.shape[0]
            count += batch.shape[0]
        self.model_part.engine.end_evaluation()
        model.train()
        return self.context.mean_of_shares(total) / count

    def record(self, step: int, loss: float, grad_norm: float | None, dt: float,
               wait: float = 0.0) -> dict[str, Any]:
        """The metrics record of ``step`` (collective; see ``Recorder.record``); agrees on a
        stop request."""
        rec, self.stop_agreed = self.recorder.record(step, loss, grad_norm, dt, wait,
                                                     self.stop.requested)
        return rec

    def outer_sync(self, step: int, loss: float) -> dict[str, Any]:
        """DiLoCo: the outer step of the fragments due after ``step`` (nothing without
        islands). A stop request waits for the next synchronisation."""
        rec, self.stop_agreed = self.islands.outer_sync(step, loss, self.stop_agreed)
        return rec

    # ------------------------------------------------------------------ loop
    def fit(self) -> TrainResult:
        steps = self.cfg.train.steps
        result = TrainResult(self.run_dir, final_step=self.step)
        start = step = self.step
        out = self.recorder
        out.open(self.cfg.run, self.cfg.profile.steps, start, self.show_progress,
                 self.model_part.model.layers)
        try:
            with self.stop:
                while step < steps:
                    step += 1
                    out.start_step(step)
                    t0 = time.perf_counter()
                    loss, grad_norm = self.train_step(step)
                    dt = time.perf_counter() - t0
                    wait = out.wait_clock.stop()
                    self.step = step
                    if step == start + 1:  # start-up is over: the shorter collective timeout
                        self.watch.set_timeout(self.cfg.distributed.timeout_s)
                    if self.faults.end_step(step):  # train.on_nonfinite=rollback
                        self.rollback(step, result)
                        step = self.step
                        out.end_step(step)
                        continue
                    rec = self.record(step, loss, grad_norm, dt, wait)  # (agrees on stop)
                    rec.update(self.outer_sync(step, loss))  # islands meet: stop agreed by all
                    if step == start + 1:
                        rec.update(out.first_step_fields(dt))
                    if is_eval_step(self.cfg.train, step) and not self.stop_agreed:
                        rec["val_loss"] = result.val_losses[step] = self.evaluate()
                    if is_save_step(self.cfg.train, step) or self.stop_agreed:
                        self.checkpointer.save(step)  # (checkpoint.async: goes on writing)
                        rec["mem_save_bytes"] = self.memory.phases["save"]
                        rec.update(self.checkpointer.record())
                    result.losses[step] = loss
                    out.end_step(step, rec, dt)
                    if self.stop_agreed and step < steps:
                        self.checkpointer.wait()
                        result.stopped_by = self.stop.name or "a stop request to another rank"
                        self.log(f"stopped by {result.stopped_by} after step {step}; "
                                 "the checkpoint of that step is complete")
                        break
                self.checkpointer.wait()  # the last save is complete before the run ends
        finally:
            out.close()
        out.log_traces(self.step)
        result.final_step = self.step
        out.write_timeline(self.runner.timeline())
        return result

    def rollback(self, step: int, result: TrainResult) -> None:
        """``train.on_nonfinite=rollback``: reload the latest complete checkpoint and skip the
        batch of ``step`` from now on (every rank, as they agreed on the non-finite step)."""
        what = self.faults.nonfinite
        self.step, done = self.checkpointer.rollback(step, what)
        bad = self.batches.skip_batch_of(step)  # (joins the skip list the load restored)
        result.rewind(self.step)
        self.recorder.rewind(self.step)
        self.log(f"step {step}: {what}; {done}; batch {bad} is skipped from now on "
                 f"(train.on_nonfinite=rollback, {self.faults.policy.rollbacks} so far)")

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, S, V) whole-vocabulary logits of ``ids``, whatever the layout (collective; see
        ``train/sampling.py``)."""
        m = self.model_part
        return full_logits(m.model, m.tp, self.runner if m.pipe is not None else None, ids)

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        """Every rank samples (sharded weights are gathered collectively); all agree. Under
        context parallelism every cp rank runs the whole context alone (weights are whole)."""
        model = self.model_part.model
        # (logits_out: a chunked loss makes forwards stop at the head)
        with phase("sampling"), model.logits_out(), self.context.whole_context():
            return generate_text(model, self.data.tokenizer, prompt, max_new_tokens,
                                 seed=self.cfg.train.seed, forward=self.logits)


def prepare_launch(cfg: Config, log: Log = print) -> None:
    """Checks done once in the launching process: run dir (never overwritten) and data."""
    resolve_run_dir(cfg, log=log)  # (with the resume checks)
    build_data(cfg.data, log=log)  # cached now, so workers only read it


def run_worker(cfg: Config, oom_advice: Advice | None = None) -> TrainResult:
    """Entry point of a locally launched worker (the process group is already initialised)."""
    return train(cfg, oom_advice=oom_advice)


def train(cfg: Config, log: Log = print, progress: bool = True,
          oom_advice: Advice | None = None) -> TrainResult:
    """Train with ``cfg``; prints a sample at the end when ``run.sample_tokens`` > 0.

    ``oom_advice``: what an out-of-memory line adds after the bytes (``train/oom.py``;
    ``meshlm train`` passes the planner's estimate and levers)."""
    set_process_policies(cfg.run)  # malloc, threads
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    cfg = resolve_world(cfg, world)  # (the layout an out-of-memory line describes)
    try:
        with phase("construction"):
            trainer = Trainer(cfg, log=log, progress=progress)
        return _fit(trainer, cfg)
    except Exception as exc:
        if not is_oom(exc):
            raise
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # (the planner's arithmetic runs on this process's CPU; the device is full)
        raise OutOfMemory(describe_oom(cfg, rank, phase_of(exc), exc, build_device(),
                                       oom_advice)) from None


def _fit(trainer: Trainer, cfg: Config) -> TrainResult:
    try:
        result = trainer.fit()
    except Exception as exc:
        failure = trainer.watch.failure(exc)  # a peer froze or died: named from the flight
        if failure is None:
            raise
        raise failure from exc
    finally:
        trainer.watch.close()
    trainer.recorder.log_end(result.val_losses, trainer.step,
                              trainer.model_part.model_cfg.is_moe)
    if cfg.run.sample_tokens and not result.stopped_by:
        result.sample = trainer.sample(cfg.run.sample_prompt, cfg.run.sample_tokens)
        trainer.log("sample:\n" + result.sample)
    return result
