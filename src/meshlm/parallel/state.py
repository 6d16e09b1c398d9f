"""The layout-free training state of a parallelised model, assembled and cut per rank.

Checkpoints have one format for every layout: the one-process model's full fp32 tensors by name
(a tied head stored once, under its embedding) and the AdamW state dict of a one-process run.
:func:`gather_full_state` builds it from this rank's shards, technique by technique, in the
reverse order of ``parallelize``: the engine's data-parallel shards -> whole tensors of this
rank's tensor-parallel slice; tp slices -> global tensors (all-gather over tp, the slice read
from each parameter's shard spec); every pipeline stage's part -> the whole model (exchanged
over pp). :func:`load_full_state` cuts this rank's part back out of a full state.

Communication when saving: all-gathers of the whole state over dp, tp and pp. Memory: the whole
model and AdamW state are held on every rank while this runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import TrainSection
from ..distributed.comm import Comm
from ..distributed.spec import spec_of
from ..models.llama import Transformer, build_model
from ..optim import canonical_params, optimizer_state_by_name, optimizer_state_from_names
from .engine import Engine, adamw_template
from .pipeline import PipelineModel
from .tensor import TensorParallel

State = tuple[dict[str, torch.Tensor], dict[str, Any]]


def _whole_model(model: Transformer) -> Transformer:
    """The one-process model on the meta device: its names and optimizer order."""
    return build_model(model.cfg, device="meta")


def _global_names(model: nn.Module, weights: dict[str, torch.Tensor], optim: dict[str, Any]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """A stage's (weights, AdamW state) keyed by global tensor name (its shard spec's)."""
    name_of = {n: spec_of(p).name for n, p, _ in canonical_params(model)}
    by_name = optimizer_state_by_name(model, optim)
    return ({name_of[n]: t for n, t in weights.items()},
            {name_of[n]: s for n, s in by_name.items()})


def gather_pipeline_state(model: Transformer, comm: Comm, train: TrainSection,
                          weights: dict[str, torch.Tensor], optim: dict[str, Any]) -> State:
    """Every stage's tensors and AdamW states -> the one-process state (on every rank)."""
    parts = comm.all_gather_object(_global_names(model, weights, optim), "pp")
    all_w: dict[str, torch.Tensor] = {}
    all_s: dict[str, dict] = {}
    for w, st in parts:  # (a tied embedding's copies are equal: either one will do)
        all_w.update(w)
        all_s.update(st)
    whole = _whole_model(model)
    names = [n for n, _, _ in canonical_params(whole)]
    groups = adamw_template(whole, train, optim["param_groups"][0]["lr"])
    return {n: all_w[n] for n in names}, optimizer_state_from_names(whole, all_s, groups)


def select_pipeline_state(model: Transformer, train: TrainSection,
                          weights: dict[str, torch.Tensor], optim: dict[str, Any]) -> State:
    """This rank's stages' part of a one-process state, under this rank's parameter names."""
    by_name = optimizer_state_by_name(_whole_model(model), optim)
    local = {n: spec_of(p).name for n, p, _ in canonical_params(model)}
    missing = sorted(g for g in local.values() if g not in weights)
    if missing:
        raise ValueError(f"weights do not match the model: missing {missing[:3]}")
    groups = adamw_template(model, train, train.lr)
    return ({n: weights[g] for n, g in local.items()},
            optimizer_state_from_names(
                model, {n: by_name[g] for n, g in local.items() if g in by_name}, groups))


def gather_full_state(engine: Engine, tp: TensorParallel | None, pipe: PipelineModel | None,
                      comm: Comm, train: TrainSection) -> State:
    """The layout-free state (see module docstring), on every rank."""
    weights, optim = engine.full_state()
    if tp is not None:
        weights, optim = tp.gather_state(engine.model, weights, optim)
    if pipe is not None:
        weights, optim = gather_pipeline_state(pipe.model, comm, train, weights, optim)
    return weights, optim


def load_full_state(engine: Engine, tp: TensorParallel | None, pipe: PipelineModel | None,
                    train: TrainSection, weights: dict[str, torch.Tensor],
                    optim: dict[str, Any]) -> None:
    """Give every technique its part of a layout-free state; ValueError on a mismatch."""
    if pipe is not None:
        weights, optim = select_pipeline_state(pipe.model, train, weights, optim)
    if tp is not None:
        weights, optim = tp.shard_state(engine.model, weights, optim)
    engine.load_full_state(weights, optim)
