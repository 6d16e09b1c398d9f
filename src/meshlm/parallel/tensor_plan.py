"""The pieces a tensor-parallel plan is built from, and the registries of plans: what
``parallel/tensor.py`` applies and what a technique's own plan (an attention layer's, an extra
training head's) uses, so the technique imports this module and not ``tensor.py``.

- :func:`_shard`: keep this rank's slice of a weight along a dim (column parallel: ``COLUMN``,
  output features; row parallel: ``ROW``, input features), recorded in its shard spec;
- :func:`_region_hooks`: a module as a tp region -- input through ``f`` (identity forward,
  all-reduce backward; sp: all-gather along seq, backward reduce-scatter), output through
  ``g`` (all-reduce forward; sp: reduce-scatter);
- :class:`RegionInput`: one column-parallel linear's input made whole (``f`` or the all-gather);
- :class:`SequenceParallelRMSNorm`: a replicated norm whose weight gradient is all-reduced
  over tp (each rank's covers its own tokens or heads);
- :func:`_take_seq_shard`: this rank's sequence chunk of a gradient that is whole on every rank;
- :data:`ATTENTION_PLANS` (by ``KernelSlot.layer_name``) and :data:`HEAD_PLANS` (by the
  training head's name): the plans, registered with :func:`register_attention_plan` and
  :func:`register_head_plan`; ``tensor.py`` looks them up.

Communication: as each piece states, per micro-batch; memory: the sharded weights / t.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..distributed.comm import Comm
from ..distributed.spec import set_spec, spec_of
from ..models.layers import KernelSlot, RMSNorm, rms_norm
from .tensor_comm import AXIS, copy_to_tp, gather_seq, reduce_from_tp, scatter_seq

COLUMN, ROW = 0, 1


def _shard(p: nn.Parameter, dim: int, comm: Comm, padded: int | None = None) -> None:
    """Keep this rank's slice of ``p`` along ``dim`` (zero-padded to ``padded`` first) and
    record it in the parameter's shard spec."""
    spec = spec_of(p).shard(AXIS, dim, comm.rank(AXIS), comm.size(AXIS), padded)
    p.data = spec.take(p.data).contiguous()
    set_spec(p, spec)


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm on a sequence shard; the weight's gradient is all-reduced over tp."""

    def __init__(self, norm: RMSNorm, comm: Comm) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight, self.comm = norm.weight, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, copy_to_tp(self.weight, self.comm), self.eps)


class RegionInput(nn.Module):
    """The input of a column-parallel linear made whole on every tp rank: the
    sequence-parallel all-gather (backward: reduce-scatter), or the copy into the tp region
    (backward: all-reduce of the partial input gradient). The LM head's input (column
    parallel over the vocabulary) and the column-parallel linears of training heads pass it."""

    def __init__(self, comm: Comm, sp: bool) -> None:
        super().__init__()
        self.comm, self.sp = comm, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_seq(x, self.comm) if self.sp else copy_to_tp(x, self.comm)

    def extra_repr(self) -> str:
        return f"{'gather_seq' if self.sp else 'copy_to_tp'}, tp={self.comm.size(AXIS)}"


def _region_hooks(module: nn.Module, comm: Comm, sp: bool, enter: bool = True) -> None:
    """Input through f (or all-gather along seq) when ``enter``, output through g (or
    reduce-scatter)."""

    def pre(mod: nn.Module, args: tuple) -> tuple:
        x = gather_seq(args[0], comm) if sp else copy_to_tp(args[0], comm)
        return (x, *args[1:])

    def post(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return scatter_seq(out, comm) if sp else reduce_from_tp(out, comm)

    if enter:
        module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _take_seq_shard(grad: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's sequence chunk of a gradient that is whole and equal on every tp rank."""
    s_local = grad.shape[1] // comm.size(AXIS)
    r = comm.rank(AXIS)
    return grad[:, r * s_local : (r + 1) * s_local].contiguous()


# An attention layer's tensor-parallel plan, by the layer's name (KernelSlot.layer_name):
# shards its weights (_shard, recording their specs) and makes it a tp region in place.
AttentionPlan = Callable[[KernelSlot, Comm, bool], None]
ATTENTION_PLANS: dict[str, AttentionPlan] = {}  # ("gqa": tensor.py's own)


def register_attention_plan(name: str, plan: AttentionPlan) -> AttentionPlan:
    """Register the tensor-parallel plan of the attention layer registered as ``name``."""
    if name in ATTENTION_PLANS:
        raise ValueError(f"tensor-parallel plan of attention layer {name!r} is registered twice")
    ATTENTION_PLANS[name] = plan
    return plan


# An extra training head's tensor-parallel plan (``models/heads.py``), by the head's name:
# shards its own weights in place; its decoder blocks are sharded as the model's layers are.
HeadPlan = Callable[[nn.Module, Comm, bool], None]
HEAD_PLANS: dict[str, HeadPlan] = {}


def register_head_plan(name: str, plan: HeadPlan) -> HeadPlan:
    """Register the tensor-parallel plan of the training head registered as ``name``."""
    if name in HEAD_PLANS:
        raise ValueError(f"tensor-parallel plan of training head {name!r} is registered twice")
    HEAD_PLANS[name] = plan
    return plan


__all__ = ["ATTENTION_PLANS", "COLUMN", "HEAD_PLANS", "ROW", "AttentionPlan", "HeadPlan",
           "RegionInput", "SequenceParallelRMSNorm", "register_attention_plan",
           "register_head_plan"]
