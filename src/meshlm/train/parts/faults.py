"""The fault part: injected faults (tests) and what a non-finite step does (``train.on_nonfinite``).

The injected faults of :mod:`meshlm.distributed.faults` fire at fixed points of a step: a slow
rank sleeps at its start, a frozen rank stops after its first micro-batch, a poisoned rank's
gradients get an inf or NaN after the reduction, a killed rank dies after the optimizer step.
The non-finite check turns this rank's loss and the gradient norm into two flags max-reduced
over the island (one all-reduce of 2 floats per step), so every rank takes the same decision
of :class:`~meshlm.train.nonfinite.NonFinitePolicy`. No memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...config import TrainSection
from ...distributed import faults
from ...distributed.comm import Comm
from ...distributed.faults import kill_if_asked, poison_if_asked, slow_if_asked, stop_if_asked
from ..nonfinite import NonFinitePolicy, describe

Log = Callable[[str], None]


class FaultHandling:
    """Where the injected faults fire, and the run's non-finite policy and its counts."""

    SECTION = "train"

    def __init__(self, section: TrainSection, comm: Comm, axis: str, log: Log) -> None:
        self.section, self.comm, self.axis, self.log = section, comm, axis, log
        self.rank, self.world_size = comm.mesh.rank, comm.mesh.world_size
        faults.reset()  # (tests: injected faults fire once per run)
        self.policy = NonFinitePolicy(section.on_nonfinite, section.max_skips)
        self.nonfinite = ""  # what was not finite in the last step ("": all finite)
        self.step = 0  # the step in progress

    def begin_step(self, step: int) -> None:
        self.step = step
        slow_if_asked(step, self.rank)  # (tests: a straggler)

    def after_micro_batch(self) -> None:
        stop_if_asked(self.step, self.rank)  # (tests: a rank that freezes in a step)

    def poison(self, step: int, grads: list[torch.Tensor]) -> None:
        poison_if_asked(step, self.rank, grads)  # (tests: an overflow / NaN on one rank)

    def check(self, local_loss: float, grad_norm: float | None) -> str:
        """What was not finite on some rank of the island ("": nothing); collective."""
        flags = self.comm.reduce_scalars(NonFinitePolicy.flags(local_loss, grad_norm),
                                         self.axis, op="max")
        self.nonfinite = describe(flags)
        return self.nonfinite

    def end_step(self, step: int) -> bool:
        """After the optimizer step: the injected kill, then the policy's verdict on a
        non-finite step (a skip is logged; stop raises). True: roll back."""
        kill_if_asked("MESHLM_FAULT_KILL_AT_STEP", step, self.rank, self.world_size)  # (tests)
        if self.nonfinite and self.policy.on_event(step, self.nonfinite) == "rollback":
            return True
        if self.nonfinite:
            self.log(f"step {step}: {self.nonfinite}; skipped (train.on_nonfinite="
                     f"skip, {self.policy.skips} so far)")
        else:
            self.policy.finite(step)
        return False

    def record(self, step: int) -> dict[str, Any]:
        return {**({"nonfinite": self.nonfinite} if self.nonfinite else {}),
                **({"nonfinite_skips": self.policy.skips, "rollbacks": self.policy.rollbacks}
                   if self.policy.skips else {})}
