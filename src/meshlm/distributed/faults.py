"""Fault injection for tests: kill this worker at a chosen point (first attempt only).

``MESHLM_FAULT_KILL_AT_STEP=k`` (after optimizer step k) and ``MESHLM_FAULT_KILL_IN_SAVE=k``
(after writing this rank's file of checkpoint k, before it is complete) SIGKILL the highest
rank of the world -- only when the worker group has not been restarted yet
(``TORCHELASTIC_RESTART_COUNT`` 0 or unset), so a restarted run completes. Unset: no effect.
No communication, no memory.
"""

from __future__ import annotations

import os
import signal


def kill_if_asked(variable: str, step: int, rank: int, world_size: int) -> None:
    at = os.environ.get(variable)
    if (at and int(at) == step and rank == world_size - 1
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        os.kill(os.getpid(), signal.SIGKILL)
