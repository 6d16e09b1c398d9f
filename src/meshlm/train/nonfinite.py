"""What a step with a non-finite loss or gradient norm does: ``train.on_nonfinite``.

Checked after the gradients are reduced and clipped, before the optimizer step: this rank's
loss and the gradient norm are turned into two flags and max-all-reduced over the world, so
every rank takes the same decision even when only one rank's gradients hold the NaN (data
parallelism clips each replica's gradients locally). Then:

- ``stop``: raise :class:`NonFiniteError` on every rank; nothing is saved, the last complete
  checkpoint stays the latest.
- ``skip``: no optimizer step; the batch is consumed and the step counted (``nonfinite_skips``
  in ``metrics.jsonl``).
- ``rollback``: reload the latest complete checkpoint and never train on the offending batch
  again (it joins the sampler's skip list, saved with later checkpoints); the steps after the
  checkpoint are redone on the same data, then the next batch takes the bad one's step.

``train.max_skips`` non-finite steps in a row (for rollback: without getting past the
furthest step reached) end the run with :class:`NonFiniteError`.

Communication: one all-reduce of 2 floats over the world per step (world > 1). No memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class NonFiniteError(RuntimeError):
    """The run stops on a non-finite loss or gradient norm (one line; every rank agrees)."""


@dataclass
class NonFinitePolicy:
    mode: str  # stop | skip | rollback
    max_skips: int
    skips: int = 0  # steps skipped or rolled back so far
    rollbacks: int = 0
    streak: int = 0  # in a row, without progress
    furthest: int = 0  # the furthest step completed with finite values

    @staticmethod
    def flags(loss: float, grad_norm: float | None) -> list[float]:
        """This rank's [loss non-finite, gradient norm non-finite] as floats to max-reduce."""
        return [float(not math.isfinite(loss)),
                float(grad_norm is not None and not math.isfinite(grad_norm))]

    def finite(self, step: int) -> None:
        if step > self.furthest:
            self.furthest, self.streak = step, 0

    def on_event(self, step: int, what: str) -> str:
        """Count a non-finite ``step``; returns the action ("skip" or "rollback") or raises."""
        if self.mode == "stop":
            raise NonFiniteError(
                f"step {step}: {what}; train.on_nonfinite=stop ends the run (nothing saved; "
                "lower train.lr, or set train.on_nonfinite=skip or rollback)")
        self.streak += 1
        if self.streak >= self.max_skips:
            raise NonFiniteError(
                f"step {step}: {what}, {self.streak} times in a row; train.max_skips="
                f"{self.max_skips} ends the run (lower train.lr)")
        self.skips += 1
        if self.mode == "rollback":
            self.rollbacks += 1
        return self.mode


def describe(flags: list[float]) -> str:
    """What was not finite on some rank, in words (``flags`` as reduced over the world: the
    same on every rank)."""
    parts = [what for flag, what in zip(flags, ("the loss", "the gradient norm"), strict=True)
             if flag]
    return " and ".join(parts) + " is not finite" if parts else ""
