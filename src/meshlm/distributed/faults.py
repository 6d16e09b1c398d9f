"""Fault injection for tests: kill this worker at a chosen point (first attempt only).

``MESHLM_FAULT_KILL_AT_STEP=k`` (after optimizer step k) and ``MESHLM_FAULT_KILL_IN_SAVE=k``
(after writing this rank's file of checkpoint k, before it is complete) SIGKILL the highest
rank of the world -- only when the worker group has not been restarted yet
(``TORCHELASTIC_RESTART_COUNT`` 0 or unset), so a restarted run completes.
``MESHLM_FAULT_INF_GRAD="k:r"`` puts an inf (``MESHLM_FAULT_NAN_GRAD``: a NaN) into rank r's
gradients at step k; ``MESHLM_FAULT_STOP_AT_STEP=k`` freezes the highest rank (SIGSTOP) inside
step k, after its first micro-batch, writing the time to ``MESHLM_FAULT_STOP_FILE`` first
(first attempt only). ``MESHLM_FAULT_SLOW_RANK="r:seconds"`` makes rank r a straggler: it
sleeps that many seconds at the start of every step (every attempt, restarts included), before
its first collective, so its peers wait for it there; ``"r:seconds:k1-k2"`` only in steps k1 to
k2. Unset: no effect.
No communication, no memory.
"""

from __future__ import annotations

import os
import signal
import time

import torch

_POISONED: set[tuple[str, int]] = set()


def reset() -> None:
    """Forget which steps were poisoned (a new run in the same process)."""
    _POISONED.clear()


def poison_if_asked(step: int, rank: int, grads: list[torch.Tensor]) -> None:
    """``MESHLM_FAULT_INF_GRAD="k:r"`` (or ``MESHLM_FAULT_NAN_GRAD``): at step k, rank r writes
    inf (NaN) into its first gradient (after the reduction: only that rank holds it) -- the
    tests of fp16 overflow and of ``train.on_nonfinite``. Several steps: ``"k1,k2:r"``. Once
    per step and process: a step redone after a rollback trains on another batch."""
    for var, value in (("MESHLM_FAULT_INF_GRAD", float("inf")),
                       ("MESHLM_FAULT_NAN_GRAD", float("nan"))):
        spec = os.environ.get(var)
        if not spec or not grads:
            continue
        at, _, who = spec.partition(":")
        if (step in {int(k) for k in at.split(",")} and int(who or 0) == rank
                and (var, step) not in _POISONED):
            _POISONED.add((var, step))
            grads[0].view(-1)[0] = value


def stop_if_asked(step: int, rank: int) -> None:
    """``MESHLM_FAULT_STOP_AT_STEP=k``: the highest rank stops itself (SIGSTOP) in step k."""
    at = os.environ.get("MESHLM_FAULT_STOP_AT_STEP")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if (at and int(at) == step and rank == world - 1
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        if path := os.environ.get("MESHLM_FAULT_STOP_FILE"):
            with open(path, "w") as f:
                f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)


def slow_if_asked(step: int, rank: int) -> None:
    """``MESHLM_FAULT_SLOW_RANK="r:seconds[:k1-k2]"``: rank r sleeps ``seconds`` in step
    ``step`` (every step, or steps k1 to k2); called once per step."""
    spec = os.environ.get("MESHLM_FAULT_SLOW_RANK")
    if not spec:
        return
    who, seconds, *steps = spec.split(":")
    first, _, last = (steps[0] if steps else "1-").partition("-")
    if int(who) == rank and int(first) <= step <= (int(last) if last else step):
        time.sleep(float(seconds))


def kill_if_asked(variable: str, step: int, rank: int, world_size: int) -> None:
    at = os.environ.get(variable)
    if (at and int(at) == step and rank == world_size - 1
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        os.kill(os.getpid(), signal.SIGKILL)
