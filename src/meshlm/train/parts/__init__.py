"""The parts a :class:`~meshlm.train.trainer.Trainer` is assembled from.

Each part is built from its own section of the config (``SECTION`` names it; the part keeps
that section as ``section`` and never the whole config) plus the objects it works on:

- :mod:`.model`         ``[model]``: the model on the meta device, parallelised, this rank's
  shards materialised; the loss; the MoE routing statistics of each step
- :mod:`.batches`       ``[data]``: the cached data, the step sampler, the validation batches
- :mod:`.optimizer`     ``[train]``: reduce, unscale, clip, check, step (the engine's update)
- :mod:`.checkpointer`  ``[checkpoint]``: save, load, resume, roll back the named stateful parts
- :mod:`.recorder`      ``[train]``: the metrics record of a step, start-up and end lines
- :mod:`.faults`        ``[train]``: injected faults (tests) and ``train.on_nonfinite``
- :mod:`.watch`         ``[distributed]``: flight recorder, stall monitor, collective timeouts
- :mod:`.context`       ``[parallel]``: this rank's share of each sequence (context parallel)
- :mod:`.islands`       ``[diloco]``: DiLoCo's outer steps between islands

A part that adds fields to the metrics record of a step has ``record(step) -> dict``; the
recorder merges those of its list of contributors, in order. A part whose technique is off
(no cp, one island) is present all the same and contributes nothing.

A part with run state is :class:`Stateful`: it gives its entries of a checkpoint's
``trainer.json`` and restores itself from the checkpoint; one whose tensors go into the rank
files also has ``shards() -> Shards``. The checkpointer takes them as ``{name: part}`` and
knows none of them. Nothing here communicates or holds memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ...checkpoint.sharded import ShardedCheckpoint
    from ...parallel.engine import Engine


class Contributor(Protocol):
    def record(self, step: int) -> dict[str, Any]:
        """This part's fields of the metrics record of ``step`` (may be collective)."""


@runtime_checkable
class Stateful(Protocol):
    """Run state that a checkpoint keeps.

    ``state_dict`` returns top-level entries of ``trainer.json``: JSON values, a snapshot (an
    asynchronous save writes them later). The parts that were always saved keep the keys the
    format has had (``sampler``, ``model``, ``scaler``...); a new part uses its own name as
    its key. Every rank calls it, parts in the same order, so it may be collective.
    ``load_state_dict`` receives the checkpoint's whole ``trainer.json`` (an older checkpoint
    may lack a key) and the checkpoint itself, to read this rank's slices of its tensors."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any], ckpt: ShardedCheckpoint) -> None: ...


@dataclass
class Shards:
    """A part's share of the rank files: ``engine``, whose owned ranges (weights and optimizer
    moments) are written; ``outer``, per index in ``engine.owned()``, more kinds of that range
    written beside them by island 0 (DiLoCo's reference weights and outer momentum)."""

    engine: Engine | None = None
    outer: dict[int, dict[str, torch.Tensor]] | None = None


class HasShards(Protocol):
    def shards(self) -> Shards:
        """What this part adds to the rank files (see :class:`Shards`)."""
