"""Activation recomputation (``train.recompute``): keep fewer activations, recompute in backward.

- ``full``: each decoder layer runs under ``torch.utils.checkpoint`` (non-reentrant): only the
  layer's input is kept; backward re-runs the whole layer before its gradients (Chen et al.
  2016; Megatron-LM ``--recompute-granularity full``).
- ``selective``: only the attention core (SDPA, or the context-parallel ring / all-to-all
  attention that replaced it) is recomputed -- its output and log-sum-exp (the score matrix
  with eager attention) are not kept (Korthikanti et al. 2022, sec. 5).
- ``op``: each dense layer runs under selective activation checkpointing with torchtitan's
  op-level policy: the outputs of every other matmul (the 1st, 3rd, ... in forward order) and
  of the attention kernel are saved, everything else recomputed. MoE layers (their routed
  matmuls have data-dependent shapes) get ``selective``, as the planner counts them.

Each mode is a registered choice (``registry.RECOMPUTE``, a :class:`Recompute` plan); the plan
is applied with the other choices in one place (``extensions.apply_choices``): the attention
kernel wrapped in :class:`Checkpointed` (printed as such), the layer run through
:func:`checkpointed` (``Block.run_layer``; its repr names the mode).

Replays compute exactly what the first forward computed, collectives included (a
tensor-parallel region's all-reduce or all-gather, an expert all-to-all, a ring exchange run
again in backward); once-per-forward effects (router statistics, tile counters) are skipped
through :func:`meshlm.models.replay.replaying`. Gradients are identical to no recomputation.

Memory: the activations the planner's ``recomputed`` counts per layer and micro-batch (full:
the layer input), plus, transiently in backward, one layer's full activations being rebuilt.
Compute: full costs one more forward of every layer (~ +33 % of a step's FLOPs); selective
the attention core again; op about half of the matmuls again.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ..models.replay import replay
from .registry import RECOMPUTE

_MM = torch.ops.aten.mm.default
# attention kernels whose outputs op-level recomputation keeps (the CPU and CUDA SDPA kernels)
_ATTENTION_OPS = tuple(
    getattr(torch.ops.aten, name).default for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name))


class _Replayed:
    """The function handed to ``checkpoint``: its first call is the forward, later ones are
    recomputations (run under :func:`~meshlm.models.replay.replay`)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced into a compiled block: AOTAutograd
            return self.fn(*args)  # recomputes from the graph, never calling this again
        self.calls += 1
        if self.calls == 1:
            return self.fn(*args)
        with replay():
            return self.fn(*args)


def _op_policy() -> Callable[[], Any]:
    """torchtitan's op-level policy: save every other matmul output and the attention
    kernel's outputs; the counting restarts for the recomputation, so both passes agree."""

    def context_fn() -> Any:
        counts: dict[bool, int] = defaultdict(int)

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if op == _MM:
                counts[ctx.is_recompute] += 1
                keep = counts[ctx.is_recompute] % 2 == 1
            else:
                keep = op in _ATTENTION_OPS
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def checkpointed(fn: Callable[..., torch.Tensor], context_fn: Callable[[], Any] | None = None
                 ) -> Callable[..., torch.Tensor]:
    """``fn`` recomputed in backward (when gradients are being recorded)."""

    @functools.wraps(fn)
    def run(*args: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return fn(*args)
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(_Replayed(fn), *args, use_reentrant=False, **extra)

    return run


class Checkpointed(nn.Module):
    """An attention kernel whose output is not kept: recomputed in backward (selective)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.inner(*args)
        return checkpoint(_Replayed(self.inner), *args, use_reentrant=False)


@dataclass(frozen=True)
class Recompute:
    """What one mode recomputes: the attention kernel, or the whole layer (under a selective
    ``policy`` -- a ``context_fn`` factory -- or none: everything); ``moe``: the mode used
    instead on a MoE layer."""

    name: str
    kernel: bool = False
    layer: bool = False
    policy: Callable[[], Callable[[], Any]] | None = None
    moe: str | None = None

    def for_layer(self, moe: bool) -> Recompute:
        return RECOMPUTE[self.moe] if moe and self.moe else self

    def run_layer(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor] | None:
        """How a layer computing ``fn`` runs under this plan (None: ``fn`` is not wrapped)."""
        if not self.layer:
            return None
        return checkpointed(fn, self.policy() if self.policy is not None else None)


RECOMPUTE.register("none", Recompute("none"))
RECOMPUTE.register("selective", Recompute("selective", kernel=True))
RECOMPUTE.register("op", Recompute("op", layer=True, policy=_op_policy, moe="selective"))
RECOMPUTE.register("full", Recompute("full", layer=True))
