"""The context-parallel part: this rank's share of each sequence, in training and evaluation.

Under ``parallel.cp`` > 1 each cp rank reads and computes only its positions of every sequence
(parallel/context.py: ring, zigzag or Ulysses attention); the shares are equal, so a loss over
the cp group is the mean of the ranks' means. Without cp every method is the identity and the
part contributes nothing. Communication: one all-reduce of cp floats per step (the attention
tiles, ring modes) and one float per evaluation; no memory.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from ...config import ParallelSection
from ...distributed.comm import Comm
from ...parallel.context import ContextParallel, context_summary


class ContextShare:
    """This rank's positions of each sequence, and what cp adds to the record and the log."""

    SECTION = "parallel"

    def __init__(self, section: ParallelSection, cp: ContextParallel | None, comm: Comm,
                 seq_len: int) -> None:
        self.section, self.cp, self.comm, self.seq_len = section, cp, comm, seq_len
        self.positions: np.ndarray | None = cp.positions(seq_len) if cp is not None else None

    def begin_step(self) -> None:
        if self.cp is not None:
            self.cp.reset_tiles()

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of (B, S) ``x``."""
        return self.cp.shard(x) if self.cp is not None else x

    def mean_of_shares(self, total: float) -> float:
        """A sum over this rank's share, averaged over the cp ranks (collective)."""
        if self.cp is None:
            return total
        return self.comm.reduce_scalars([total], "cp")[0] / self.cp.size

    def whole_context(self) -> contextlib.AbstractContextManager:
        """Every cp rank runs the whole context alone (sampling; the weights are whole)."""
        return self.cp.disabled() if self.cp is not None else contextlib.nullcontext()

    def record(self, step: int) -> dict[str, Any]:
        """The cp mode and, for the ring modes, the attention tiles (c x c, c = s / (2 cp))
        each cp rank of this pipeline stage computed this step, in cp-rank order."""
        if self.cp is None:
            return {}
        rec: dict[str, Any] = {"cp_attention": self.cp.mode}
        if self.cp.mode != "ulysses":
            tiles = [0.0] * self.cp.size
            tiles[self.cp.rank] = float(self.cp.tiles())
            rec["cp_tiles_per_rank"] = [int(t) for t in self.comm.reduce_scalars(tiles, "cp")]
        return rec

    def startup_lines(self) -> list[str]:
        if self.cp is None:
            return []
        return [context_summary(self.cp.mode, self.cp.size, self.seq_len)]
