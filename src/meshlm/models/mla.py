"""Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024, sec. 2.1; DeepSeek-V3).

Keys and values come from one compressed latent per token instead of per-head projections of
the hidden state; queries optionally from a latent of their own:

    c_q  = q_a_norm(wq_a x)                     (q_lora_rank; or q = wq x directly)
    q    = wq_b c_q                              (n_heads x [nope | rope])
    [c_kv | k_r] = wkv_a x                      (kv_lora_rank + rope)
    [k_nope | v] = wkv_b kv_a_norm(c_kv)         (n_heads x [nope | v])
    k    = [k_nope | RoPE(k_r)]                  (the rotary key shared by all heads)
    out  = wo softmax(s [q_nope | RoPE(q_r)] k^T + M) v

with ``s = (nope + rope)^-0.5``, times YaRN's ``mscale(f, m_all)^2`` when the context is
stretched (``models/rope.py``: :func:`~meshlm.models.rope.score_scale`). Parameter names are
those of DeepSeek-V3's own reference (``wq``/``wq_a``/``q_a_norm``/``wq_b``, ``wkv_a``/
``kv_a_norm``/``wkv_b``, ``wo``); each head's output features are contiguous. The latent
norms' epsilon is 1e-6 whatever ``model.norm_eps`` says, as in DeepSeek's reference and
Hugging Face's port (``RMSNorm(q_lora_rank)`` with its default).

Rotary convention: meshlm's rotate-half (pair i with i + d/2). Hugging Face's DeepSeek-V3
(``rope_interleave``) pairs (2i, 2i + 1); the two agree once the rotary output rows of a
weight are reordered even-first (:func:`interleaved_to_half`, and back
:func:`half_to_interleaved`): the HF checkpoint conversion applies the same order to ``wq`` /
``wq_b`` (each head's rope rows) and ``wkv_a`` (its last rope rows), as a row permutation
(``models/mla_hf.py``'s ``interleaved_rows``).

The attention core is the layer's ``kernel`` slot, as in ``Attention`` (``models/llama.py``):
(B, nh, S, nope + rope) queries and keys, (B, nh, S, v) values, so the registered kernels,
context parallelism, recomputation and compilation compose around it unchanged.

The layer is registered as "mla" (``layers.ATTENTION_LAYERS``, listed in
``models/attention_layers.py``): ``ModelConfig.attention_layer`` names it when
``model.kv_lora_rank`` > 0, and every decoder block then holds one. It declares its matmul
linears (``linears``: all of them, the down-projections included, compute in float8 under
``precision.dtype=fp8``). YaRN's softmax-scale correction
(:func:`~meshlm.models.rope.score_scale`) is applied here, folded into the queries; the rotary
tables are ``qk_rope_head_dim`` wide (``ModelConfig.rope_dim``).

Tensor parallelism (``parallel/mla_tp.py``, the plan registered for "mla") splits the heads:
``wq`` / ``wq_b`` / ``wkv_b`` column parallel, ``wo`` row parallel; the down-projections
``wq_a``, ``wkv_a`` and their norms are replicated and computed on whole tokens by every tp
rank. Two slots carry that: ``whole_input`` (the layer's input made whole, its gradient already
whole: identity, or the sequence-parallel all-gather) and ``latent_input`` (what the latents --
and ``x`` for ``wq`` -- pass before the per-head projections: identity, or tp's copy whose
backward all-reduces the heads' partial gradients).

Communication: none here (the slots' and the kernel's). Memory per layer and token
(activations kept, besides the kernel's): the latents ``q_lora + kv_lora + rope``, queries and
keys ``nh (nope + rope)`` each, values ``nh v``; parameters
``h q_lora + q_lora nh (nope + rope) + h (kv_lora + rope) + kv_lora nh (nope + v) + nh v h``
(``h nh (nope + rope)`` for ``wq`` without the query latent) plus the two norms.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import KernelSlot, RMSNorm, apply_rope, register_attention_layer
from .rope import score_scale

LATENT_NORM_EPS = 1e-6  # (DeepSeek's reference and HF: the latent norms' default epsilon)


def _rope_order(rope: int) -> torch.Tensor:
    """Rotary rows even-first: half-convention row j is interleaved row ``order[j]``."""
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def interleaved_to_half(w: torch.Tensor, n_heads: int, nope: int, rope: int) -> torch.Tensor:
    """``w`` (rows: ``n_heads`` blocks of ``nope`` plain then ``rope`` rotary output features,
    dim 0) with each block's rotary rows reordered from Hugging Face DeepSeek's interleaved
    pairs (2i, 2i + 1) to meshlm's rotate-half pairs (i, i + rope/2).

    Query weights: ``interleaved_to_half(w, n_heads, qk_nope, qk_rope)``; ``wkv_a``:
    ``interleaved_to_half(w, 1, kv_lora_rank, qk_rope)``. A vector of rows (a bias) works too.
    """
    if w.shape[0] != n_heads * (nope + rope) or rope % 2:
        raise ValueError(f"{tuple(w.shape)} rows are not {n_heads} heads of {nope} + {rope} "
                         "(an even rotary part)")
    blocks = w.reshape(n_heads, nope + rope, *w.shape[1:])
    rot = blocks[:, nope:].index_select(1, _rope_order(rope).to(w.device))
    return torch.cat([blocks[:, :nope], rot], dim=1).reshape(w.shape)


def half_to_interleaved(w: torch.Tensor, n_heads: int, nope: int, rope: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_half` (export to Hugging Face)."""
    if w.shape[0] != n_heads * (nope + rope) or rope % 2:
        raise ValueError(f"{tuple(w.shape)} rows are not {n_heads} heads of {nope} + {rope} "
                         "(an even rotary part)")
    blocks = w.reshape(n_heads, nope + rope, *w.shape[1:])
    inverse = torch.argsort(_rope_order(rope)).to(w.device)
    rot = blocks[:, nope:].index_select(1, inverse)
    return torch.cat([blocks[:, :nope], rot], dim=1).reshape(w.shape)


