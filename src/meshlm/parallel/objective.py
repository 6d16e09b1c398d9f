"""Extra training objectives: losses a technique adds to the main model's, in every layout.

An objective is a class registered once (:func:`register_objective`; the techniques' are listed
in ``parallel/training_heads.py``), built per run when its ``enabled(model_cfg)`` says the
model has it (``training_heads.build_objectives``). The step runners (``train/steps.py``,
``train/pipelined.py``) and the pipeline executor (``parallel/pipeline.py``) use each built
objective alike, naming none:

- once per step, ``prepare(micro)`` on this rank's micro-batches (its targets, weights and
  normalisation; it may communicate, and states what);
- per micro-batch, after the model's training forward and inside the same ``packed`` block,
  ``objective(prepared[i])``: a scalar loss (this rank's share); the micro-batch's objective
  adds ``weight`` times it, and the MoE aux losses of its ``layer_ids()`` (the blocks it
  runs; without pipeline stages every block's aux loss is added anyway);
- its metric ``{name}_loss``: the mean of its loss over the global batch -- the mean over the
  step's micro-batches summed on the device and read with the main loss (no extra host
  read), then one all-reduce over dp x cp per step for all objectives together (under pp,
  the last stage's sums travel with the loss's all-reduce over pp). The progress line shows
  it as ``{name} <value>``;
- ``target_docs``: under document masking its micro-batches need the targets' document ids
  too (the sampler's ``target_docs``, asked once for all objectives:
  ``training_heads.needs_target_docs``).

Under pp an objective runs on the last stage only (it reads a training head there,
``models/heads.py``); every stage builds it for the record's collective.

Communication and memory: the objectives' own (each states them); none added here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ..distributed.comm import Comm

if TYPE_CHECKING:
    from ..models.config import ModelConfig
    from ..models.llama import Transformer
    from .context import ContextParallel


class ExtraObjective(Protocol):
    """A built extra training objective (see the module docstring)."""

    name: ClassVar[str]
    target_docs: ClassVar[bool]
    weight: float

    @staticmethod
    def enabled(cfg: ModelConfig) -> bool: ...

    def __init__(self, model: Transformer, loss_fn: Callable[..., torch.Tensor], comm: Comm,
                 cp: ContextParallel | None, device: torch.device) -> None: ...

    def prepare(self, micro: list[tuple[torch.Tensor, ...]]) -> list[Any]: ...

    def __call__(self, prepared: Any) -> torch.Tensor: ...

    def layer_ids(self) -> list[int]: ...


OBJECTIVES: dict[str, type[ExtraObjective]] = {}


def register_objective(cls: type[ExtraObjective]) -> type[ExtraObjective]:
    """Class decorator: register an extra training objective under its ``name``."""
    if cls.name in OBJECTIVES:
        raise ValueError(f"training objective {cls.name!r} is registered twice")
    OBJECTIVES[cls.name] = cls
    return cls


def metric(name: str) -> str:
    """The metrics record's key of objective ``name``."""
    return f"{name}_loss"


__all__ = ["OBJECTIVES", "ExtraObjective", "metric", "register_objective"]
