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
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import __version__
from ..checkpoint.state import (
    CheckpointError,
    find_latest,
    load_state,
    restore_rng,
    save_state,
    step_dir,
)
from ..config import Config, ConfigError, load_config, resolve_world, to_toml
from ..data import DataBundle, build_data
from ..data.sampler import StepSampler, val_batches
from ..distributed.comm import Comm, CommLog
from ..distributed.mesh import Mesh, ParallelDims
from ..generate import generate_text
from ..models.llama import Transformer, build_model
from ..parallel import parallelize
from ..parallel.engine import Engine, adamw_template
from ..parallel.pipeline import PipelineExecutor
from ..parallel.tensor import TensorParallel
from .metrics import MetricsWriter, peak_memory_bytes
from .optim import (
    canonical_params,
    lr_at,
    optimizer_state_by_name,
    optimizer_state_from_names,
)
from .peak import peak_flops
from .precision import Precision
from .progress import ProgressLine

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


# ---------------------------------------------------------------------- build steps
def resolve_run_dir(cfg: Config) -> Path:
    """The run directory; refuses to reuse a non-empty one unless resuming."""
    if not cfg.run.dir:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.run.dir = str(Path("runs") / f"{cfg.model.preset}-{stamp}")
    run_dir = Path(cfg.run.dir).expanduser()
    if cfg.run.resume:
        if find_latest(run_dir / "checkpoints") is None:
            raise ConfigError(f"run.resume=true but {run_dir} holds no checkpoint to resume from")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            f"run.dir={str(run_dir)!r} already holds files; pass --run.resume=true to continue "
            "that run or choose another run.dir"
        )
    return run_dir


def check_resume_compatible(cfg: Config, run_dir: Path) -> None:
    """The saved run must have the same model, data order and batch as the new config."""
    saved = load_config(run_dir / "config.toml", check_paths=False)
    for key in ("model", "data"):
        if getattr(saved, key) != getattr(cfg, key):
            raise ConfigError(f"run.resume: [{key}] differs from the saved config of {run_dir}")
    for key in ("seed", "global_batch"):
        if getattr(saved.train, key) != getattr(cfg.train, key):
            raise ConfigError(
                f"run.resume: train.{key}={getattr(cfg.train, key)} differs from the saved "
                f"{getattr(saved.train, key)}"
            )


