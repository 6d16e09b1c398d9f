"""The training loop, assembled from small ``build_*`` steps.

One optimizer step = ``grad_accum`` micro-batches of forward + backward (gradients summed,
each micro-batch loss divided by ``grad_accum`` so the result is the mean over the global
batch), gradient clipping by global norm, AdamW step, LR schedule. The data of step k depends
only on (seed, k) and the initial weights only on (seed, model config), so any layout that
computes the same global-batch mean reproduces this loss curve.

Memory per rank: weights + gradients + Adam moments = 16 bytes per parameter in fp32
(Ψ(4 + 4 + 8)), plus the activations of one micro-batch.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..checkpoint.state import (
    CheckpointError,
    find_latest,
    load_state,
    restore_rng,
    save_state,
    step_dir,
)
from ..config import Config, resolve_world, to_toml
from ..data import DataBundle, build_data
from ..data.sampler import StepSampler, val_batches
from ..distributed.comm import Comm, CommLog
from ..distributed.mesh import Mesh
from ..generate import generate_text
from ..models.llama import Transformer, build_model
from ..optim import lr_at
from ..parallel import parallelize
from ..parallel.engine import Engine
from ..parallel.state import gather_full_state, load_full_state
from ..parallel.tensor import TensorParallel
from ..precision import Precision
from .metrics import MetricsWriter, peak_memory_bytes
from .peak import peak_flops
from .pipelined import PipelineRunner
from .progress import ProgressLine
from .run_dir import (
    agree_run_dir,
    check_resume_compatible,
    environment,
    resolve_run_dir,
    write_run_files,
)
from .sampling import full_logits

Log = Callable[[str], None]


@dataclass
class TrainResult:
    run_dir: Path
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    final_step: int = 0
    sample: str | None = None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of (B, S, V) logits, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
        torch.device("cpu"))


# ---------------------------------------------------------------------- trainer
def _quiet(_msg: str) -> None:
    pass


class Trainer:
    """Runs the steps of one rank; rank 0 also logs, writes metrics and checkpoints."""

    def __init__(self, cfg: Config, log: Log = print, progress: bool = True,
                 comm_log: CommLog | None = None) -> None:
        self.cfg = cfg
        self.device = build_device()
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        resolve_world(cfg, world)  # infers dp under torchrun/SLURM (load_config validated)
        self.mesh = Mesh(cfg.layout(), self.device.type)
        self.comm = Comm(self.mesh, comm_log if comm_log is not None else CommLog())
        self.main = self.mesh.is_logging_rank
        self.log = log if self.main else _quiet
        self.show_progress = progress and self.main
        self.run_dir = agree_run_dir(cfg, self.comm)
        self.data = self.build_data()
        self.model_cfg = cfg.model_config(vocab_size=self.data.tokenizer.vocab_size)
        self.model: Transformer = build_model(self.model_cfg, cfg.train.seed, self.device)
        self.engine: Engine
        self.tp: TensorParallel | None
        par = parallelize(self.model, self.comm, cfg.parallel, cfg.train)
        self.engine, self.tp, self.pipe = par.engine, par.tp, par.pipe
        self.loss_fn = self.tp.loss if self.tp is not None else cross_entropy
        self.precision = Precision(cfg.precision.dtype, self.device.type)
        self.pipeline = (PipelineRunner(cfg, self.pipe, self.engine, self.tp, self.comm,
                                        self.loss_fn, self.precision, self.device)
                         if self.pipe is not None else None)
        self.dp_rank, self.dp_size = self.mesh.local_rank("dp"), self.mesh.size("dp")
        self.sampler = StepSampler(
            self.data.train_tokens, cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed
        )
        self.val = val_batches(
            self.data.val_tokens, cfg.data.seq_len, cfg.train.eval_batch_size,
            cfg.train.eval_batches
        )
        self.step = 0
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        self.flops_per_token = self.model_cfg.flops_per_token(cfg.data.seq_len)
        if cfg.run.resume:
            self.load_checkpoint(find_latest(self.run_dir / "checkpoints"))
        self.peak, self.peak_source = peak_flops(
            self.device, cfg.precision.dtype, cfg.train.peak_flops
        )
        if self.main:
            write_run_files(self.run_dir, cfg, self.data.tokenizer,
                            {"peak_flops": self.peak, "peak_flops_source": self.peak_source,
                             "layout": self.mesh.describe()})
        self.log_startup()

    # ------------------------------------------------------------------ build steps
    def build_data(self) -> DataBundle:
        """Rank 0 builds (or finds) the cached data first; the others then read the cache."""
        if self.main:
            data = build_data(self.cfg.data, log=self.log)
        self.comm.barrier()
        if not self.main:
            data = build_data(self.cfg.data, log=_quiet)
        return data

    def log_startup(self) -> None:
        mc, c = self.model_cfg, self.cfg
        env = environment()
        self.log(f"meshlm {env['meshlm']} (git {env['git_commit']}), torch {env['torch']}, "
                 f"{self.device.type} x{env['threads']} thread(s) per rank")
        self.log(f"layout: {self.mesh.describe()}, zero {c.parallel.zero}, "
                 f"engine {type(self.engine).__name__}, precision {c.precision.dtype}")
        self.log(f"model {c.model.preset}: {mc.num_params() / 1e6:.2f} M parameters, "
                 f"{self.flops_per_token / 1e6:.1f} MFLOP/token at seq {c.data.seq_len}")
        self.log(f"batch: {c.train.global_batch} x {c.data.seq_len} tokens/step, "
                 f"micro-batch {c.train.micro_batch}, accumulation {c.grad_accum}")
        self.log(f"peak {self.peak / 1e9:.1f} GFLOP/s per rank ({self.peak_source})")
        self.log(f"run dir {self.run_dir}" + (f", resuming at step {self.step}" if self.step else ""))

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> tuple[float, float]:
        """Forward + backward over this rank's share of the global batch, reduce, clip, step.

        Returns (global mean loss, global gradient norm).
        """
        cfg = self.cfg.train
        micro = self.sampler.rank_micro_batches(step, self.dp_rank, self.dp_size, cfg.micro_batch)
        if self.pipeline is not None:
            loss = self.pipeline.forward_backward(micro)
            grad_norm = self.optimizer_update(step)
            return self.comm.reduce_scalars([loss], "dp")[0] / self.dp_size, grad_norm
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro):
            self.engine.set_sync(i == len(micro) - 1)  # DDP communicates on the last only
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            with self.precision.autocast():
                loss = self.loss_fn(self.model(inputs), targets)
                aux = self.model.aux_loss()
            self.precision.scale((loss + aux) / len(micro)).backward()
            total += loss.detach()
        grad_norm = self.optimizer_update(step)
        loss_sum = self.comm.reduce_scalars([float(total) / len(micro)], "dp")[0]
        return loss_sum / self.dp_size, grad_norm

    def optimizer_update(self, step: int) -> float:
        """Reduce gradients, clip by the global norm, AdamW step, clear; returns the norm."""
        cfg = self.cfg.train
        self.engine.finish_grads()
        self.precision.unscale_(self.engine.optimizer)
        grad_norm = self.engine.clip_grad_norm(cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        self.engine.step(lr_at(step, cfg), self.precision)
        self.engine.zero_grad()
        return grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted mean loss over the fixed validation batches (every rank runs all)."""
        self.model.eval()
        total, count = 0.0, 0
        for batch in self.val:
            batch = batch.to(self.device)
            if self.pipeline is not None:
                loss = self.pipeline.eval_loss(batch)
            else:
                with self.precision.autocast():
                    loss = float(self.loss_fn(self.model(batch[:, :-1]), batch[:, 1:]))
            total += loss * batch.shape[0]
            count += batch.shape[0]
        self.model.train()
        return total / count

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Gather the layout-free state on every rank; rank 0 writes it."""
        weights, optim = gather_full_state(self.engine, self.tp, self.pipe, self.comm,
                                           self.cfg.train)
        directory = step_dir(self.run_dir / "checkpoints", self.step)
        if self.main:
            state = {"step": self.step, "sampler": self.sampler.state_dict(),
                     "tokens_seen": self.step * self.tokens_per_step,
                     "layout": self.mesh.describe()}
            save_state(directory, weights, optim, state,
                       {"config.toml": to_toml(self.cfg),
                        "tokenizer.json": self.run_dir / "tokenizer.json"},
                       self.precision.state_dict())
        self.comm.barrier()
        return directory

    def load_checkpoint(self, directory: Path | None) -> None:
        if directory is None:
            raise CheckpointError(f"no checkpoint in {self.run_dir / 'checkpoints'}")
        state = load_state(directory)
        weights, optim = state["weights"], state["optimizer"]
        try:
            load_full_state(self.engine, self.tp, self.pipe, self.cfg.train, weights, optim)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {directory}: {e}") from None
        self.sampler.load_state_dict(state["trainer"]["sampler"])
        self.precision.load_state_dict(state["scaler"])
        restore_rng(state["rng"])
        self.step = int(state["trainer"]["step"])

    # ------------------------------------------------------------------ loop
    def is_eval_step(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return every > 0 and (step == 1 or step % every == 0 or step == self.cfg.train.steps)

    def record(self, step: int, loss: float, grad_norm: float, dt: float) -> dict[str, Any]:
        tps = self.tokens_per_step / dt
        mem = self.engine.state_bytes()
        return {
            "step": step, "loss": loss, "lr": lr_at(step, self.cfg.train), "grad_norm": grad_norm,
            "tokens_per_s": tps, "mfu": tps * self.flops_per_token / (self.peak * self.mesh.world_size),
            "step_time_s": dt, "mem_peak_bytes": peak_memory_bytes(self.device),
            "tokens_seen": step * self.tokens_per_step,
            "params_bytes": mem["params"], "grads_bytes": mem["grads"], "optim_bytes": mem["optim"],
            "comm_bytes": self.comm.log.bytes_by_op(),
            **({"pp_bubble": self.pipeline.bubble,
                "pp_peak_live": self.pipeline.executor.peak_live}
               if self.pipeline is not None else {}),
        }

    def fit(self) -> TrainResult:
        cfg = self.cfg.train
        result = TrainResult(self.run_dir, final_step=self.step)
        start = self.step
        writer = (MetricsWriter(self.run_dir, self.cfg.run.tensorboard, keep_until=self.step)
                  if self.main else None)
        bar = ProgressLine(cfg.steps, self.step, cfg.log_every, self.show_progress)
        recent: list[float] = []
        try:
            for step in range(self.step + 1, cfg.steps + 1):
                self.comm.log.reset()
                t0 = time.perf_counter()
                loss, grad_norm = self.train_step(step)
                dt = time.perf_counter() - t0
                self.step = step
                rec = self.record(step, loss, grad_norm, dt)
                if self.mesh.world_size > 1:
                    rec["mem_peak_bytes"] = int(self.comm.max_scalar(rec["mem_peak_bytes"]))
                if self.is_eval_step(step):
                    rec["val_loss"] = result.val_losses[step] = self.evaluate()
                if writer is not None:
                    writer.write(rec)
                result.losses[step] = loss
                recent = (recent + [dt])[-20:]
                bar.update(rec, eta_s=sum(recent) / len(recent) * (cfg.steps - step))
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        finally:
            bar.close()
            if writer is not None:
                writer.close()
        result.final_step = self.step
        if self.pipeline is not None:
            self.write_timeline()
        every = cfg.checkpoint_every
        if not (every and self.step % every == 0 and self.step > start):  # (decided alike
            self.save_checkpoint()  # on every rank: no file-system test)
        return result

    def write_timeline(self) -> None:
        """The last step's measured actions of this rank: ``timeline/rank_NNNN.json``."""
        out = self.run_dir / "timeline"
        out.mkdir(parents=True, exist_ok=True)
        rec = {"rank": self.mesh.rank, "pp_rank": self.mesh.local_rank("pp"),
               "pp": self.mesh.size("pp"), "schedule": self.cfg.parallel.pp_schedule,
               "step_time": self.pipeline.executor.step_time,
               "actions": self.pipeline.executor.timeline}
        (out / f"rank_{self.mesh.rank:04d}.json").write_text(json.dumps(rec))

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        """Every rank samples (sharded weights are gathered collectively); all agree."""
        return generate_text(self.model, self.data.tokenizer, prompt, max_new_tokens,
                             seed=self.cfg.train.seed,
                             forward=lambda ids: full_logits(self.model, self.tp, self.pipeline,
                                                             ids))