class Latents(nn.Module):
    """The default ``latent_input``: the latents as they are (one process)."""

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return xs


@register_attention_layer("mla")
class MultiHeadLatentAttention(KernelSlot):
    """Multi-head latent attention (module docstring) with the attention core ``kernel``."""

    linears = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        nh, self.nope, self.rope, self.v_dim = (cfg.n_heads, cfg.qk_nope_head_dim,
                                                cfg.qk_rope_head_dim, cfg.v_head_dim)
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, nh * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, nh * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, nh * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(nh * self.v_dim, cfg.dim, bias=False)
        # the softmax scale beyond the kernel's (nope + rope)^-0.5, folded into the queries
        self.score_scale = score_scale(cfg)
        # tensor parallelism's slots (module docstring); identities on one process
        self.whole_input: nn.Module = nn.Identity()
        self.latent_input: nn.Module = Latents()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *doc_ids: torch.Tensor) -> torch.Tensor:
        """``x`` (B, S, h) (a sequence shard under sequence parallelism); ``cos``, ``sin``:
        the rotary tables of the positions attention sees; ``doc_ids``: document masking."""
        x = self.whole_input(x)
        b, s, _ = x.shape
        c_kv, k_r = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_norm(c_kv)  # (B, S, kv_lora)
        if self.q_lora_rank:
            c_q, c_kv, k_r = self.latent_input(self.q_a_norm(self.wq_a(x)), c_kv, k_r)
            q = self.wq_b(c_q)
        else:
            x, c_kv, k_r = self.latent_input(x, c_kv, k_r)
            q = self.wq(x)
        # Head counts are read from the weights so tensor parallelism can shard them.
        q = q.view(b, s, -1, self.nope + self.rope).transpose(1, 2)  # (B, nh, S, nope+rope)
        kv = self.wkv_b(c_kv).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)
        nh = q.shape[1]
        k_r = apply_rope(k_r.unsqueeze(1), cos, sin)  # (B, 1, S, rope): one for all heads
        q = torch.cat([q[..., :self.nope], apply_rope(q[..., self.nope:], cos, sin)], dim=-1)
        if self.score_scale != 1.0:
            q = q * self.score_scale
        k = torch.cat([kv[..., :self.nope], k_r.expand(b, nh, s, self.rope)], dim=-1)
        v = kv[..., self.nope:]  # (B, nh, S, v)
        out = self.kernel(q, k, v, *doc_ids)  # (B, nh, S, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (B, S, nh*v) -> (B, S, h)


__all__ = ["LATENT_NORM_EPS", "Latents", "MultiHeadLatentAttention", "half_to_interleaved",
           "interleaved_to_half"]
