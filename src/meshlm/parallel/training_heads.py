"""The parallel side of the extra training heads techniques add (``models/training_heads.py``),
listed once: importing this module registers each one's training objective in
``objective.OBJECTIVES`` and its tensor-parallel plan in ``tensor_plan.HEAD_PLANS``; the
objectives a run builds are looked up here (:func:`build_objectives`), so the step runners
and the trainer import this list and the techniques import only the registries.

- "mtp": multi-token prediction, ``parallel/multi_token.py``.

Communication and memory: none (each technique states its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from . import multi_token  # noqa: F401  (registers "mtp")
from .objective import OBJECTIVES, ExtraObjective

if TYPE_CHECKING:
    from ..distributed.comm import Comm
    from ..models.config import ModelConfig
    from ..models.llama import Transformer
    from .context import ContextParallel


def registered() -> dict[str, type[ExtraObjective]]:
    """Every registered objective, by name (the techniques' listed above among them)."""
    return OBJECTIVES


def build_objectives(cfg: ModelConfig, model: Transformer, loss_fn: Callable[..., torch.Tensor],
                     comm: Comm, cp: ContextParallel | None, device: torch.device
                     ) -> list[ExtraObjective]:
    """The objectives ``cfg`` enables, built for this rank's ``model`` and main loss."""
    return [cls(model, loss_fn, comm, cp, device) for cls in OBJECTIVES.values()
            if cls.enabled(cfg)]


def needs_target_docs(cfg: ModelConfig) -> bool:
    """Whether an objective ``cfg`` enables needs the targets' document ids."""
    return any(cls.target_docs and cls.enabled(cfg) for cls in OBJECTIVES.values())


__all__ = ["build_objectives", "needs_target_docs", "registered"]