def prepare_launch(cfg: Config, log: Log = print) -> None:
    """Checks done once in the launching process: run dir (never overwritten) and data."""
    run_dir = resolve_run_dir(cfg)
    if cfg.run.resume:
        check_resume_compatible(cfg, run_dir)
    build_data(cfg.data, log=log)  # cached now, so workers only read it


def run_worker(cfg: Config) -> TrainResult:
    """Entry point of a locally launched worker (the process group is already initialised)."""
    return train(cfg)


def train(cfg: Config, log: Log = print, progress: bool = True) -> TrainResult:
    """Train with ``cfg``; prints a sample at the end when ``run.sample_tokens`` > 0."""
    if os.environ.get("OMP_NUM_THREADS") is None and torch.get_num_threads() > os.cpu_count():
        torch.set_num_threads(os.cpu_count() or 1)
    trainer = Trainer(cfg, log=log, progress=progress)
    result = trainer.fit()
    log = trainer.log  # rank 0 only
    if result.val_losses:
        first, last = min(result.val_losses), max(result.val_losses)
        log(f"validation loss: {result.val_losses[first]:.4f} (step {first}) -> "
            f"{result.val_losses[last]:.4f} (step {last})")
    log(f"checkpoint: {trainer.run_dir / 'checkpoints' / f'step_{trainer.step:07d}'}")
    if cfg.run.sample_tokens:
        result.sample = trainer.sample(cfg.run.sample_prompt, cfg.run.sample_tokens)
        log("sample:\n" + result.sample)
    return result
