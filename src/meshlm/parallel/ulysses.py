"""All-to-all attention over the cp axis (DeepSpeed-Ulysses, Jacobs et al. 2023).

Each cp rank holds a contiguous chunk of the sequence, every head. Before attention one
all-to-all per tensor turns (B, H, s/cp, hd) sequence shards into (B, H/cp, s, hd) head shards:
rank j keeps heads ``[j H/cp, (j + 1) H/cp)`` of the whole sequence (query and KV heads are
split alike, so grouped-query heads stay with their KV head); attention then runs locally on
whole sequences, and one all-to-all turns the output back into sequence shards. Backward is
the same exchanges reversed (an all-to-all's gradient is the inverse all-to-all).

Needs cp to divide the (tensor-parallel local) query and KV head counts. Wins over the ring
when heads are plentiful and the all-to-all crosses fast links (inside a node): its volume per
rank falls with cp, the ring's does not; the ring wins when cp exceeds the KV heads, across
slow links (it hides its sends behind compute), and on memory (no rank holds a whole sequence).

Communication per attention layer and micro-batch (comm log, all-to-all input bytes, ``a``
bytes per activation element, ``t = b s/cp hd a``): forward q ``nh t`` + k ``nkv t`` + v
``nkv t`` + output ``nh t``; backward the same four. Memory: the whole sequence of H/cp
heads for q, k, v and the output: (2 nh + 2 nkv) b s hd / cp elements -- the same as the
sequence shards of all heads; the local kernel is the model's (``model.attention``): ``sdpa``
materialises no s x s scores when plain causal.
"""

from __future__ import annotations

import torch

from ..distributed.comm import Comm
from ..models.attention import SDPA, AttentionKernel

AXIS = "cp"


def seq_to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(B, H, s/n, hd) sequence shard -> (B, H/n, s, hd) head shard over the cp group."""
    n = comm.size(AXIS)
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # block j -> rank j
    recv = torch.empty_like(send)  # block j: our heads, sequence chunk j
    comm.all_to_all(recv, send, AXIS)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_seq(y: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(B, H/n, s, hd) head shard -> (B, H, s/n, hd) sequence shard (inverse of the above)."""
    n = comm.size(AXIS)
    b, h, s, d = y.shape
    send = y.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk j -> rank j
    recv = torch.empty_like(send)  # block j: rank j's heads of our chunk
    comm.all_to_all(recv, send, AXIS)
    return recv.transpose(0, 1).reshape(b, n * h, s // n, d)


class _Exchange(torch.autograd.Function):
    """One of the two all-to-alls; its gradient is the other one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, to_heads: bool) -> torch.Tensor:  # noqa: ANN001
        ctx.comm, ctx.to_heads = comm, to_heads
        return (seq_to_heads if to_heads else heads_to_seq)(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return (heads_to_seq if ctx.to_heads else seq_to_heads)(grad, ctx.comm), None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm,
                      doc_ids: torch.Tensor | None = None,
                      kernel: AttentionKernel | None = None) -> torch.Tensor:
    """Attention of (B, nh, s/cp, hd) queries on keys/values sharded like them, through
    ``kernel`` (default ``sdpa``) on whole sequences of 1/cp of the heads; ``doc_ids`` (B, s):
    the whole sequences' document ids (document masking)."""
    kernel = kernel if kernel is not None else SDPA()
    q, k, v = (_Exchange.apply(t, comm, True) for t in (q, k, v))
    # (whole sequences in order now: the kernel's own mask, window and documents included)
    out = kernel(q, k, v, *(() if doc_ids is None else (doc_ids,)))
    return _Exchange.apply(out, comm, False)
