"""SwiGLU MLP and the dropless Mixture-of-Experts layer that can replace it.

MoE layer: a linear router scores every expert; softmax over all experts, keep the top k per
token and renormalise their weights to sum to 1 (Mixtral's routing). Each expert is a SwiGLU
MLP; all experts' weights are stacked in one tensor per projection (``w1: (E, F, H)``) so expert
parallelism can shard them along dim 0. Dropless: every token is processed by all of its k
experts, with no capacity limit (tokens are sorted by expert and each expert runs on its slice).
An optional shared expert sees every token (DeepSeek-MoE).

Load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4, generalised to top-k):
``coef * E * sum_i f_i * P_i`` with ``f_i`` the fraction of the T*k assignments that go to
expert i and ``P_i`` the mean router probability of expert i over the T tokens.

The layer hands its tokens to a *dispatcher* (``moe.dispatcher(moe, x)``): :class:`LocalDispatcher`
routes and runs every expert here; parallelism swaps in its own (tensor-parallel: experts
sharded by width; expert-parallel: tokens sent to the ranks owning their experts) without
changing this class.

Memory (one rank, no expert parallelism): ``E * 3 * H * F`` expert weights; activations of
``T * k`` routed token copies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

# (expert counts) -> (counts summed over the ranks holding shares of the tokens, their number)
CountReducer = Callable[[torch.Tensor], tuple[torch.Tensor, int]]


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` (Shazeer 2020); w1 = gate, w3 = up, w2 = down."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def route_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (probs (T, E), weights (T, k) summing to 1, expert ids (T, k))."""
    probs = logits.float().softmax(dim=-1)
    top_p, top_idx = probs.topk(k, dim=-1)
    weights = top_p / top_p.sum(dim=-1, keepdim=True)
    return probs, weights, top_idx


def load_balancing_loss(probs: torch.Tensor, top_idx: torch.Tensor, n_experts: int,
                        reduce_counts: CountReducer | None = None) -> torch.Tensor:
    """``E * sum_i f_i * P_i`` (unscaled; see module docstring).

    ``reduce_counts`` (context parallelism) sums the assignment counts over the ranks sharing
    the sequence and returns how many ranks that is: ``f`` is then the whole sequence's and
    the mean over those ranks of each one's loss is the whole sequence's loss.
    """
    t, k = top_idx.shape
    counts = torch.bincount(top_idx.reshape(-1), minlength=n_experts)
    ranks = 1
    if reduce_counts is not None:
        counts, ranks = reduce_counts(counts)
    f = counts.to(probs.dtype) / (t * k * ranks)  # fraction of assignments per expert
    p = probs.mean(dim=0)  # mean router probability per expert
    return n_experts * (f * p).sum()


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights; runs each expert on its contiguous token slice."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x_sorted (N, H) grouped by expert, ``counts[e]`` rows each -> (N, H)."""
        outs = []
        # Empty slices still run (0-row matmuls) so every expert weight gets a gradient.
        for e, chunk in enumerate(x_sorted.split(counts)):
            hidden = F.silu(chunk @ self.w1[e].t()) * (chunk @ self.w3[e].t())  # (n_e, F)
            outs.append(hidden @ self.w2[e].t())  # (n_e, H)
        return torch.cat(outs, dim=0)


class LocalDispatcher:
    """Route the tokens and run every expert on this rank (no communication)."""

    def __call__(self, moe: MoE, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, H)
        weights, top_idx = moe.route(x)
        return moe.combine(x, weights, top_idx).reshape(shape)


class MoE(nn.Module):
    """Top-k routed experts plus optional shared experts; stores its aux loss per forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.topk, self.coef = cfg.moe_experts, cfg.moe_topk, cfg.moe_aux_loss_coef
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.dim, cfg.expert_hidden)
        self.shared = (
            SwiGLU(cfg.dim, cfg.expert_hidden * cfg.moe_shared_experts)
            if cfg.moe_shared_experts
            else None
        )
        self.last_aux_loss: torch.Tensor | None = None
        self.dispatcher = LocalDispatcher()
        self.reduce_counts: CountReducer | None = None  # set by context parallelism

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (T, H) -> (weights (T, k), expert ids (T, k)); records the aux loss."""
        probs, weights, top_idx = route_topk(self.router(x), self.topk)
        self.last_aux_loss = self.coef * load_balancing_loss(probs, top_idx, self.n_experts,
                                                             self.reduce_counts)
        return weights, top_idx

    def combine(self, x: torch.Tensor, weights: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
        """Sum over each token's k experts of weight * expert(token), plus the shared expert."""
        flat = top_idx.reshape(-1)  # (T*k,) expert of each assignment
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        token_of = order // self.topk  # (T*k,) source token of each sorted assignment
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        out_sorted = self.experts(x[token_of], counts)  # (T*k, H)
        gate = weights.reshape(-1)[order].unsqueeze(-1).to(out_sorted.dtype)
        y = torch.zeros_like(x).index_add_(0, token_of, (out_sorted * gate).to(x.dtype))
        if self.shared is not None:
            y = y + self.shared(x)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H) -> (B, S, H) through this layer's dispatcher."""
        return self.dispatcher(self, x)
