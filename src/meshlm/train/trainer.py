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

import ctypes
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.sharded import (
    ShardedCheckpoint,
    check_model,
    island_prefix,
    load_into,
    restore_rng,
    save_checkpoint,
)
from ..checkpoint.state import CheckpointError, latest_valid
from ..config import Config, resolve_world, skip_batches, to_toml
from ..data import DataBundle, build_data, cache_root
from ..data.sampler import StepSampler, val_batches
from ..distributed import faults
from ..distributed.comm import Comm, CommLog
from ..distributed.faults import kill_if_asked, poison_if_asked, slow_if_asked, stop_if_asked
from ..distributed.flight import CollectiveFailure, FlightRecorder, diagnose, is_comm_failure
from ..distributed.mesh import Mesh
from ..distributed.phases import phase, phase_of
from ..distributed.source import InitSource, TensorSource, read_local
from ..distributed.stall import StallMonitor
from ..generate import generate_text
from ..models.llama import Transformer, build_model
from ..optim import lr_at
from ..parallel import parallelize
from ..parallel.compile import compile_loss, compile_stats, configure_cache
from ..parallel.context import context_summary
from ..parallel.diloco import Diloco
from ..parallel.engine import Engine
from ..parallel.expert import moe_layers, router_step, router_summary, router_text
from ..parallel.loss import build_loss
from ..parallel.tensor import TensorParallel
from ..precision import DTYPES, Precision
from .metrics import MetricsWriter, PhasePeaks, read_metrics
from .nonfinite import NonFiniteError, NonFinitePolicy, describe
from .oom import OutOfMemory, is_oom
from .oom import describe as describe_oom
from .peak import peak_flops
from .pipelined import PipelineRunner
from .profiling import region
from .progress import ProgressLine
from .run_dir import (
    agree_run_dir,
    environment,
    resolve_run_dir,
    write_run_files,
)
from .sampling import full_logits
from .stopping import StopSignals
from .stragglers import WARMUP_STEPS, detector_for, wait_clock

Log = Callable[[str], None]


