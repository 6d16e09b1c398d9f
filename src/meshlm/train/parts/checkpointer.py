"""The checkpoint part: save, load, resume and roll back the run's named stateful parts.

The checkpointer is given ``{name: part}`` (:class:`~meshlm.train.parts.Stateful`) and knows
none of them: a save gathers every part's entries of ``trainer.json`` (with the step and the
layout) and the tensors the parts give (:class:`~meshlm.train.parts.Shards`: the engine's
weights and moments, DiLoCo's outer state); every rank writes only the slices it owns, with its
RNG states (checkpoint/sharded.py). A load hands every part, in order, the checkpoint to
restore itself from, then restores this rank's RNG states. With ``checkpoint.async`` the shards
are copied to host memory at the save and written by a background thread while training goes
on (checkpoint/async_save.py); a graceful stop, the end of training and a rollback wait for the
save in flight (:meth:`Checkpointer.wait`).

Communication: the checkpoint's agreement collectives (async: on the writer's own gloo group),
the parts' own in ``state_dict`` (MoE biases over pp, DiLoCo's round loss over islands) and one
all-gather of each rank's peak memory per save or load (async: at the first save, one more of
each rank's host copy); memory: one slice in flight at a time (async: the rank's shards in host
memory).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ...checkpoint.async_save import AsyncSaver
from ...checkpoint.sharded import ShardedCheckpoint, latest_valid, restore_rng, save_checkpoint
from ...checkpoint.state import CheckpointError
from ...config import CheckpointSection, RunSection
from ...distributed.comm import Comm
from ...distributed.phases import phase
from ...parallel.engine import Engine
from ..metrics import PhasePeaks
from ..nonfinite import NonFiniteError
from ..profiling import region
from . import Shards, Stateful

Log = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


class Checkpointer:
    """``run.dir/checkpoints/step_NNNNNNN``: written at ``train.checkpoint_every`` steps and
    the last one (``checkpoint.keep`` kept), read to resume or to roll back."""

    SECTION = "checkpoint"

    def __init__(self, section: CheckpointSection, run: RunSection,
                 config_toml: Callable[[], str], run_dir: Path, states: Mapping[str, Stateful],
                 comm: Comm, memory: PhasePeaks, log: Log) -> None:
        self.section, self.run, self.config_toml = section, run, config_toml
        self.root, self.run_dir = run_dir / "checkpoints", run_dir
        self.states = dict(states)  # saved in this order, and restored in it
        self.comm, self.mesh, self.memory, self.log = comm, comm.mesh, memory, log
        self.saver = (AsyncSaver(self.mesh, comm.collective_timeout_s() if self.mesh.distributed
                                 else 0.0) if section.async_save else None)
        self.stall_s = 0.0  # the step loop's time in the last save (async: copy + waits)
        self.host_bytes_per_rank: list[int] = []  # async: each rank's host copy

    def state_dict(self) -> dict[str, Any]:
        """``trainer.json`` but the step: the layout and every part's entries (collective:
        every rank asks the parts in the same order). Two parts never share a key."""
        state: dict[str, Any] = {"layout": self.mesh.describe()}
        owner = dict.fromkeys([*state, "step", "adam_step"], "the checkpointer")  # (the save's)
        for name, part in self.states.items():
            for key, value in part.state_dict().items():
                if key in owner:
                    raise ValueError(f"trainer.json key {key!r}: given by part {name!r} and by "
                                     f"{owner[key]}")
                owner[key], state[key] = f"part {name!r}", value
        return state

    def shards(self) -> Shards:
        """The tensors the parts give: one engine, and the outer kinds of its owned ranges."""
        engine: Engine | None = None
        outer: dict[int, dict[str, torch.Tensor]] | None = None
        for name, part in self.states.items():
            given = getattr(part, "shards", None)
            mine: Shards = given() if given is not None else Shards()
            if mine.engine is not None:
                if engine is not None:
                    raise ValueError(f"part {name!r} gives a second engine to checkpoint")
                engine = mine.engine
            if mine.outer is not None:  # (None: no outer state at all, as the format reads it)
                outer = {} if outer is None else outer
                for i, kinds in mine.outer.items():
                    outer[i] = {**outer.get(i, {}), **kinds}
        if engine is None:
            raise ValueError(f"no part of {sorted(self.states)} gives the engine to checkpoint")
        return Shards(engine, outer)

    def save(self, step: int) -> Path:
        """Every rank writes the shards it owns (no gather); see ``checkpoint.sharded``. With
        ``checkpoint.async`` the writing goes on after this returns (see :meth:`wait`)."""
        t0 = time.perf_counter()
        with region("meshlm.checkpoint_save"):
            state, shards = self.state_dict(), self.shards()
            files: dict[str, Path | str] = {"config.toml": self.config_toml(),
                                            "tokenizer.json": self.run_dir / "tokenizer.json"}
            with phase("checkpoint save"):
                if self.saver is not None:
                    directory = self.saver.save(self.root, step, shards.engine, state, files,
                                                self.section.keep, shards.outer)
                else:
                    directory = save_checkpoint(
                        self.root, step, shards.engine, self.comm, state, files,
                        keep=self.section.keep, outer=shards.outer)
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

    def load(self, directory: Path) -> int:
        """Every part restores itself from the checkpoint, in order (this rank's slices of its
        tensors), then this rank's RNG states; returns the checkpoint's step."""
        with phase("checkpoint load"), ShardedCheckpoint(directory) as ckpt:
            for part in self.states.values():
                part.load_state_dict(ckpt.trainer, ckpt)
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
        """``train.on_nonfinite=rollback``: reload the latest complete checkpoint (every rank,
        as they agreed on the non-finite ``step``; ``what``: what was found there). Returns the
        checkpoint's step and what was done, in words."""
        self.wait()  # (a save in flight is the latest once complete)
        directory = latest_valid(self.root, log=_quiet)
        if directory is None:
            raise NonFiniteError(
                f"step {step}: {what}; train.on_nonfinite=rollback has no checkpoint "
                "to return to (none saved yet: set train.checkpoint_every)")
        back = self.load(directory)
        return back, f"rolled back to step {back} ({directory.name})"
