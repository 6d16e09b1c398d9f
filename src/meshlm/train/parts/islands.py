"""The islands part: DiLoCo's outer steps between ``parallel.islands`` > 1 islands.

Each island trains alone for ``diloco.inner_steps`` steps, then the islands average their
pseudo-gradients and take an outer Nesterov step (parallel/diloco.py), fragment by fragment
under Streaming DiLoCo; a stop request waits for the next synchronisation, where every island
agrees on it. With one island the part does nothing. Checkpoints hold its outer weights and
momentum (written by island 0) and its round counters (``diloco``). Communication: the
cross-island all-reduce of each fragment when it is due, one of a float per checkpoint; memory:
the outer weights and momentum of this rank's owned shards (islands only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...checkpoint.sharded import ShardedCheckpoint
from ...config import DilocoSection
from ...distributed.comm import Comm
from ...distributed.source import read_local
from ...parallel.diloco import Diloco
from ...parallel.engine import Engine
from ..profiling import region
from . import Shards


class Islands:
    """The outer optimizer of this rank's island (``diloco``: None with one island)."""

    SECTION = "diloco"

    def __init__(self, section: DilocoSection, engine: Engine, comm: Comm, n_layers: int,
                 last_step: int) -> None:
        self.section, self.comm, self.last_step = section, comm, last_step
        self.diloco = (Diloco(engine, comm, section, n_layers) if comm.mesh.islands > 1
                       else None)

    def outer_sync(self, step: int, loss: float, stop: bool) -> tuple[dict[str, Any], bool]:
        """The outer step of the fragments due after ``step``: its record fields and whether
        the run stops (agreed by every island at a synchronisation; False between them).
        With one island: nothing, and ``stop`` as it is."""
        if self.diloco is None:
            return {}, stop
        self.diloco.note_loss(loss)
        due = self.diloco.due(step, self.last_step)
        if not due:
            return {"island_bytes_total": self.diloco.bytes_total}, False
        with region("meshlm.outer_step"):
            rec = self.diloco.sync(step, due, stop)
        stop = rec.pop("_stop")
        rec["comm_bytes"] = self.comm.log.bytes_by_op()  # the step's, with the synchronisation
        return rec, stop

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``diloco`` entry (nothing with one island; collective over the
        islands)."""
        return {"diloco": self.diloco.state_dict()} if self.diloco is not None else {}

    def shards(self) -> Shards:
        """The outer weights and momentum of each owned range (islands only)."""
        return Shards(outer=self.diloco.outer_pieces() if self.diloco is not None else None)

    def load_state_dict(self, state: Mapping[str, Any], ckpt: ShardedCheckpoint) -> None:
        """The outer weights, momentum and counters of a checkpoint (islands only; after the
        model's weights, which a checkpoint without islands makes the reference)."""
        if self.diloco is not None:
            device = self.comm.mesh.device()
            self.diloco.load(lambda kind, o: (read_local(ckpt.source(kind), o.spec, o.lo,
                                                         o.hi, device)
                                              if ckpt.holds(kind) else None),
                             state.get("diloco"))

    def startup_lines(self) -> list[str]:
        if self.diloco is not None:
            return [self.diloco.describe()]
        if self.section != type(self.section)():
            return ["diloco: parallel.islands=1, so the [diloco] keys have no effect"]
        return []