@dataclass
class TrainResult:
    run_dir: Path
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    final_step: int = 0
    sample: str | None = None
    stopped_by: str = ""  # the signal that stopped the run early ("" : it ran to the end)


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
        self.run_dir = agree_run_dir(cfg, self.comm, log=self.log)
        self.flight = self.open_flight()
        self.data = self.build_data()
        self.memory = PhasePeaks(self.device)
        if cfg.train.compile:
            self.compile_cache = configure_cache(cache_root(cfg.data))
        self.build_model()
        self.engine.reduce_dtype = DTYPES[cfg.precision.grad_reduce_dtype]
        self.loss_fn = build_loss(self.model, self.tp, cfg.train.loss, cfg.train.loss_chunk)
        if cfg.train.compile:
            self.loss_fn = compile_loss(self.loss_fn)
        pr = cfg.precision
        self.precision = Precision(pr.dtype, self.device.type, pr.loss_scale,
                                   pr.loss_scale_window)
        self.skipped = False  # whether the last step was skipped (fp16 overflow)
        faults.reset()  # (tests: injected faults fire once per run)
        self.policy = NonFinitePolicy(cfg.train.on_nonfinite, cfg.train.max_skips)
        self.nonfinite = ""  # what was not finite in the last step ("": all finite)
        self.stop = StopSignals()
        self.pipeline = (PipelineRunner(cfg, self.pipe, self.engine, self.tp, self.comm,
                                        self.loss_fn, self.precision, self.device)
                         if self.pipe is not None else None)
        # islands split the global batch like data-parallel ranks: island k's dp ranks read
        # shares k dp ... (k + 1) dp - 1 of dp * islands
        self.dp_size = self.mesh.size("dp") * self.mesh.islands
        self.dp_rank = self.mesh.island * self.mesh.size("dp") + self.mesh.local_rank("dp")
        # per-step agreements run over this rank's island ("world" when there is one)
        self.island_axis = "inner" if self.mesh.islands > 1 else "world"
        # every rank's step and wait times ride on the metrics all-reduce; rank 0 names
        # stragglers (train/stragglers.py), ignoring a compiled run's compiling step too
        self.wait_clock = wait_clock(self.comm, self.device.type, self.log)
        self.stragglers = detector_for(self.mesh, cfg.distributed.straggler_threshold,
                                       cfg.distributed.straggler_steps,
                                       warmup=WARMUP_STEPS + int(cfg.train.compile))
        self.diloco = (Diloco(self.engine, self.comm, cfg.diloco, self.model_cfg.n_layers)
                       if self.mesh.islands > 1 else None)
        # context parallelism: this rank reads and computes only its share of each sequence
        self.cp_positions = (self.cp.positions(cfg.data.seq_len) if self.cp is not None
                             else None)
        self.sampler = StepSampler(
            self.data.train_tokens, cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed
        )
        self.sampler.skip_batches(skip_batches(cfg.train.skip_batches))
        self.val = val_batches(
            self.data.val_tokens, cfg.data.seq_len, cfg.train.eval_batch_size,
            cfg.train.eval_batches
        )
        self.step = 0
        self.router: dict[str, Any] = {}  # the last step's routing per MoE layer
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        self.flops_per_token = self.model_cfg.flops_per_token(cfg.data.seq_len)
        self.resume()
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

    def open_flight(self) -> FlightRecorder | None:
        """This rank's flight recorder in ``run.dir/flight`` (several ranks only)."""
        if self.mesh.world_size == 1:
            return None
        rec = FlightRecorder(self.run_dir / "flight", self.mesh.rank, self.mesh.world_size,
                             self.cfg.distributed.flight_records, self.mesh.coords,
                             self.mesh.group_ranks())
        self.comm.flight = rec
        if not self.comm.completes_on_return:
            # CUDA / NCCL-semantics mode: a collective returning says nothing about completion,
            # and a timeout aborts the process; the stall monitor reads completion from the
            # handles and names a stalled rank before the process group's (doubled) timeout
            timeout = self.comm.collective_timeout_s()
            self.comm.monitor = StallMonitor(rec, self.mesh.world_size, timeout)
            self.mesh.set_timeout(2 * timeout)
        return rec

    def set_collective_timeout(self, seconds: float) -> None:
        """From now on a collective waits ``seconds`` (with a stall monitor: the monitor
        speaks after ``seconds``, the process group gives up after twice as long)."""
        if self.comm.monitor is not None:
            self.comm.monitor.timeout_s = seconds
            seconds *= 2
        self.mesh.set_timeout(seconds)

    def close_comm(self) -> None:
        """Stop the stall monitor and the point-to-point stream (a run's end, or its failure)."""
        if self.comm.monitor is not None:
            self.comm.monitor.close()
            self.comm.monitor = None
        self.comm.close()

    def build_model(self) -> None:
        """Shard-only construction: the model on the meta device, parallelised, then each rank
        materialises only its own shards -- initial values from (seed, name), or the slices
        of ``model.init_from`` (a Hugging Face folder or a meshlm checkpoint)."""
        cfg = self.cfg
        init, vocab = self.open_init_from()
        self.model_cfg = cfg.model_config(vocab_size=vocab)
        self.model: Transformer = build_model(self.model_cfg, device="meta")
        self.param_shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        source: TensorSource = (init if init is not None else
                                InitSource(self.model_cfg, cfg.train.seed, self.param_shapes))
        if isinstance(init, ShardedCheckpoint):
            check_model(init, self.param_shapes)
            source = init.source("weight")
        self.engine: Engine
        self.tp: TensorParallel | None
        par = parallelize(self.model, self.comm, cfg.parallel, cfg.train, source=source,
                          offload_file=self.offload_file())
        self.engine, self.tp, self.pipe, self.cp = par.engine, par.tp, par.pipe, par.cp
        if isinstance(init, ShardedCheckpoint):
            init.close()
        del source, init
        self.memory.measure("construction", self.comm)

    def offload_file(self) -> Path | None:
        """This rank's file of AdamW moments under ``parallel.offload=disk``:
        ``<parallel.offload_dir or run.dir/offload>/rank_NNNNN.adam`` (see parallel/offload.py)."""
        par = self.cfg.parallel
        if par.offload == "cpu" and self.device.type == "cpu":
            self.log("parallel.offload=cpu: the optimizer states live in host memory already "
                     "on a CPU run (the same as none)")
        if par.offload != "disk":
            return None
        folder = Path(par.offload_dir).expanduser() if par.offload_dir else (
            self.run_dir / "offload")
        self.log(f"parallel.offload=disk: AdamW moments in {folder}/rank_*.adam")
        return folder / f"rank_{self.mesh.rank:05d}.adam"

    def open_init_from(self) -> tuple[object | None, int]:
        """(source of ``model.init_from`` or None, vocabulary size of the model)."""
        path, vocab = self.cfg.model.init_from, self.data.tokenizer.vocab_size
        if not path:
            return None, vocab
        from ..checkpoint.loading import is_hf_folder, resolve_checkpoint

        p = Path(path).expanduser()
        if is_hf_folder(p):
            from ..checkpoint.hf import HFSource

            init: object = HFSource(p)
        else:
            init = ShardedCheckpoint(resolve_checkpoint(p))
        size = init.shape("tok_embeddings.weight")[0]
        if vocab > size:
            raise CheckpointError(f"model.init_from={path}: its vocabulary has {size} tokens, "
                                  f"the tokenizer {vocab}")
        return init, size

    def resume(self) -> None:
        """Load the latest valid checkpoint when ``agree_run_dir`` decided to resume (it settles
        ``run.resume`` to "true" or "false" on every rank: auto mode and restarts included)."""
        if self.cfg.run.resume != "true":
            return
        root = self.run_dir / "checkpoints"
        directory = latest_valid(root, log=_quiet)  # (rank 0 already reported damaged ones)
        if directory is None:
            raise CheckpointError(f"run.resume=true: no complete checkpoint in {root}")
        self.load_checkpoint(directory)
        self.memory.measure("load", self.comm)

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
        if self.cp is not None:
            self.log(context_summary(self.cp.mode, self.cp.size, c.data.seq_len))
        if self.diloco is not None:
            self.log(self.diloco.describe())
        elif c.diloco != type(c.diloco)():
            self.log("diloco: parallel.islands=1, so the [diloco] keys have no effect")
        if mc.is_moe:
            ep = self.mesh.size("ep")
            self.log(f"experts: {mc.moe_experts} per MoE layer, top-{mc.moe_topk}, "
                     + (f"{mc.moe_experts // ep} per rank (ep={ep}), " if ep > 1 else "")
                     + f"balance {mc.moe_balance}, "
                     + (f"capacity factor {mc.moe_capacity:g}" if mc.moe_capacity
                        else "dropless"))
        self.log(f"peak {self.peak / 1e9:.1f} GFLOP/s per rank ({self.peak_source})")
        if self.main:  # bf16 on a CPU without native bf16 matmul: a slowdown (train/peak.py)
            from .peak import check_bf16

            if warning := check_bf16(self.device, c.precision.dtype):
                self.log(warning)
        self.log(f"run dir {self.run_dir}" + (f", resuming at step {self.step}" if self.step else ""))
        for name, peaks in self.memory.per_rank.items():
            self.log(f"peak memory at {name}: largest rank {max(peaks) / 2**20:,.0f} MiB "
                     f"(ranks: {', '.join(f'{p / 2**20:,.0f}' for p in peaks)} MiB)")

    def log_compile(self, first_step_s: float) -> dict[str, float]:
        """The start-up log line of ``train.compile`` (after the first step, which compiles)."""
        stats = compile_stats()
        self.log(f"compile: {stats['compile_s']:.1f} s in the first step ({first_step_s:.1f} s), "
                 f"{stats['graphs']:.0f} graphs, {stats['graph_breaks']:.0f} graph breaks, "
                 f"FX graph cache {stats['cache_hits']:.0f} hits / {stats['cache_misses']:.0f} "
                 f"misses ({self.compile_cache})")
        return stats

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> tuple[float, float | None]:
        """Forward + backward over this rank's share of the global batch, reduce, clip, step.

        Returns (global mean loss, global gradient norm; None when fp16 skipped the step).
        """
        cfg = self.cfg.train
        slow_if_asked(step, self.mesh.rank)  # (tests: a straggler)
        micro = self.sampler.rank_micro_batches(step, self.dp_rank, self.dp_size, cfg.micro_batch,
                                                self.cp_positions)
        if self.cp is not None:
            self.cp.reset_tiles()
        n = self.mesh.size("dp_cp")  # each cp rank's loss is the mean over its equal share
        if self.pipeline is not None:
            self.pipeline.executor.grad_scale = (self.precision.scaler.scale
                                                 if self.precision.scaler is not None else 1.0)
            with phase("forward"):  # (the executor marks its backward actions)
                loss = self.pipeline.forward_backward(micro)
            grad_norm = self.optimizer_update(step, loss)
            return self.comm.reduce_scalars([loss], "dp_cp")[0] / n, grad_norm
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro):
            self.engine.set_sync(i == len(micro) - 1)  # DDP communicates on the last only
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            with phase("forward"), self.precision.autocast():
                loss = self.loss_fn(self.model(inputs), targets)
                aux = self.model.aux_loss()
            with phase("backward"):
                self.precision.scale((loss + aux) / len(micro)).backward()
            total += loss.detach()
            stop_if_asked(step, self.mesh.rank)  # (tests: a rank that freezes in a step)
        local = float(total) / len(micro)
        grad_norm = self.optimizer_update(step, local)
        loss_sum = self.comm.reduce_scalars([local], "dp_cp")[0]
        return loss_sum / n, grad_norm

    @phase("optimizer step")
    def optimizer_update(self, step: int, local_loss: float) -> float | None:
        """Reduce gradients, clip by the global norm, AdamW step, clear; returns the norm.

        ``local_loss``: this rank's loss of the step (0 on pipeline stages without the head),
        checked with the norm for ``train.on_nonfinite`` (train/nonfinite.py)."""
        cfg = self.cfg.train
        self.engine.finish_grads()
        grads = self.engine.grad_tensors()
        poison_if_asked(step, self.mesh.rank, grads)  # (tests: an overflow / NaN on one rank)
        # fp16: unscale; an inf/nan on any rank skips the step on every rank
        self.skipped = self.precision.overflow(  # (over the island: islands step alone)
            grads, lambda flag: self.comm.all_reduce(flag, self.island_axis, op="max"))
        grad_norm = None  # (metrics: null when the step changed nothing)
        if not self.skipped:
            grad_norm = self.engine.clip_grad_norm(cfg.grad_clip if cfg.grad_clip > 0
                                                   else float("inf"))
        flags = self.comm.reduce_scalars(NonFinitePolicy.flags(local_loss, grad_norm),
                                         self.island_axis, op="max")
        self.nonfinite = describe(flags)
        if not self.skipped and not self.nonfinite:
            with region("meshlm.optimizer_step"):
                self.engine.step(lr_at(step, cfg))
        self.engine.zero_grad()
        if self.model_cfg.is_moe:  # the step's routing: statistics and the balancing bias
            self.router = router_step(self.model, self.comm, self.model_cfg.n_layers,
                                      self.model_cfg.moe_experts)
        return grad_norm

    @torch.no_grad()
    @phase("evaluation")
    def evaluate(self) -> float:
        """Token-weighted mean loss over the fixed validation batches (every rank runs all;
        under context parallelism each on its share of every sequence)."""
        self.model.eval()
        total, count = 0.0, 0
        for batch in self.val:
            batch = batch.to(self.device)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            if self.cp is not None:
                inputs, targets = self.cp.shard(inputs), self.cp.shard(targets)
            if self.pipeline is not None:
                loss = self.pipeline.eval_loss(inputs, targets)
            else:
                with self.precision.autocast():
                    loss = float(self.loss_fn(self.model(inputs), targets))
            total += loss * batch.shape[0]
            count += batch.shape[0]
        self.engine.end_evaluation()
        self.model.train()
        if self.cp is not None:  # equal shares: the mean of the cp ranks' means
            total = self.comm.reduce_scalars([total], "cp")[0] / self.cp.size
        return total / count

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Every rank writes the shards it owns (no gather); see ``checkpoint.sharded``."""
        state = {"sampler": self.sampler.state_dict(), "model": asdict(self.model_cfg),
                 **({"diloco": self.diloco.state_dict()} if self.diloco is not None else {}),
                 "tokens_seen": self.step * self.tokens_per_step,
                 "layout": self.mesh.describe(), "scaler": self.precision.state_dict(),
                 **({"moe_bias": self.expert_biases()} if self.model_cfg.moe_balance == "bias"
                    and self.model_cfg.is_moe else {})}
        with phase("checkpoint save"):
            directory = save_checkpoint(
                self.run_dir / "checkpoints", self.step, self.engine, self.comm, state,
                {"config.toml": to_toml(self.cfg),
                 "tokenizer.json": self.run_dir / "tokenizer.json"},
                keep=self.cfg.checkpoint.keep,
                outer=self.diloco.outer_pieces() if self.diloco is not None else None)
        self.memory.measure("save", self.comm)
        return directory

    def expert_biases(self) -> list[list[float]]:
        """Every MoE layer's selection bias (zeros for dense layers); the pipeline stages'
        layers summed over pp (one tiny all-reduce), so every rank has them all."""
        mc = self.model_cfg
        table = torch.zeros(mc.n_layers, mc.moe_experts, dtype=torch.float64,
                            device=self.device)
        for i, moe in moe_layers(self.model).items():
            table[i] = moe.expert_bias.double()
        self.comm.all_reduce(table, "pp", purpose="state")
        return table.cpu().tolist()

    def load_checkpoint(self, directory: Path) -> None:
        """This rank's slices of weights and moments, sampler, scaler and RNG states."""
        with phase("checkpoint load"), ShardedCheckpoint(directory) as ckpt:
            if not ckpt.trainer.get("sampler"):
                raise CheckpointError(f"{directory / 'trainer.json'}: no sampler state (a "
                                      "weights-only checkpoint: use it as model.init_from)")
            check_model(ckpt, self.param_shapes)
            if not load_into(ckpt, self.engine, self.device, prefix=island_prefix(self.mesh)):
                self.log(f"checkpoint {directory.name} holds no {' / '.join(self.engine.state_kinds())}"
                         f" for this run (another optimizer, or DiLoCo islands): the optimizer "
                         "state starts fresh")
            if self.diloco is not None:
                self.diloco.load(lambda kind, o: (read_local(ckpt.source(kind), o.spec, o.lo,
                                                             o.hi, self.device)
                                                  if ckpt.holds(kind) else None),
                                 ckpt.trainer.get("diloco"))
            self.sampler.load_state_dict(ckpt.trainer["sampler"])
            self.precision.load_state_dict(ckpt.trainer.get("scaler", {}))
            self.model.set_expert_biases(ckpt.trainer.get("moe_bias"))
            rng = ckpt.rng(self.mesh.rank)
            if rng is not None:
                restore_rng(*rng)
            self.step = int(ckpt.trainer["step"])

    # ------------------------------------------------------------------ loop
    def is_eval_step(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return every > 0 and (step == 1 or step % every == 0 or step == self.cfg.train.steps)

    def is_save_step(self, step: int) -> bool:
        every = self.cfg.train.checkpoint_every
        return bool(every and step % every == 0) or step == self.cfg.train.steps

    def record(self, step: int, loss: float, grad_norm: float, dt: float, wait: float = 0.0
               ) -> dict[str, Any]:
        """The metrics record of ``step``. Collective: with several ranks, one all-reduce of
        6 x world float64 (logged as metrics traffic) gives every rank's step peak, state
        bytes, step time ``dt`` and seconds ``wait`` spent waiting in collectives;
        ``mem_peak_bytes`` is the largest peak, and on evaluation and checkpoint steps (the
        last step is one) the record also lists them per rank for ``meshlm report``. Every
        record lists the step and wait times per rank (rank 0 looks for stragglers in them).
        With islands, "world" is this rank's island (ranks of island 0 in rank 0's record)."""
        tps = self.tokens_per_step / dt
        mem = self.engine.state_bytes()
        world = self.mesh.size(self.island_axis)
        rank = self.mesh.local_rank(self.island_axis)
        table = [0.0] * (6 * world + 1)  # per rank: peak, params, grads, optim, time, wait; stop
        table[6 * rank: 6 * rank + 6] = [float(self.memory.measure("steps")), mem["params"],
                                         mem["grads"], mem["optim"], dt, wait]
        table[-1] = float(self.stop.requested)
        if world > 1:
            table = self.comm.reduce_scalars(table, self.island_axis)
        self.stop_agreed = table[-1] > 0  # some rank was asked to stop: all stop here
        table = table[:-1]
        per_rank = [[int(x) for x in table[i::6]] for i in range(4)]
        return {
            "step": step, "loss": loss, "lr": lr_at(step, self.cfg.train), "grad_norm": grad_norm,
            "tokens_per_s": tps, "mfu": tps * self.flops_per_token / (self.peak * self.mesh.world_size),
            "step_time_s": dt, "mem_peak_bytes": max(per_rank[0]),
            "tokens_seen": step * self.tokens_per_step,
            "params_bytes": mem["params"], "grads_bytes": mem["grads"], "optim_bytes": mem["optim"],
            **({"mem_peak_per_rank": per_rank[0], "params_bytes_per_rank": per_rank[1],
                "grads_bytes_per_rank": per_rank[2], "optim_bytes_per_rank": per_rank[3]}
               if self.is_eval_step(step) or self.is_save_step(step) else {}),
            "comm_bytes": self.comm.log.bytes_by_op(),
            **({"loss_scale": self.precision.scaler.scale, "skipped": self.skipped,
                "skipped_steps": self.precision.scaler.skipped}
               if self.precision.scaler is not None else {}),
            **({"pp_bubble": self.pipeline.bubble,
                "pp_peak_live": self.pipeline.executor.peak_live}
               if self.pipeline is not None else {}),
            **(self.cp_record() if self.cp is not None else {}),
            **({"router": self.router} if self.router else {}),
            **({"nonfinite": self.nonfinite} if self.nonfinite else {}),
            **({"nonfinite_skips": self.policy.skips, "rollbacks": self.policy.rollbacks}
               if self.policy.skips else {}),
            **self.straggler_record(step, table[4::6], table[5::6]),
        }

    def straggler_record(self, step: int, times: list[float], waits: list[float]
                         ) -> dict[str, Any]:
        """Every rank's step and wait times (seconds, island order) for the record; rank 0
        logs what its straggler detector decides and adds the slowest named rank."""
        rec: dict[str, Any] = {"step_time_per_rank": [round(t, 6) for t in times],
                               "wait_time_per_rank": [round(w, 6) for w in waits]}
        if self.stragglers is None:
            return rec
        for line in self.stragglers.update(step, times, waits):
            self.log(line)
        if (worst := self.stragglers.current) is not None:
            rec["straggler"] = worst.record()
        return rec

    def outer_sync(self, step: int, loss: float) -> dict[str, Any]:
        """DiLoCo: the outer step of the fragments due after ``step`` (parallel/diloco.py).
        A stop request waits for the next synchronisation, where every island agrees on it."""
        self.diloco.note_loss(loss)
        due = self.diloco.due(step, self.cfg.train.steps)
        if not due:
            self.stop_agreed = False
            return {"island_bytes_total": self.diloco.bytes_total}
        with region("meshlm.outer_step"):
            rec = self.diloco.sync(step, due, self.stop_agreed)
        self.stop_agreed = rec.pop("_stop")
        rec["comm_bytes"] = self.comm.log.bytes_by_op()  # the step's, with the synchronisation
        return rec

    def cp_record(self) -> dict[str, Any]:
        """The cp mode and, for the ring modes, the attention tiles (c x c, c = s / (2 cp))
        each cp rank of this pipeline stage computed this step, in cp-rank order."""
        rec: dict[str, Any] = {"cp_attention": self.cp.mode}
        if self.cp.mode != "ulysses":
            tiles = [0.0] * self.cp.size
            tiles[self.cp.rank] = float(self.cp.tiles())
            rec["cp_tiles_per_rank"] = [int(t) for t in self.comm.reduce_scalars(tiles, "cp")]
        return rec

    def fit(self) -> TrainResult:
        from ..config import profile_steps
        from .profiling import StepProfiler, describe_traces

        cfg = self.cfg.train
        result = TrainResult(self.run_dir, final_step=self.step)
        start = self.step
        writer = (MetricsWriter(self.run_dir, self.cfg.run.tensorboard, keep_until=self.step)
                  if self.main else None)
        bar = ProgressLine(cfg.steps, self.step, cfg.log_every, self.show_progress)
        recent: list[float] = []
        window = profile_steps(self.cfg.profile.steps)  # torch.profiler traces of these steps
        profiler = StepProfiler(window, self.run_dir / "profile", self.mesh.rank, self.device,
                                self.model.layers)
        try:
            with self.stop:
                step = self.step
                while step < cfg.steps:
                    step += 1
                    profiler.start_step(step)
                    self.comm.log.reset()
                    self.wait_clock.start()
                    t0 = time.perf_counter()
                    loss, grad_norm = self.train_step(step)
                    dt = time.perf_counter() - t0
                    wait = self.wait_clock.stop()
                    self.step = step
                    if step == start + 1:  # start-up is over: the shorter collective timeout
                        self.set_collective_timeout(self.cfg.distributed.timeout_s)
                    kill_if_asked("MESHLM_FAULT_KILL_AT_STEP", step, self.mesh.rank,
                                  self.mesh.world_size)  # (tests)
                    if self.nonfinite and self.policy.on_event(step, self.nonfinite) == "rollback":
                        self.rollback(step, result, writer)
                        step = self.step
                        profiler.end_step(step)
                        continue
                    if self.nonfinite:
                        self.log(f"step {step}: {self.nonfinite}; skipped (train.on_nonfinite="
                                 f"skip, {self.policy.skips} so far)")
                    else:
                        self.policy.finite(step)
                    rec = self.record(step, loss, grad_norm, dt, wait)  # (agrees on stop)
                    if self.diloco is not None:  # islands meet: outer step, stop agreed by all
                        rec.update(self.outer_sync(step, loss))
                    if step == start + 1:  # this process's start-up peaks, once
                        rec.update({f"mem_{k}_bytes": v for k, v in self.memory.phases.items()
                                    if k != "steps"})
                        if cfg.compile:
                            rec["compile"] = self.log_compile(dt)
                    if self.is_eval_step(step) and not self.stop_agreed:
                        rec["val_loss"] = result.val_losses[step] = self.evaluate()
                    if self.is_save_step(step) or self.stop_agreed:
                        with region("meshlm.checkpoint_save"):
                            self.save_checkpoint()
                        rec["mem_save_bytes"] = self.memory.phases["save"]
                    if writer is not None:
                        writer.write(rec)
                    result.losses[step] = loss
                    if not (cfg.compile and step == start + 1):  # (compiling is not a step)
                        recent = (recent + [dt])[-20:]
                    bar.update(rec, eta_s=(sum(recent) / len(recent) if recent else dt) * (cfg.steps - step))
                    profiler.end_step(step)
                    if self.stop_agreed and step < cfg.steps:
                        result.stopped_by = self.stop.name or "a stop request to another rank"
                        self.log(f"stopped by {result.stopped_by} after step {step}; "
                                 "the checkpoint of that step is complete")
                        break
        finally:
            profiler.close()
            bar.close()
            if writer is not None:
                writer.close()
        if profiler.files:
            self.log(describe_traces(self.run_dir / "profile", window, self.mesh.world_size,
                                     self.device.type == "cuda"))
        elif window:
            self.log(f"profile: no step of profile.steps={self.cfg.profile.steps} ran "
                     f"(this run did steps {start + 1}-{self.step}); nothing traced")
        result.final_step = self.step
        if self.pipeline is not None:
            self.write_timeline()
        return result

    def rollback(self, step: int, result: TrainResult, writer: MetricsWriter | None) -> None:
        """``train.on_nonfinite=rollback``: reload the latest complete checkpoint and skip the
        batch of ``step`` from now on (every rank, as they agreed on the non-finite step)."""
        directory = latest_valid(self.run_dir / "checkpoints", log=_quiet)
        if directory is None:
            raise NonFiniteError(
                f"step {step}: {self.nonfinite}; train.on_nonfinite=rollback has no checkpoint "
                "to return to (none saved yet: set train.checkpoint_every)")
        bad, skip = self.sampler.batch_of(step), list(self.sampler.skip)
        self.load_checkpoint(directory)
        self.sampler.skip_batches([*skip, bad])
        for table in (result.losses, result.val_losses):
            for k in [k for k in table if k > self.step]:
                del table[k]
        if writer is not None:
            writer.rewind(self.step)
        self.log(f"step {step}: {self.nonfinite}; rolled back to step {self.step} "
                 f"({directory.name}); batch {bad} is skipped from now on "
                 f"(train.on_nonfinite=rollback, {self.policy.rollbacks} so far)")

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
        """Every rank samples (sharded weights are gathered collectively); all agree. Under
        context parallelism every cp rank runs the whole context alone (weights are whole)."""
        # (logits_out: a chunked loss makes forwards stop at the head)
        with phase("sampling"), self.model.logits_out():
            if self.cp is not None:
                with self.cp.disabled():
                    return self._sample(prompt, max_new_tokens)
            return self._sample(prompt, max_new_tokens)

    def _sample(self, prompt: str, max_new_tokens: int) -> str:
        return generate_text(self.model, self.data.tokenizer, prompt, max_new_tokens,
                             seed=self.cfg.train.seed,
                             forward=lambda ids: full_logits(self.model, self.tp, self.pipeline,
                                                             ids))


def prepare_launch(cfg: Config, log: Log = print) -> None:
    """Checks done once in the launching process: run dir (never overwritten) and data."""
    resolve_run_dir(cfg, log=log)  # (with the resume checks)
    build_data(cfg.data, log=log)  # cached now, so workers only read it


def run_worker(cfg: Config) -> TrainResult:
    """Entry point of a locally launched worker (the process group is already initialised)."""
    return train(cfg)


def _libc() -> ctypes.CDLL | None:
    """glibc, or None on another platform or C library (the malloc policies are then no-ops)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # another C library
        return None


def pin_malloc_mmap_threshold(nbytes: int = 128 * 1024) -> None:
    """Fix glibc's mmap threshold at ``nbytes`` (no-op off glibc); ``run.malloc_mmap_kb``.

    By default glibc raises the threshold after each large free (up to 32 MiB), so per-layer
    buffers -- ZeRO-3's gathered parameters and gradient flats, activations -- come from the
    brk heap, whose holes are never returned: the peak RSS then grows step after step (dp=4
    ZeRO-3, 81 M parameters: 1,824 -> 2,210 MiB over 8 steps, live tensors flat). Fixed, every
    buffer above ``nbytes`` is mmapped and returned on free: the peak is flat from step 2.
    The price is a page fault per page of every such buffer, every time it is allocated: the
    ``small`` preset's fp32 step on one CPU process takes ~1.6x as long (0.72 vs 0.45 s at
    batch 8 x 256), so runs pin it only when asked (memory tests and benchmarks do).
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD (also ends the dynamic adjustment)


