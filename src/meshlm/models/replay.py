"""Whether the forward running now is a replay: activation recomputation re-running a layer's
forward during backward.

A replay must compute exactly what the first forward computed (the recomputed tensors replace
the ones that were not saved), but effects meant to happen once per micro-batch -- the MoE
router's statistics and recorded aux loss, context-parallel tile counters -- are skipped while
:func:`replaying` is true. ``meshlm.parallel.recompute`` sets it; nothing else does.
No communication, no memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_depth = 0


def replaying() -> bool:
    """True inside a recomputation of a forward (see module docstring)."""
    return _depth > 0


@contextlib.contextmanager
def replay() -> Iterator[None]:
    """Mark the enclosed forward as a recomputation."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
