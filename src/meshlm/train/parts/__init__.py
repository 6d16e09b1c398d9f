"""The parts a :class:`~meshlm.train.trainer.Trainer` is assembled from.

Each part is built from its own section of the config (``SECTION`` names it; the part keeps
that section as ``section`` and never the whole config) plus the objects it works on:

- :mod:`.model`         ``[model]``: the model on the meta device, parallelised, this rank's
  shards materialised; the loss; the MoE routing statistics of each step
- :mod:`.batches`       ``[data]``: the cached data, the step sampler, the validation batches
- :mod:`.optimizer`     ``[train]``: reduce, unscale, clip, check, step (the engine's update)
- :mod:`.checkpointer`  ``[checkpoint]``: save, load, resume, roll back
- :mod:`.recorder`      ``[train]``: the metrics record of a step, start-up and end lines
- :mod:`.faults`        ``[train]``: injected faults (tests) and ``train.on_nonfinite``
- :mod:`.watch`         ``[distributed]``: flight recorder, stall monitor, collective timeouts
- :mod:`.context`       ``[parallel]``: this rank's share of each sequence (context parallel)
- :mod:`.islands`       ``[diloco]``: DiLoCo's outer steps between islands

A part that adds fields to the metrics record of a step has ``record(step) -> dict``; the
recorder merges those of its list of contributors, in order. A part whose technique is off
(no cp, one island) is present all the same and contributes nothing.
"""

from __future__ import annotations

from typing import Any, Protocol


class Contributor(Protocol):
    def record(self, step: int) -> dict[str, Any]:
        """This part's fields of the metrics record of ``step`` (may be collective)."""
