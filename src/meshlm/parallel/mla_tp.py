"""Multi-head latent attention (``models/mla.py``) under tensor and sequence parallelism: the
plan ``parallel/tensor.py`` applies to a layer registered as "mla" (``ATTENTION_PLANS``).

The heads are split as grouped-query attention's are (``wq`` / ``wq_b`` / ``wkv_b`` column
parallel, ``wo`` row parallel), while the down-projections ``wq_a``, ``wkv_a`` and their norms
are replicated, computed by every tp rank on whole tokens (DeepSeek-V3: about 8 % of the
layer's attention matmuls, repeated t times). The region's entrance moves to the latents, through
the layer's two slots:

- ``whole_input``: the layer's input passes no ``f``; with sp, an all-gather along the sequence
  whose backward keeps this rank's chunk (:class:`WholeInput`: the replicated work's gradient is
  already whole and equal on every tp rank, so no reduce-scatter);
- ``latent_input``: the latents (and ``x`` for ``wq`` without a query latent) pass one ``f``
  together (:class:`TensorParallelLatents`);

the output passes ``g`` as usual (all-reduce, or with sp a reduce-scatter along the sequence).

Communication per layer and micro-batch: forward the output's all-reduce of ``b s h`` (sp: its
reduce-scatter, plus the input's all-gather of ``b s h``); backward one all-reduce of
``b s (q_lora + kv_lora + rope)`` values (``b s (h + kv_lora + rope)`` with ``wq``) for the
latents (sp: plus the all-gather of ``b s h`` that is the output reduce-scatter's backward),
nothing for the input with or without sp. The planner's account is ``models/mla_cost.py``
(``latent_entry``). Memory per rank: the heads' weights / t, the down-projections and latent
norms whole; the latents (``q_lora + kv_lora + rope`` per token) are held by every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.comm import Comm
from ..models.layers import KernelSlot
from ..models.mla import MultiHeadLatentAttention
from .tensor_comm import AXIS, _all_gather_seq, _conjugate, copy_to_tp
from .tensor_plan import (
    COLUMN,
    ROW,
    _region_hooks,
    _shard,
    _take_seq_shard,
    register_attention_plan,
)

# (parameter, sharded dim) inside the layer: the per-head projections; wq_a, wkv_a and the
# latent norms stay replicated
MLA_PLAN: list[tuple[str, int]] = [
    ("wq.weight", COLUMN), ("wq_b.weight", COLUMN), ("wkv_b.weight", COLUMN), ("wo.weight", ROW),
]

# all-gather along seq, backward: this rank's chunk (the consumers are replicated)
_GatherSeqWhole = _conjugate("_GatherSeqWhole", _all_gather_seq, _take_seq_shard)


class WholeInput(nn.Module):
    """``whole_input`` under sequence parallelism: the layer's (B, S/t, h) input all-gathered
    to (B, S, h); the replicated down-projections that read it give a gradient that is whole
    and equal on every tp rank, so backward keeps this rank's chunk (no reduce-scatter)."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherSeqWhole.apply(x, self.comm)

    def extra_repr(self) -> str:
        return f"all-gather seq, tp={self.comm.size(AXIS)}"


class TensorParallelLatents(nn.Module):
    """``latent_input`` under tp: the latents (and ``x`` for ``wq``) enter the heads' region
    through one ``f`` of their concatenation -- identity forward, backward one all-reduce of
    the heads' partial gradients, ``b s (q_lora + kv_lora + rope)`` values
    (``b s (h + kv_lora + rope)`` with ``wq``)."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        joint = copy_to_tp(torch.cat(xs, dim=-1), self.comm)
        return joint.split([x.shape[-1] for x in xs], dim=-1)

    def extra_repr(self) -> str:
        return f"copy_to_tp, tp={self.comm.size(AXIS)}"


def mla_region(att: KernelSlot, comm: Comm, sp: bool) -> None:
    """Multi-head latent attention as a tp region (module docstring)."""
    assert isinstance(att, MultiHeadLatentAttention)
    params = dict(att.named_parameters())
    for name, dim in MLA_PLAN:
        if name in params:  # (wq without a query latent, wq_b with one)
            _shard(params[name], dim, comm)
    att.whole_input = WholeInput(comm) if sp else nn.Identity()
    att.latent_input = TensorParallelLatents(comm)
    _region_hooks(att, comm, sp, enter=False)


register_attention_plan("mla", mla_region)

__all__ = ["MLA_PLAN", "TensorParallelLatents", "WholeInput", "mla_region"]
