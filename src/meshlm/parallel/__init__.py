"""Parallelism applied to a plain model: ``parallelize(model, mesh, comm, config)``.

Order (torchtitan's): tensor/sequence parallel -> pipeline split -> activation recomputation
-> data parallel (DDP or ZeRO-1/2/3). Tensor/sequence and data parallelism exist so far; the
:class:`~meshlm.parallel.engine.Engine` returned owns gradients and the optimizer.
"""

from __future__ import annotations

from ..config import ParallelSection, TrainSection
from ..distributed.comm import Comm
from ..models.llama import Transformer
from .data import DDPEngine
from .engine import Engine, LocalEngine
from .tensor import TensorParallel, apply_tensor_parallel
from .zero import ZeroEngine
from .zero3 import Zero3Engine


def parallelize(model: Transformer, comm: Comm, parallel: ParallelSection,
                train: TrainSection) -> tuple[Engine, TensorParallel | None]:
    """Apply tensor/sequence parallelism, then wrap for data parallelism over dp.

    Returns the engine (gradients + optimizer) and the tensor-parallel helper (None at tp=1).
    """
    tp = apply_tensor_parallel(model, comm, parallel.sp) if comm.size("tp") > 1 else None
    if parallel.zero == 3:
        engine: Engine = Zero3Engine(model, train, comm, "dp")
    elif parallel.zero in (1, 2):
        engine = ZeroEngine(model, train, comm, parallel.zero, "dp", parallel.bucket_mb)
    elif comm.size("dp") > 1:
        engine = DDPEngine(model, train, comm, "dp", parallel.bucket_mb)
    else:
        engine = LocalEngine(model, train, comm)
    return engine, tp


__all__ = ["Engine", "parallelize"]
