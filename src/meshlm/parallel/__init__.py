"""Parallelism applied to a plain model: ``parallelize(model, mesh, comm, config)``.

Order (torchtitan's): tensor/sequence parallel -> pipeline split -> activation recomputation
-> data parallel (DDP or ZeRO-1/2/3). Only the data-parallel family exists so far; it returns
the :class:`~meshlm.parallel.engine.Engine` that owns gradients and the optimizer.
"""

from __future__ import annotations

from torch import nn

from ..config import ParallelSection, TrainSection
from ..distributed.comm import Comm
from .data import DDPEngine
from .engine import Engine, LocalEngine
from .zero import ZeroEngine
from .zero3 import Zero3Engine


def parallelize(model: nn.Module, comm: Comm, parallel: ParallelSection,
                train: TrainSection) -> Engine:
    """Wrap ``model`` for data parallelism over the mesh's dp axis; returns its engine."""
    if parallel.zero == 3:
        return Zero3Engine(model, train, comm, "dp")
    if parallel.zero in (1, 2):
        return ZeroEngine(model, train, comm, parallel.zero, "dp", parallel.bucket_mb)
    if comm.size("dp") > 1:
        return DDPEngine(model, train, comm, "dp", parallel.bucket_mb)
    return LocalEngine(model, train)


__all__ = ["Engine", "parallelize"]
