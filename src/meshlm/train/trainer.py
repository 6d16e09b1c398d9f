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
import torch.nn.functional as F

from .. import __version__
from ..checkpoint.state import CheckpointError, find_latest, load_state, save_state, step_dir
from ..config import Config, ConfigError, load_config, to_toml
from ..data import DataBundle, build_data
from ..data.sampler import StepSampler, val_batches
from ..generate import generate_text
from ..models.llama import Transformer, build_model
from .metrics import MetricsWriter, peak_memory_bytes
from .optim import build_optimizer, lr_at, set_lr
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
class Trainer:
    """Single-process trainer; parallel layouts plug in through the model and the step."""

    def __init__(self, cfg: Config, log: Log = print, progress: bool = True) -> None:
        self.cfg, self.log, self.show_progress = cfg, log, progress
        self.run_dir = resolve_run_dir(cfg)
        if cfg.run.resume:
            check_resume_compatible(cfg, self.run_dir)
        self.device = build_device()
        self.data: DataBundle = build_data(cfg.data, log=log)
        self.model_cfg = cfg.model_config(vocab_size=self.data.tokenizer.vocab_size)
        self.model: Transformer = build_model(self.model_cfg, cfg.train.seed, self.device)
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.precision = Precision(cfg.precision.dtype, self.device.type)
        self.sampler = StepSampler(
            self.data.train_tokens, cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed
        )
        self.val = val_batches(
            self.data.val_tokens, cfg.data.seq_len, cfg.train.micro_batch, cfg.train.eval_batches
        )
        self.step = 0
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        self.flops_per_token = self.model_cfg.flops_per_token(cfg.data.seq_len)
        if cfg.run.resume:
            self.load_checkpoint(find_latest(self.run_dir / "checkpoints"))
        self.peak, self.peak_source = peak_flops(
            self.device, cfg.precision.dtype, cfg.train.peak_flops
        )
        self.write_run_files()
        self.log_startup()

    # ------------------------------------------------------------------ run files
    def write_run_files(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(self.cfg))
        self.data.tokenizer.save(self.run_dir / "tokenizer.json")
        env = environment() | {"peak_flops": self.peak, "peak_flops_source": self.peak_source}
        (self.run_dir / "env.json").write_text(json.dumps(env, indent=1))

    def log_startup(self) -> None:
        mc, c = self.model_cfg, self.cfg
        env = environment()
        self.log(f"meshlm {env['meshlm']} (git {env['git_commit']}), torch {env['torch']}, "
                 f"{self.device.type} x{env['threads']} thread(s)")
        self.log(f"layout: world 1 (pp=1 dp=1 cp=1 tp=1), precision {c.precision.dtype}")
        self.log(f"model {c.model.preset}: {mc.num_params() / 1e6:.2f} M parameters, "
                 f"{self.flops_per_token / 1e6:.1f} MFLOP/token at seq {c.data.seq_len}")
        self.log(f"batch: {c.train.global_batch} x {c.data.seq_len} tokens/step, "
                 f"micro-batch {c.train.micro_batch}, accumulation {c.grad_accum}")
        self.log(f"peak {self.peak / 1e9:.1f} GFLOP/s per rank ({self.peak_source})")
        self.log(f"run dir {self.run_dir}" + (f", resuming at step {self.step}" if self.step else ""))

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> tuple[float, float]:
        """Forward + backward over the global batch, clip, AdamW step. Returns (loss, grad norm)."""
        cfg = self.cfg.train
        micro = self.sampler.rank_micro_batches(step, 0, 1, cfg.micro_batch)
        total = torch.zeros((), device=self.device)
        for inputs, targets in micro:
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            with self.precision.autocast():
                loss = cross_entropy(self.model(inputs), targets)
                aux = self.model.aux_loss()
            self.precision.scale((loss + aux) / len(micro)).backward()
            total += loss.detach()
        self.precision.unscale_(self.optimizer)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        set_lr(self.optimizer, lr_at(step, cfg))
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return float(total) / len(micro), float(grad_norm)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        for batch in self.val:
            batch = batch.to(self.device)
            with self.precision.autocast():
                losses.append(float(cross_entropy(self.model(batch[:, :-1]), batch[:, 1:])))
        self.model.train()
        return sum(losses) / len(losses)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        state = {"step": self.step, "sampler": self.sampler.state_dict(),
                 "tokens_seen": self.step * self.tokens_per_step}
        return save_state(
            step_dir(self.run_dir / "checkpoints", self.step), self.model, self.optimizer, state,
            {"config.toml": to_toml(self.cfg), "tokenizer.json": self.run_dir / "tokenizer.json"},
            self.precision.state_dict(),
        )

    def load_checkpoint(self, directory: Path | None) -> None:
        if directory is None:
            raise CheckpointError(f"no checkpoint in {self.run_dir / 'checkpoints'}")
        state, scaler = load_state(directory, self.model, self.optimizer)
        self.sampler.load_state_dict(state["sampler"])
        self.precision.load_state_dict(scaler)
        self.step = int(state["step"])

    # ------------------------------------------------------------------ loop
    def is_eval_step(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return every > 0 and (step == 1 or step % every == 0 or step == self.cfg.train.steps)

    def record(self, step: int, loss: float, grad_norm: float, dt: float) -> dict[str, Any]:
        tps = self.tokens_per_step / dt
        return {
            "step": step, "loss": loss, "lr": lr_at(step, self.cfg.train), "grad_norm": grad_norm,
            "tokens_per_s": tps, "mfu": tps * self.flops_per_token / self.peak,
            "step_time_s": dt, "mem_peak_bytes": peak_memory_bytes(self.device),
            "tokens_seen": step * self.tokens_per_step,
        }

    def fit(self) -> TrainResult:
        cfg = self.cfg.train
        result = TrainResult(self.run_dir, final_step=self.step)
        writer = MetricsWriter(self.run_dir, self.cfg.run.tensorboard, keep_until=self.step)
        bar = ProgressLine(cfg.steps, self.step, cfg.log_every, self.show_progress)
        recent: list[float] = []
        try:
            for step in range(self.step + 1, cfg.steps + 1):
                t0 = time.perf_counter()
                loss, grad_norm = self.train_step(step)
                dt = time.perf_counter() - t0
                self.step = step
                rec = self.record(step, loss, grad_norm, dt)
                if self.is_eval_step(step):
                    rec["val_loss"] = result.val_losses[step] = self.evaluate()
                writer.write(rec)
                result.losses[step] = loss
                recent = (recent + [dt])[-20:]
                bar.update(rec, eta_s=sum(recent) / len(recent) * (cfg.steps - step))
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        finally:
            bar.close()
            writer.close()
        result.final_step = self.step
        if not (self.run_dir / "checkpoints" / f"step_{self.step:07d}").exists():
            self.save_checkpoint()
        return result

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        return generate_text(self.model, self.data.tokenizer, prompt, max_new_tokens,
                             seed=self.cfg.train.seed)


def train(cfg: Config, log: Log = print, progress: bool = True) -> TrainResult:
    """Train with ``cfg``; prints a sample at the end when ``run.sample_tokens`` > 0."""
    if os.environ.get("OMP_NUM_THREADS") is None and torch.get_num_threads() > os.cpu_count():
        torch.set_num_threads(os.cpu_count() or 1)
    trainer = Trainer(cfg, log=log, progress=progress)
    result = trainer.fit()
    if result.val_losses:
        first, last = min(result.val_losses), max(result.val_losses)
        log(f"validation loss: {result.val_losses[first]:.4f} (step {first}) -> "
            f"{result.val_losses[last]:.4f} (step {last})")
    log(f"checkpoint: {trainer.run_dir / 'checkpoints' / f'step_{trainer.step:07d}'}")
    if cfg.run.sample_tokens:
        result.sample = trainer.sample(cfg.run.sample_prompt, cfg.run.sample_tokens)
        log("sample:\n" + result.sample)
    return result
