"""Attention of one query block on one key/value block, with its log-sum-exp, and their merge.

Ring attention (Liu et al. 2023) computes a rank's queries against one key/value block at a
time. Each block yields a partial output ``o_b`` normalised over its own keys and the row-wise
log-sum-exp ``l_b`` of its scores; partials combine exactly by the online-softmax rule
(Milakov & Gimelshein 2018; FlashAttention):

    l = log(exp(l_a) + exp(l_b)),   o = o_a exp(l_a - l) + o_b exp(l_b - l).

Backward of a block needs only the *final* output and log-sum-exp of its query rows:
``P = exp(q k^T scale - l)`` is then the block's share of the global softmax, and
``dS = P (dO v^T - rowsum(dO o))`` gives the block's dq, dk, dv.

Two implementations, same maths, grouped-query heads (``nh`` a multiple of ``nkv``) on both;
they are the block paths of the attention kernels ``sdpa`` (``flash`` on CPU) and ``eager``
(``math``) of :mod:`.attention`, not kernels of their own:

- ``flash``: ATen's fused CPU kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its
  backward). Scores are never materialised: memory O(block rows x head dim). It takes one head
  size: value heads narrower than the query/key heads (an attention layer may have them) are
  zero-padded to their width -- zero output columns, sliced off -- and the reverse.
- ``math``: explicit matmuls in fp32; materialises one block of scores per head,
  (B, nh, s_q, s_k). Used on every other device (GPU-only path: the CUDA flash kernels'
  log-sum-exp outputs are not wired; untested here) and as a reference on CPU.

``causal`` masks the upper triangle of a square block (queries and keys at the same
positions). ``allowed`` (B, s_q, s_k), when given, is the whole mask of the block (document
masking: same document, and causal on a diagonal block); it runs the ``math`` kernel, and a
query row with no allowed key gets output 0 and log-sum-exp -inf, which :func:`merge` then
ignores. No communication.
"""

from __future__ import annotations

import math

import torch


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a contiguous last dimension (a copy only when it has none)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _widened(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` zero-padded to ``d`` features (the fused kernel takes one head size for q, k, v)."""
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def _grouped(q: torch.Tensor, nkv: int) -> torch.Tensor:
    """(B, nh, S, d) -> (B, nkv, nh/nkv, S, d): query heads grouped by their KV head."""
    b, nh, s, d = q.shape
    return q.reshape(b, nkv, nh // nkv, s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 scores (B, nkv, g, s_q, s_k), causal (or not ``allowed``) entries masked to -inf."""
    s = torch.matmul(_grouped(q.float(), k.shape[1]), k.float().unsqueeze(2).transpose(-1, -2))
    s.mul_(scale)
    if allowed is not None:
        s.masked_fill_(~allowed[:, None, None], float("-inf"))
    elif causal:
        n = s.shape[-1]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  kernel: str = "flash", allowed: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (B, nh, s_q, d) in q's dtype, log-sum-exp (B, nh, s_q) fp32) of one block."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if allowed is not None:
        s = _scores(q, k, causal, scale, allowed)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0))  # (empty rows: 0)
        out = torch.matmul(p, v.float().unsqueeze(2))
        return out.flatten(1, 2).to(q.dtype), lse.squeeze(-1).flatten(1, 2)
    if kernel == "flash":
        # (strided views are read in place: the kernel takes any strides but the last; value
        # heads of another width than the queries' are zero-padded to one width)
        d, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _rows(_widened(q, d)), _rows(_widened(k, d)), _rows(_widened(v, d)), 0.0, causal,
            scale=scale)
        return out[..., :dv], lse.float()
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse)
    out = torch.matmul(p, v.float().unsqueeze(2))  # (B, nkv, g, s_q, d)
    return out.flatten(1, 2).to(q.dtype), lse.squeeze(-1).flatten(1, 2)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, kernel: str = "flash",
                   allowed: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block, given the final output and log-sum-exp of its query rows."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if kernel == "flash" and allowed is None:
        d, dqk, dv = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(_rows(_widened(t, d)) for t in (dout, q, k, v, out)), lse.contiguous(), 0.0,
            causal, scale=scale)
        return gq[..., :dqk], gk[..., :dqk], gv[..., :dv]
    nkv = k.shape[1]
    p = torch.exp(_scores(q, k, causal, scale, allowed) - _grouped(lse.unsqueeze(-1), nkv))
    do = _grouped(dout.float(), nkv)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)  # (B, nkv, s_k, d)
    dp = torch.matmul(do, v.float().unsqueeze(2).transpose(-1, -2))
    delta = (do * _grouped(out.float(), nkv)).sum(-1, keepdim=True)
    ds = p.mul_(dp.sub_(delta)).mul_(scale)
    dq = torch.matmul(ds, k.float().unsqueeze(2)).flatten(1, 2)
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q.float(), nkv)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> None:
    """Fold one block's (output, log-sum-exp) into the fp32 running ``out``, ``lse`` in place.

    Rows still without any allowed key (both -inf: document masking) stay 0 and -inf."""
    new = torch.logaddexp(lse, block_lse)
    ref = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - ref).unsqueeze(-1))
    lse.copy_(new)