def build_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
        torch.device("cpu"))


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict[str, Any]:
    return {
        "meshlm": __version__, "git_commit": git_commit(), "torch": torch.__version__,
        "python": platform.python_version(), "host": platform.node(),
        "threads": torch.get_num_threads(), "started": datetime.now().isoformat(timespec="seconds"),
    }


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
        resolve_world(cfg, world)  # infers dp under torchrun/SLURM, re-validates
        p = cfg.parallel
        self.mesh = Mesh(ParallelDims(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep),
                         self.device.type)
        self.comm = Comm(self.mesh, comm_log if comm_log is not None else CommLog())
        self.main = self.mesh.is_logging_rank
        self.log = log if self.main else _quiet
        self.show_progress = progress and self.main
        self.run_dir = self.build_run_dir()
        self.data = self.build_data()
        self.model_cfg = cfg.model_config(vocab_size=self.data.tokenizer.vocab_size)
        self.model: Transformer = build_model(self.model_cfg, cfg.train.seed, self.device)
        self.engine: Engine
        self.tp: TensorParallel | None
        par = parallelize(self.model, self.comm, cfg.parallel, cfg.train)
        self.engine, self.tp, self.pipe = par.engine, par.tp, par.pipe
        self.loss_fn = self.tp.loss if self.tp is not None else cross_entropy
        self.precision = Precision(cfg.precision.dtype, self.device.type)
        self.executor = self.build_pipeline() if self.pipe is not None else None
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
            self.write_run_files()
        self.log_startup()

    # ------------------------------------------------------------------ build steps
    def build_run_dir(self) -> Path:
        """Rank 0 checks the run dir (never overwritten) and tells the others its path.

        (Under torchrun each rank parsed the config itself: a default, time-stamped run.dir
        could differ between ranks, so rank 0's choice is broadcast.)
        """
        error = ""
        if self.main:
            try:
                run_dir = resolve_run_dir(self.cfg)
                if self.cfg.run.resume:
                    check_resume_compatible(self.cfg, run_dir)
            except ConfigError as e:
                error = str(e)
        if self.mesh.distributed:
            box = [self.cfg.run.dir, error]
            dist.broadcast_object_list(box, src=0)
            self.cfg.run.dir, error = box
        if error:
            raise ConfigError(error)
        return Path(self.cfg.run.dir).expanduser()

    def build_data(self) -> DataBundle:
        """Rank 0 builds (or finds) the cached data first; the others then read the cache."""
        if self.main:
            data = build_data(self.cfg.data, log=self.log)
        self.comm.barrier()
        if not self.main:
            data = build_data(self.cfg.data, log=_quiet)
        return data

    def activation_shape(self, batch: int, seq_len: int) -> tuple[int, int, int]:
        """Shape of the activations between pipeline stages (sequence-sharded under SP)."""
        sp = self.tp is not None and self.tp.sp
        return (batch, seq_len // self.tp.size if sp else seq_len, self.model_cfg.dim)

    def build_pipeline(self) -> PipelineExecutor:
        p = self.cfg.parallel
        return PipelineExecutor(
            self.pipe, self.comm, p.pp_schedule, self.cfg.grad_accum, p.pp_virtual,
            self.activation_shape(self.cfg.train.micro_batch, self.cfg.data.seq_len),
            self.loss_fn, self.precision.autocast, self.device)

    # ------------------------------------------------------------------ run files
    def write_run_files(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(self.cfg))
        self.data.tokenizer.save(self.run_dir / "tokenizer.json")
        env = environment() | {"peak_flops": self.peak, "peak_flops_source": self.peak_source,
                               "layout": self.mesh.describe()}
        (self.run_dir / "env.json").write_text(json.dumps(env, indent=1))

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
        if self.executor is not None:
            return self.pipeline_step(step, micro)
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

    def pipeline_step(self, step: int, micro: list) -> tuple[float, float]:
        """One step through the pipeline schedule; gradients reduced after the last micro-batch."""
        self.engine.set_sync(False)
        self.engine.begin_step()
        loss_sum = self.executor.run(micro, self.cfg.data.seq_len)  # last stage only
        self.pipe.sync_tied_grads(self.comm)
        grad_norm = self.optimizer_update(step)
        loss_sum = self.comm.reduce_scalars([loss_sum / len(micro)], "pp")[0]
        loss_sum = self.comm.reduce_scalars([loss_sum], "dp")[0]
        self.pp_bubble = self.comm.reduce_scalars([self.executor.bubble()], "pp")[0] / (
            self.mesh.size("pp"))
        return loss_sum / self.dp_size, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted mean loss over the fixed validation batches (every rank runs all)."""
        self.model.eval()
        total, count = 0.0, 0
        for batch in self.val:
            batch = batch.to(self.device)
            if self.executor is not None:
                loss = self.pipeline_eval_loss(batch)
            else:
                with self.precision.autocast():
                    loss = float(self.loss_fn(self.model(batch[:, :-1]), batch[:, 1:]))
            total += loss * batch.shape[0]
            count += batch.shape[0]
        self.model.train()
        return total / count

    def pipeline_forward(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Last-stage output of a forward-only pass through the pipeline (None elsewhere)."""
        self.engine.begin_step()
        shape = self.activation_shape(ids.shape[0], ids.shape[1])
        out = self.executor.forward_only(ids, shape)
        self.engine.end_forward_only()
        return out

    def pipeline_eval_loss(self, batch: torch.Tensor) -> float:
        out = self.pipeline_forward(batch[:, :-1])
        loss = float(self.loss_fn(out, batch[:, 1:])) if out is not None else 0.0
        return self.comm.reduce_scalars([loss], "pp")[0]

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Gather the layout-free state on every rank; rank 0 writes it."""
        weights, optim = self.engine.full_state()
        if self.tp is not None:
            weights, optim = self.tp.gather_state(self.model, weights, optim)
        if self.pipe is not None:
            weights, optim = self.gather_pipeline_state(weights, optim)
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

    def full_model_names(self) -> Transformer:
        """The whole model on the meta device: names and optimizer order of a one-process run."""
        return build_model(self.model_cfg, device="meta")

    def gather_pipeline_state(self, weights: dict, optim: dict) -> tuple[dict, dict]:
        """Every stage's tensors and AdamW states -> the one-process state (on every rank)."""
        import torch.distributed as tdist

        mine = (weights, optimizer_state_by_name(self.model, optim))
        parts: list = [None] * self.mesh.size("pp")
        tdist.all_gather_object(parts, mine, group=self.mesh.group("pp"))
        full = self.full_model_names()
        all_w, all_s = {}, {}
        for w, st in parts:
            all_w.update(w)
            all_s.update(st)
        names = [n for n, _, _ in canonical_params(full)]
        groups = adamw_template(full, self.cfg.train, optim["param_groups"][0]["lr"])
        return ({n: all_w[n] for n in names},
                optimizer_state_from_names(full, all_s, groups))

    def select_pipeline_state(self, weights: dict, optim: dict) -> tuple[dict, dict]:
        """This rank's stages' part of a one-process state."""
        local = {n for n, _, _ in canonical_params(self.model)}
        by_name = optimizer_state_by_name(self.full_model_names(), optim)
        if "output.weight" in local and "output.weight" not in weights:  # tied: last stage's copy
            weights = dict(weights, **{"output.weight": weights["tok_embeddings.weight"]})
            if "tok_embeddings.weight" in by_name:
                by_name["output.weight"] = by_name["tok_embeddings.weight"]
        groups = adamw_template(self.model, self.cfg.train, self.cfg.train.lr)
        return ({n: t for n, t in weights.items() if n in local},
                optimizer_state_from_names(self.model, by_name, groups))

    def load_checkpoint(self, directory: Path | None) -> None:
        if directory is None:
            raise CheckpointError(f"no checkpoint in {self.run_dir / 'checkpoints'}")
        state = load_state(directory)
        weights, optim = state["weights"], state["optimizer"]
        try:
            if self.pipe is not None:
                weights, optim = self.select_pipeline_state(weights, optim)
            if self.tp is not None:
                weights, optim = self.tp.shard_state(self.model, weights, optim)
            self.engine.load_full_state(weights, optim)
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
            **({"pp_bubble": self.pp_bubble, "pp_peak_live": self.executor.peak_live}
               if self.executor is not None else {}),
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
        if self.executor is not None:
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
               "step_time": self.executor.step_time, "actions": self.executor.timeline}
        (out / f"rank_{self.mesh.rank:04d}.json").write_text(json.dumps(rec))

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        """Every rank samples (sharded weights are gathered collectively); all agree."""
        return generate_text(self.model, self.data.tokenizer, prompt, max_new_tokens,
                             seed=self.cfg.train.seed, forward=self.full_logits)

    def full_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, S, V) logits of the whole vocabulary, whatever the layout."""
        if self.tp is None and self.pipe is None:
            return self.model(ids)
        sp = self.tp is not None and self.tp.sp
        if sp:  # sequence shards need s % tp == 0 within the rotary table
            limit = self.model_cfg.max_seq_len - self.model_cfg.max_seq_len % self.tp.size
            ids = ids[:, -limit:]
        s = ids.shape[1]
        pad = (-s) % self.tp.size if sp else 0
        if pad:  # sequence shards need s % tp == 0; right padding keeps the causal logits
            ids = torch.cat([ids, ids.new_zeros(ids.shape[0], pad)], dim=1)
        if self.pipe is None:
            logits = self.model(ids)
        else:  # the last stage has the logits: broadcast them over the pipeline
            out = self.pipeline_forward(ids)
            v_local = self.model_cfg.vocab_size if self.tp is None else -(
                -self.model_cfg.vocab_size // self.tp.size)
            logits = out.float() if out is not None else torch.empty(
                ids.shape[0], ids.shape[1], v_local, device=self.device)
            self.comm.broadcast(logits, "pp", src=self.mesh.size("pp") - 1)
        if self.tp is not None:
            logits = self.tp.full_logits(logits)
        return logits[:, :s]


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
