"""The optimizer part: the end of a step, from local gradients to updated weights.

The engine reduces the gradients (``finish_grads``), fp16 unscales them and checks for an
overflow on any rank of the island (a skipped step), the engine clips them by the global norm,
the non-finite check runs (train/parts/faults.py), then the engine's optimizer step at the
scheduled learning rate, and the gradients are cleared; MoE layers then update their routing.
Checkpoints hold the fp16 loss scaler's state (``scaler``; the moments are the model part's
engine's). Communication: the engine's reduction and norm, one all-reduce of a flag (fp16) and
one of two flags over the island; memory: the engine's (gradients, optimizer states).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...checkpoint.sharded import ShardedCheckpoint
from ...config import TrainSection
from ...distributed.comm import Comm
from ...distributed.phases import phase
from ...optim import lr_at
from ...parallel.engine import Engine
from ...precision import Precision, PrecisionPlan
from ..profiling import region
from .faults import FaultHandling
from .model import Routing


class OptimizerUpdate:
    """Reduce, unscale, clip, check, step, clear -- the same for every layout."""

    SECTION = "train"

    def __init__(self, section: TrainSection, precision: PrecisionPlan, engine: Engine,
                 comm: Comm, axis: str, device_type: str, faults: FaultHandling,
                 routing: Routing) -> None:
        """``precision``: the run's; :attr:`precision` is its autocast and fp16 loss scaler
        (the step runner autocasts and scales with it)."""
        self.section, self.engine, self.comm, self.axis = section, engine, comm, axis
        self.precision = Precision.of(precision, device_type)
        self.faults, self.routing = faults, routing
        self.skipped = False  # whether the last step was skipped (fp16 overflow)

    @phase("optimizer step")
    def update(self, step: int, local_loss: float) -> float | None:
        """Reduce gradients, clip by the global norm, AdamW step, clear; returns the norm.

        ``local_loss``: this rank's loss of the step (0 on pipeline stages without the head),
        checked with the norm for ``train.on_nonfinite`` (train/nonfinite.py)."""
        cfg = self.section
        self.engine.finish_grads()
        grads = self.engine.grad_tensors()
        self.faults.poison(step, grads)
        # fp16: unscale; an inf/nan on any rank skips the step on every rank
        self.skipped = self.precision.overflow(  # (over the island: islands step alone)
            grads, lambda flag: self.comm.all_reduce(flag, self.axis, op="max"))
        grad_norm = None  # (metrics: null when the step changed nothing)
        if not self.skipped:
            grad_norm = self.engine.clip_grad_norm(cfg.grad_clip if cfg.grad_clip > 0
                                                   else float("inf"))
        nonfinite = self.faults.check(local_loss, grad_norm)
        if not self.skipped and not nonfinite:
            with region("meshlm.optimizer_step"):
                self.engine.step(lr_at(step, cfg))
        self.engine.zero_grad()
        self.routing.update()  # the step's routing: statistics and the balancing bias
        return grad_norm

    def record(self, step: int) -> dict[str, Any]:
        """The fp16 loss scale and the steps it skipped (nothing without a scaler)."""
        scaler = self.precision.scaler
        if scaler is None:
            return {}
        return {"loss_scale": scaler.scale, "skipped": self.skipped,
                "skipped_steps": scaler.skipped}

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``scaler`` (empty without fp16's loss scaler)."""
        return {"scaler": self.precision.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any], ckpt: ShardedCheckpoint) -> None:
        self.precision.load_state_dict(dict(state.get("scaler") or {}))
