"""Parallelism applied to a plain model: ``parallelize(model, mesh, comm, config)``.

Order (torchtitan's): tensor/sequence parallel -> pipeline split -> activation recomputation
-> data parallel (DDP or ZeRO-1/2/3). Every parameter first gets a shard spec (the whole tensor,
replicated); each technique updates the specs of what it shards, and the engine groups
parameters by their spec's reduction axis. The :class:`~meshlm.parallel.engine.Engine`
returned owns gradients and the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ParallelSection, TrainSection
from ..distributed.comm import Comm
from ..distributed.spec import attach_specs
from ..models.llama import Transformer
from .data import DDPEngine
from .engine import Engine, LocalEngine
from .pipeline import PipelineModel
from .tensor import TensorParallel, apply_tensor_parallel
from .zero import ZeroEngine
from .zero3 import Zero3Engine


@dataclass
class Parallelized:
    """A model after ``parallelize``: its engine and the helpers of each applied technique."""

    engine: Engine
    tp: TensorParallel | None  # None at tp = 1
    pipe: PipelineModel | None  # None at pp = 1


def parallelize(model: Transformer, comm: Comm, parallel: ParallelSection,
                train: TrainSection) -> Parallelized:
    """Tensor/sequence parallel, then the pipeline split, then data parallelism over dp."""
    attach_specs(model, comm.mesh)
    tp = apply_tensor_parallel(model, comm, parallel.sp) if comm.size("tp") > 1 else None
    pipelined = comm.size("pp") > 1
    pipe = (PipelineModel(model, comm.rank("pp"), comm.size("pp"), parallel.pp_virtual,
                          parallel.pp_layers) if pipelined else None)
    if parallel.zero == 3:
        # under a pipeline, parameters stay gathered for the step and gradients are reduced
        # once after the last micro-batch (as FSDP2 with pipelining does)
        engine: Engine = Zero3Engine(model, train, comm, keep_gathered=pipelined)
    elif parallel.zero in (1, 2):
        # under a pipeline, gradients are reduced once after the last micro-batch, so ZeRO-2
        # holds them whole during the step like ZeRO-1 (Megatron's distributed optimizer)
        stage = 1 if pipelined else parallel.zero
        engine = ZeroEngine(model, train, comm, stage, parallel.bucket_mb)
    elif comm.size("dp") > 1:
        engine = DDPEngine(model, train, comm, parallel.bucket_mb)
    else:
        engine = LocalEngine(model, train, comm)
    return Parallelized(engine, tp, pipe)


__all__ = ["Engine", "Parallelized", "parallelize"]