def keep_freed_memory() -> None:
    """Keep freed buffers in the process (no-op off glibc); ``run.malloc_keep``.

    Even glibc's own policy mmaps every buffer of 32 MiB or more (the ``small`` preset's
    logits and their gradient at batch 8 x 256) and trims the top of the heap, so each step
    faults those pages in afresh. With the mmap threshold at 1 GiB and trimming off, a step
    reuses the pages of the last: ``small``'s eager steps at batch 8 x 256 run ~10 % faster
    (docs/benchmarks.md), compiled ones (fewer such buffers) about as fast. Peak RSS is then
    the high-water mark of the heap, freed memory included (``make train``: 730 vs 609 MiB),
    so it is off by default.
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD: never give the heap's top back


def _first_line(exc: BaseException, limit: int = 160) -> str:
    line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)  # gloo's "[.../unbound_buffer.cc:78] "
    return line if len(line) <= limit else line[:limit - 3] + "..."


def train(cfg: Config, log: Log = print, progress: bool = True) -> TrainResult:
    """Train with ``cfg``; prints a sample at the end when ``run.sample_tokens`` > 0."""
    if cfg.run.malloc_mmap_kb:
        pin_malloc_mmap_threshold(cfg.run.malloc_mmap_kb * 1024)
    if cfg.run.malloc_keep:
        keep_freed_memory()
    if os.environ.get("OMP_NUM_THREADS") is None and torch.get_num_threads() > os.cpu_count():
        torch.set_num_threads(os.cpu_count() or 1)
    try:
        with phase("construction"):
            trainer = Trainer(cfg, log=log, progress=progress)
        return _fit(trainer, cfg)
    except Exception as exc:
        if not is_oom(exc):
            raise
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # (the planner's arithmetic runs on this process's CPU; the device is full)
        raise OutOfMemory(describe_oom(cfg, rank, phase_of(exc), exc, build_device())) from None


def _fit(trainer: Trainer, cfg: Config) -> TrainResult:
    try:
        result = trainer.fit()
    except Exception as exc:
        if trainer.flight is None or not is_comm_failure(exc):
            raise
        # a peer froze or died: name it from every rank's flight records (distributed/flight.py)
        trainer.flight.dump(f"{type(exc).__name__}: {exc}")
        raise CollectiveFailure(
            f"rank {trainer.mesh.rank} gave up on a collective ({_first_line(exc)}); "
            + diagnose(trainer.flight.folder, trainer.mesh.world_size)) from exc
    finally:
        trainer.close_comm()
    log = trainer.log  # rank 0 only
    if result.val_losses:
        first, last = min(result.val_losses), max(result.val_losses)
        log(f"validation loss: {result.val_losses[first]:.4f} (step {first}) -> "
            f"{result.val_losses[last]:.4f} (step {last})")
    log(f"checkpoint: {trainer.run_dir / 'checkpoints' / f'step_{trainer.step:07d}'}")
    if trainer.main and trainer.model_cfg.is_moe and (trainer.run_dir / "metrics.jsonl").exists():
        summary = router_summary(read_metrics(trainer.run_dir / "metrics.jsonl"))
        if summary:
            log("router:\n" + router_text(summary))
    if cfg.run.sample_tokens and not result.stopped_by:
        result.sample = trainer.sample(cfg.run.sample_prompt, cfg.run.sample_tokens)
        log("sample:\n" + result.sample)
    return result
