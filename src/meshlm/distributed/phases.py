"""Which phase of a step this process is in: construction, checkpoint load, forward, backward,
optimizer step, evaluation, checkpoint save, sampling.

The trainer and the pipeline executor mark their phases with :func:`phase`; an error report
(``train/oom.py``: out of memory) names the innermost one. ``MESHLM_FAULT_OOM="phase:rank"``
raises ``torch.OutOfMemoryError`` when rank ``rank`` enters ``phase`` (tests; first attempt
only). No communication, no memory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

PHASES = ("construction", "checkpoint load", "forward", "backward", "optimizer step",
          "evaluation", "checkpoint save", "sampling")

_current = ["start-up"]


def current_phase() -> str:
    return _current[-1]


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the code inside as phase ``name`` (nested phases: the innermost counts); an
    exception leaving it carries the phase it was raised in (:func:`phase_of`). Also a
    decorator: ``@phase("evaluation")``."""
    _current.append(name)
    try:
        oom_if_asked(name)
        yield
    except BaseException as exc:
        if not hasattr(exc, "meshlm_phase"):
            with contextlib.suppress(AttributeError, TypeError):
                exc.meshlm_phase = name  # type: ignore[attr-defined]
        raise
    finally:
        _current.pop()


def phase_of(exc: BaseException) -> str:
    """The phase ``exc`` was raised in (the current one when it left no phase)."""
    return getattr(exc, "meshlm_phase", None) or current_phase()


_entered: dict[str, int] = {}


def oom_if_asked(name: str) -> None:
    """``MESHLM_FAULT_OOM="phase:rank[:n]"``: raise torch's out-of-memory error when rank
    ``rank`` enters ``phase`` for the ``n``-th time (default 1; tests)."""
    spec = os.environ.get("MESHLM_FAULT_OOM")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    where, who, nth = (spec.split(":") + ["1"])[:3]
    if where != name or int(who) != int(os.environ.get("RANK", "0")):
        return
    _entered[name] = _entered.get(name, 0) + 1
    if _entered[name] == int(nth):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 224.00 MiB. (injected by MESHLM_FAULT_OOM)")
