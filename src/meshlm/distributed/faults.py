"""Fault injection for tests: kill this worker at a chosen point (first attempt only).

``MESHLM_FAULT_KILL_AT_STEP=k`` (after optimizer step k) and ``MESHLM_FAULT_KILL_IN_SAVE=k``
(after writing this rank's file of checkpoint k, before it is complete) SIGKILL the highest
rank of the world -- only when the worker group has not been restarted yet
(``TORCHELASTIC_RESTART_COUNT`` 0 or unset), so a restarted run completes.
``MESHLM_FAULT_INF_GRAD="k:r"`` puts an inf into rank r's gradients at step k. Unset: no effect.
No communication, no memory.
"""

from __future__ import annotations

import os
import signal

import torch


def poison_if_asked(step: int, rank: int, grads: list[torch.Tensor]) -> None:
    """``MESHLM_FAULT_INF_GRAD="k:r"``: at step k, rank r writes inf into its first gradient
    (after the reduction: only that rank holds it) -- the fp16 overflow check's test."""
    spec = os.environ.get("MESHLM_FAULT_INF_GRAD")
    if not spec or not grads:
        return
    at, _, who = spec.partition(":")
    if int(at) == step and int(who or 0) == rank:
        grads[0].view(-1)[0] = float("inf")


def kill_if_asked(variable: str, step: int, rank: int, world_size: int) -> None:
    at = os.environ.get(variable)
    if (at and int(at) == step and rank == world_size - 1
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        os.kill(os.getpid(), signal.SIGKILL)
