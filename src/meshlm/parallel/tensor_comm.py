"""The communication of tensor and sequence parallelism, as autograd functions.

Megatron-LM's conjugate pairs (Shoeybi et al. 2019, fig. 3; Korthikanti et al. 2022, fig. 5),
over the mesh's ``tp`` axis. With activations laid out (batch, seq, hidden):

- ``copy_to_tp``      ("f")  forward identity          backward all-reduce
- ``reduce_from_tp``  ("g")  forward all-reduce        backward identity
- ``gather_seq``      ("g-bar" of SP) forward all-gather along seq, backward reduce-scatter
- ``scatter_seq``     ("g" of SP)     forward reduce-scatter along seq, backward all-gather
- ``gather_last``     forward all-gather along the last dim (vocab shards -> full logits), no
  gradient (generation only)

The collectives are ``meshlm.distributed.traceable`` custom ops, so a compiled block traces
through these functions without a graph break. Each moves one (b, s, h) activation per call (bytes in the comm log: ``4 b s h`` in fp32);
an all-reduce costs what an all-gather plus a reduce-scatter cost, which is why sequence
parallelism keeps the volume of plain tensor parallelism while sharding the activations
outside the attention and MLP blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..distributed import traceable
from ..distributed.comm import Comm

AXIS = "tp"


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:  # noqa: ANN001
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return traceable.all_reduce(grad, traceable.key_of(ctx.comm), AXIS), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:  # noqa: ANN001
        return traceable.all_reduce(x, traceable.key_of(comm), AXIS)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad, None


def _all_gather_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(b, s/t, h) on each rank -> (b, s, h), rank r's chunk at seq positions [r s/t, ...)."""
    t = comm.size(AXIS)
    b, s_local, h = x.shape
    out = traceable.all_gather(x, traceable.key_of(comm), AXIS)  # (t*b, s/t, h)
    return out.view(t, b, s_local, h).transpose(0, 1).reshape(b, t * s_local, h)


def _reduce_scatter_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(b, s, h) partial sums -> this rank's (b, s/t, h) chunk of the sum."""
    t = comm.size(AXIS)
    b, s, h = x.shape
    chunks = x.reshape(b, t, s // t, h).transpose(0, 1).contiguous()  # (t, b, s/t, h)
    return traceable.reduce_scatter(chunks.view(t * b, s // t, h), traceable.key_of(comm), AXIS)


def _conjugate(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function: ``forward(x, comm)`` forward, ``backward(grad, comm)`` backward."""

    def fwd(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:  # noqa: ANN001
        ctx.comm = comm
        return forward(x, comm)

    def bwd(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
        return backward(grad, ctx.comm), None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_GatherSeq = _conjugate("_GatherSeq", _all_gather_seq, _reduce_scatter_seq)
_ScatterSeq = _conjugate("_ScatterSeq", _reduce_scatter_seq, _all_gather_seq)


class _GatherSeqTwoWays(torch.autograd.Function):
    """One all-gather along seq, two consumers: a tp-sharded one and a replicated one.

    The first output feeds sharded work whose input gradients are partial sums (backward:
    reduce-scatter); the second feeds work replicated on every tp rank, whose input gradient
    is already whole and equal everywhere (backward: keep this rank's slice).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm):  # noqa: ANN001, ANN205
        ctx.comm, ctx.s_local = comm, x.shape[1]
        full = _all_gather_seq(x, comm)
        return full, full.view_as(full)

    @staticmethod
    def backward(ctx, g_sharded: torch.Tensor, g_replicated: torch.Tensor):  # noqa: ANN001, ANN205
        r = ctx.comm.rank(AXIS)
        grad = _reduce_scatter_seq(g_sharded.contiguous(), ctx.comm)
        grad += g_replicated[:, r * ctx.s_local : (r + 1) * ctx.s_local]
        return grad, None


def gather_seq_two_ways(x: torch.Tensor, comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
    return _GatherSeqTwoWays.apply(x, comm)


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _ReduceFromTP.apply(x, comm)


def gather_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _GatherSeq.apply(x, comm)


def scatter_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _ScatterSeq.apply(x, comm)


def gather_dim(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    """Concatenate every tp rank's shard of ``x`` along ``dim`` (no gradient)."""
    if comm.size(AXIS) == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()  # (n/t, ...)
    out = torch.empty((comm.size(AXIS) * moved.shape[0], *moved.shape[1:]), dtype=x.dtype,
                      device=x.device)
    comm.all_gather(out, moved, AXIS)
    return out.movedim(0, dim)


@torch.no_grad()
def gather_last(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Every rank's last-dim shard (e.g. vocab-parallel logits) concatenated, no gradient."""
    return gather_dim(x, -1, comm)
