"""The checkpoint part: save, load, resume and roll back this rank's shards and the run's state.

Every rank writes and reads only the slices it owns (checkpoint/sharded.py): weights and
optimizer moments, DiLoCo's outer state with islands, and with them ``trainer.json`` (step,
sampler, model shape, layout, loss scale, MoE selection biases) and this rank's RNG states.
With ``checkpoint.async`` the shards are copied to host memory at the save and written by a
background thread while training goes on (checkpoint/async_save.py); a graceful stop, the end
of training and a rollback wait for the save in flight (:meth:`Checkpointer.wait`).

Communication: the checkpoint's agreement collectives (async: on the writer's own gloo group),
one tiny all-reduce over pp of the MoE biases (bias balancing only) and one all-gather of each
rank's peak memory per save or load (async: at the first save, one more of each rank's host
copy); memory: one slice in flight at a time (async: the rank's shards in host memory).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from ...checkpoint.async_save import AsyncSaver
from ...checkpoint.sharded import (
    ShardedCheckpoint,
    check_model,
    island_prefix,
    latest_valid,
    load_into,
    restore_rng,
    save_checkpoint,
)
from ...checkpoint.state import CheckpointError
from ...config import CheckpointSection, RunSection
from ...distributed.comm import Comm
from ...distributed.phases import phase
from ...parallel.expert import moe_layers
from ..metrics import PhasePeaks
from ..nonfinite import NonFiniteError
from ..profiling import region
from .batches import Batches
from .islands import Islands
from .model import ModelPart
from .optimizer import OptimizerUpdate

Log = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


class Checkpointer:
    """``run.dir/checkpoints/step_NNNNNNN``: written at ``train.checkpoint_every`` steps and
    the last one (``checkpoint.keep`` kept), read to resume or to roll back."""

    SECTION = "checkpoint"

    def __init__(self, section: CheckpointSection, run: RunSection,
                 config_toml: Callable[[], str], run_dir: Path, model: ModelPart,
                 batches: Batches, optimizer: OptimizerUpdate, islands: Islands, comm: Comm,
                 memory: PhasePeaks, log: Log) -> None:
        self.section, self.run, self.config_toml = section, run, config_toml
        self.root, self.run_dir = run_dir / "checkpoints", run_dir
        self.model, self.batches, self.optimizer, self.islands = model, batches, optimizer, islands
        self.comm, self.mesh, self.memory, self.log = comm, comm.mesh, memory, log
        self.tokens_per_step = batches.tokens_per_step
        self.saver = (AsyncSaver(self.mesh, comm.collective_timeout_s() if self.mesh.distributed
                                 else 0.0) if section.async_save else None)
        self.stall_s = 0.0  # the step loop's time in the last save (async: copy + waits)
        self.host_bytes_per_rank: list[int] = []  # async: each rank's host copy

    def save(self, step: int) -> Path:
        """Every rank writes the shards it owns (no gather); see ``checkpoint.sharded``. With
        ``checkpoint.async`` the writing goes on after this returns (see :meth:`wait`)."""
        t0 = time.perf_counter()
        with region("meshlm.checkpoint_save"):
            mc = self.model.model_cfg
            state = {"sampler": self.batches.sampler.state_dict(), "model": asdict(mc),
                     **self.islands.state(),
                     "tokens_seen": step * self.tokens_per_step,
                     "layout": self.mesh.describe(),
                     "scaler": self.optimizer.precision.state_dict(),
                     **({"moe_bias": self.expert_biases()} if mc.moe_balance == "bias"
                        and mc.is_moe else {})}
            files: dict[str, Path | str] = {"config.toml": self.config_toml(),
                                            "tokenizer.json": self.run_dir / "tokenizer.json"}
            with phase("checkpoint save"):
                if self.saver is not None:
                    directory = self.saver.save(self.root, step, self.model.engine, state,
                                                files, self.section.keep,
                                                self.islands.outer_pieces())
                else:
                    directory = save_checkpoint(
                        self.root, step, self.model.engine, self.comm, state, files,
                        keep=self.section.keep, outer=self.islands.outer_pieces())
            self.stall_s = time.perf_counter() - t0
            self.memory.measure("save", self.comm)
            if self.saver is not None and not self.host_bytes_per_rank:
                self.log_host_copy()
        return directory

    def wait(self) -> None:
        """Block until the save in flight (``checkpoint.async``) is complete on every rank;
        nothing to do for synchronous saves."""
        if self.saver is not None:
            with phase("checkpoint save"):
                self.saver.wait()

    def record(self) -> dict[str, float | int]:
        """The last save's fields of the step's metrics record."""
        rec: dict[str, float | int] = {"ckpt_stall_s": round(self.stall_s, 6)}
        if self.host_bytes_per_rank:
            rec["mem_ckpt_host_bytes"] = max(self.host_bytes_per_rank)
        return rec

    def log_host_copy(self) -> None:
        """``checkpoint.async``: each rank's host copy (one all-gather), logged once."""
        mine = torch.tensor([float(self.saver.host_bytes if self.saver else 0)],
                            dtype=torch.float64, device=self.mesh.device())
        every = torch.empty(self.mesh.world_size, dtype=torch.float64, device=mine.device)
        self.comm.all_gather(every, mine, "world")
        self.host_bytes_per_rank = [int(x) for x in every.tolist()]
        sizes = self.host_bytes_per_rank
        self.log(f"checkpoint.async: host copy of the shards: largest rank "
                 f"{max(sizes) / 2**20:,.0f} MiB (ranks: "
                 f"{', '.join(f'{b / 2**20:,.0f}' for b in sizes)} MiB), kept between saves")

    def expert_biases(self) -> list[list[float]]:
        """Every MoE layer's selection bias (zeros for dense layers); the pipeline stages'
        layers summed over pp (one tiny all-reduce), so every rank has them all."""
        mc = self.model.model_cfg
        table = torch.zeros(mc.n_layers, mc.moe_experts, dtype=torch.float64,
                            device=self.model.device)
        for i, moe in moe_layers(self.model.model).items():
            table[i] = moe.expert_bias.double()
        self.comm.all_reduce(table, "pp", purpose="state")
        return table.cpu().tolist()

    def load(self, directory: Path) -> int:
        """This rank's slices of weights and moments, sampler, scaler and RNG states; returns
        the checkpoint's step."""
        engine, device = self.model.engine, self.model.device
        with phase("checkpoint load"), ShardedCheckpoint(directory) as ckpt:
            if not ckpt.trainer.get("sampler"):
                raise CheckpointError(f"{directory / 'trainer.json'}: no sampler state (a "
                                      "weights-only checkpoint: use it as model.init_from)")
            check_model(ckpt, self.model.param_shapes)
            if not load_into(ckpt, engine, device, prefix=island_prefix(self.mesh)):
                self.log(f"checkpoint {directory.name} holds no {' / '.join(engine.state_kinds())}"
                         f" for this run (another optimizer, or DiLoCo islands): the optimizer "
                         "state starts fresh")
            self.islands.load(ckpt, device)
            self.batches.sampler.load_state_dict(ckpt.trainer["sampler"])
            self.optimizer.precision.load_state_dict(ckpt.trainer.get("scaler", {}))
            self.model.model.set_expert_biases(ckpt.trainer.get("moe_bias"))
            rng = ckpt.rng(self.mesh.rank)
            if rng is not None:
                restore_rng(*rng)
            return int(ckpt.trainer["step"])

    def resume(self) -> int | None:
        """The step of the latest valid checkpoint, loaded, when ``agree_run_dir`` decided to
        resume (it settles ``run.resume`` to "true" or "false" on every rank: auto mode and
        restarts included); None when the run starts fresh."""
        if self.run.resume != "true":
            return None
        directory = latest_valid(self.root, log=_quiet)  # (rank 0 already reported damaged ones)
        if directory is None:
            raise CheckpointError(f"run.resume=true: no complete checkpoint in {self.root}")
        step = self.load(directory)
        self.memory.measure("load", self.comm)
        return step

    def rollback(self, step: int, what: str) -> tuple[int, str]:
        """``train.on_nonfinite=rollback``: reload the latest complete checkpoint and skip the
        batch of ``step`` from now on (every rank, as they agreed on the non-finite step).
        Returns the checkpoint's step and what was done, in words."""
        self.wait()  # (a save in flight is the latest once complete)
        directory = latest_valid(self.root, log=_quiet)
        if directory is None:
            raise NonFiniteError(
                f"step {step}: {what}; train.on_nonfinite=rollback has no checkpoint "
                "to return to (none saved yet: set train.checkpoint_every)")
        sampler = self.batches.sampler
        bad, skip = sampler.batch_of(step), list(sampler.skip)
        back = self.load(directory)
        sampler.skip_batches([*skip, bad])
        return back, (f"rolled back to step {back} ({directory.name}); batch {bad} is skipped "
                      "from now on")
