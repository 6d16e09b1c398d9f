"""Extra training heads: modules a technique adds after the main model, which only training runs.

A head is registered once under a name (:func:`register_training_head`; the techniques' heads
are listed in ``models/training_heads.py``). ``Transformer`` builds every registered head from
its config and holds it as the attribute of that name -- None when the config adds none --
so the head's parameters are named ``{name}.*`` in state dicts and checkpoints. What the
generic code asks of a head (:class:`TrainingHead`):

- ``keep(h)``: a training forward hands it the last layer's output (before the final norm),
  which the head's own run reads (and drops) after the forward; evaluation, sampling and
  no-grad forwards hand it nothing;
- ``blocks()``: the decoder blocks it holds, by layer id (ids ``n_layers`` and up,
  ``ModelConfig.n_blocks`` counts them): tensor parallelism, expert parallelism and the MoE
  statistics treat them as the model's layers;
- ``reads_embedding``: it looks tokens up in the model's embedding table.

A head runs after the main model's head, so it lives on the last pipeline stage
(``parallel/pipeline.py``), with a copy of the embedding table there when it reads it (kept as
a tied head's copy is). Its loss is an extra training objective (``parallel/objective.py``),
its tensor-parallel plan is registered under its name (``parallel/tensor_plan.py``).

Communication: none. Memory: the heads' own (each states it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from .config import ModelConfig


class TrainingHead(Protocol):
    """What the generic code asks of an extra training head (an ``nn.Module``)."""

    reads_embedding: bool

    def keep(self, h: torch.Tensor) -> None: ...

    def blocks(self) -> dict[int, nn.Module]: ...


# A head's builder: (model config, ``block(layer_id)`` -> a decoder block) -> the head, or None
# when the config adds none.
HeadBuilder = Callable[["ModelConfig", Callable[[int], nn.Module]], nn.Module | None]
TRAINING_HEADS: dict[str, HeadBuilder] = {}


def register_training_head(name: str) -> Callable[[HeadBuilder], HeadBuilder]:
    """Decorator: register a head's builder under ``name`` (the model attribute it becomes)."""

    def add(build: HeadBuilder) -> HeadBuilder:
        if name in TRAINING_HEADS:
            raise ValueError(f"training head {name!r} is registered twice")
        TRAINING_HEADS[name] = build
        return build

    return add


__all__ = ["TRAINING_HEADS", "HeadBuilder", "TrainingHead", "register_training_head"]
