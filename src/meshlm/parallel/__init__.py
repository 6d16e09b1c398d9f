"""Parallelism applied to a plain model: ``parallelize(model, mesh, comm, config)``.

Order (torchtitan's): the precision's model converter (fp8: float8 linears, ``float8.py``) ->
tensor/sequence parallel -> context parallel -> expert parallel -> pipeline split -> the
run-time choices of this rank's layers, applied together in one fixed order
(``extensions.apply_choices``: the converted modules bound to the axes that shard them,
attention kernel, ``train.compile``, ``train.recompute``)
-> data parallel (DDP or ZeRO-1/2/3, over dp x cp when cp > 1) -> optimizer-state offload. Every parameter first gets a shard spec (the whole tensor,
replicated); each technique updates the specs of what it shards, and the engine groups
parameters by their spec's reduction axis. The :class:`~meshlm.parallel.engine.Engine`
returned owns gradients and the optimizer.

Shard-only construction: ``model`` may be built on the meta device (shapes only). Tensor
parallelism and the pipeline split then cut specs and drop modules without touching values,
and each rank materialises only what it keeps, read from a value ``source`` (the seed's initial
values, a checkpoint, a Hugging Face folder): its tp slices of its stages' parameters, or under
ZeRO-3 only its flat shards. Peak while building: this rank's share, plus one global parameter
for initial values (drawn whole, then cut).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..config import ParallelSection, TrainSection
    from ..distributed.comm import Comm
    from ..distributed.source import TensorSource
    from ..models.llama import Transformer
    from ..precision import PrecisionPlan
    from .context import ContextParallel
    from .engine import Engine
    from .pipeline import PipelineModel
    from .tensor import TensorParallel

# Exported on first use: importing the package (or a torch-free sibling such as the cost
# descriptions the planner reads, ``*_cost.py``) does not import torch.
_LAZY = {"ContextParallel": ".context", "Engine": ".engine"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class Parallelized:
    """A model after ``parallelize``: its engine and the helpers of each applied technique."""

    engine: Engine
    tp: TensorParallel | None  # None at tp = 1
    pipe: PipelineModel | None  # None at pp = 1
    cp: ContextParallel | None = None  # None at cp = 1


def materialize(model: Transformer, source: TensorSource | None, device: torch.device) -> None:
    """Give every meta parameter its values -- this rank's slice, read from ``source`` -- and
    build the model's non-persistent buffers on ``device``."""
    from ..distributed.source import assign, read_local
    from ..distributed.spec import spec_of

    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.is_meta:
            continue
        seen.add(id(p))
        if source is None:
            raise ValueError(f"parameter {name} is on the meta device and no value source "
                             "was given")
        spec = spec_of(p)
        assign(p, read_local(source, spec, 0, p.numel(), device).view(spec.shape))
    model.build_buffers(device)


def parallelize(model: Transformer, comm: Comm, parallel: ParallelSection,
                train: TrainSection, source: TensorSource | None = None,
                offload_file: Path | None = None,
                precision: PrecisionPlan | None = None) -> Parallelized:
    """The precision's model converter, tensor/sequence parallel, then the pipeline split,
    then data parallelism over dp, then the optimizer states' place (``parallel.offload``,
    see ``offload.py``).

    ``source``: values of a model built on the meta device (see module docstring).
    ``offload_file``: this rank's file of AdamW moments under ``parallel.offload=disk``.
    ``precision``: the run's precision; its name is recorded with the model's choices
    (``print(model)``) and the converter its registration names (``registry.PRECISION``: fp8's
    float8 linears with the plan's recipe) converts the plain model first. None leaves the
    model as it is and the precision unnamed (the trainer's autocast decides).
    """
    from ..distributed.spec import attach_specs
    from .context import apply_context_parallel
    from .data import DDPEngine
    from .engine import LocalEngine
    from .expert import apply_expert_parallel, attach_count_reducers
    from .extensions import apply_choices, choices_of
    from .offload import offload_states
    from .pipeline import PipelineModel
    from .tensor import apply_tensor_parallel
    from .zero import ZeroEngine
    from .zero3 import Zero3Engine

    attach_specs(model, comm.mesh)
    named = {} if precision is None else {"precision": precision.name,
                                          "fp8_recipe": precision.fp8_recipe}
    converter = replace(choices_of(model), **named).converter()
    if converter is not None:  # before any parallelism: tp shards converted modules alike
        converter.convert(model)
    tp = apply_tensor_parallel(model, comm, parallel.sp) if comm.size("tp") > 1 else None
    cp = (apply_context_parallel(model, comm, parallel.cp_attention)
          if comm.size("cp") > 1 else None)
    if comm.size("ep") > 1:
        apply_expert_parallel(model, comm)
    if model.cfg.is_moe:
        attach_count_reducers(model, comm)
    pipelined = comm.size("pp") > 1
    pipe = (PipelineModel(model, comm.rank("pp"), comm.size("pp"), parallel.pp_virtual,
                          parallel.pp_layers, parallel.pp_schedule, comm=comm)
            if pipelined else None)
    # converted modules bound to their shards, attention kernel, recomputation, compile: named
    # choices applied together, in the fixed order of extensions.py, to this rank's layers
    apply_choices(model, cp=cp, comm=comm,
                  context=parallel.cp_attention if cp is not None else None,
                  recompute=train.recompute, compiled=train.compile, **named)
    device = comm.mesh.device()
    if parallel.zero == 3:
        # under a pipeline, parameters stay gathered for the step and gradients are reduced
        # once after the last micro-batch (as FSDP2 with pipelining does)
        model.build_buffers(device)
        engine: Engine = Zero3Engine(model, train, comm, keep_gathered=pipelined,
                                     source=source)
        return Parallelized(offload_states(engine, parallel.offload, offload_file), tp, pipe,
                            cp)
    materialize(model, source, device)
    if parallel.zero in (1, 2):
        # under a pipeline, gradients are reduced once after the last micro-batch, so ZeRO-2
        # holds them whole during the step like ZeRO-1 (Megatron's distributed optimizer)
        stage = 1 if pipelined else parallel.zero
        engine = ZeroEngine(model, train, comm, stage, parallel.bucket_mb)
    elif comm.size("dp_cp") > 1:
        engine = DDPEngine(model, train, comm, parallel.bucket_mb)
    else:
        engine = LocalEngine(model, train, comm)
    return Parallelized(offload_states(engine, parallel.offload, offload_file), tp, pipe, cp)


__all__ = ["ContextParallel", "Engine", "Parallelized", "materialize", "parallelize"]
