"""SwiGLU MLP and the Mixture-of-Experts layer that can replace it.

MoE layer: a linear router scores every expert; softmax over all experts, keep the top k per
token and renormalise their weights to sum to 1 (Mixtral's routing). Each expert is a SwiGLU
MLP; all experts' weights are stacked in one tensor per projection (``w1: (E, F, H)``) so expert
parallelism shards them along dim 0. Dropless by default: every token is processed by all of
its k experts (token copies are sorted by expert and each expert runs on its slice). An
optional shared expert sees every token (DeepSeek-MoE).

Capacity (``moe_capacity`` = c > 0, Switch/GShard): each expert takes at most
``ceil(c * S * k / E)`` copies of each sequence (of S tokens here), the first in sequence order;
later copies are dropped (the token keeps its residual). Every expert then runs on exactly
``B * capacity`` rows (empty slots are zero rows): fixed shapes, and under expert parallelism
fixed all-to-all splits.

Load balancing (``moe_balance``):

- ``aux``: Switch Transformer's loss (Fedus et al. 2021, eq. 4, generalised to top-k),
  ``coef * E * sum_i f_i * P_i``, ``f_i`` the fraction of the T*k assignments that go to expert
  i and ``P_i`` the mean router probability of expert i. ``f`` is counted over the *global
  micro-batch* -- this micro-batch of every data-parallel rank -- by ``reduce_counts`` (an
  all-reduce over dp x cp), and P over this rank's tokens; the mean over those ranks of their
  losses is then the loss of the global micro-batch, whatever the layout (Megatron-Core's
  global auxiliary loss). One process with ``micro_batch`` = dp x micro_batch computes the same.
- ``seq_aux``: the same per sequence, averaged over sequences (DeepSeek-V3's sequence-wise
  balance loss): independent of any batch split; context parallelism sums a sequence's counts
  over its cp shares (``reduce_seq_counts``).
- ``bias``: auxiliary-loss-free balancing (DeepSeek-V3, Wang et al. 2024): a per-expert bias is
  added to the router probabilities for the top-k *selection* only (gate weights stay the
  probabilities of the chosen experts); after each step ``b_i += rate * sign(mean load - load_i)``
  with the loads of the whole global batch (:meth:`MoE.update_bias`). No loss term.

The layer hands its tokens to a *dispatcher* (``moe.dispatcher(moe, x)``): :class:`LocalDispatcher`
routes and runs the experts here; tensor parallelism swaps in its own (experts sharded by
width). The expert computation on the sorted token copies goes through ``moe.exchange`` when it
is set: expert parallelism sends the copies to the ranks owning their experts and back.

Memory (one rank, no expert parallelism): ``E * 3 * H * F`` expert weights; activations of
``T * k`` routed token copies. Router statistics (:class:`RouterStats`): ``E + 3`` numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .replay import replaying

# (expert counts) -> (counts summed over the ranks holding shares of the tokens, their number)
CountReducer = Callable[[torch.Tensor], tuple[torch.Tensor, int]]


class Exchange(Protocol):
    """Runs the experts on token copies sorted by expert (expert parallelism: on other ranks)."""

    def __call__(self, moe: MoE, x_sorted: torch.Tensor, counts: torch.Tensor | list[int],
                 fixed: bool) -> torch.Tensor: ...


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` (Shazeer 2020); w1 = gate, w3 = up, w2 = down."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def route_topk(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (probs (T, E), weights (T, k) summing to 1, expert ids (T, k)).

    ``bias`` (E,): added to the probabilities for choosing the experts only.
    """
    probs = logits.float().softmax(dim=-1)
    if bias is None:
        top_p, top_idx = probs.topk(k, dim=-1)
    else:
        top_idx = (probs.detach() + bias).topk(k, dim=-1).indices
        top_p = probs.gather(1, top_idx)
    weights = top_p / top_p.sum(dim=-1, keepdim=True)
    return probs, weights, top_idx


def load_balancing_loss(probs: torch.Tensor, top_idx: torch.Tensor, n_experts: int,
                        reduce_counts: CountReducer | None = None) -> torch.Tensor:
    """``E * sum_i f_i * P_i`` (unscaled; see module docstring).

    ``reduce_counts`` sums the assignment counts over the ranks holding the rest of the tokens
    and returns how many ranks that is: ``f`` is then theirs together, and the mean over those
    ranks of each one's loss is the loss of all their tokens.
    """
    t, k = top_idx.shape
    counts = torch.bincount(top_idx.reshape(-1), minlength=n_experts)
    ranks = 1
    if reduce_counts is not None:
        counts, ranks = reduce_counts(counts)
    f = counts.to(probs.dtype) / (t * k * ranks)  # fraction of assignments per expert
    p = probs.mean(dim=0)  # mean router probability per expert
    return n_experts * (f * p).sum()


def sequence_balancing_loss(probs: torch.Tensor, top_idx: torch.Tensor, n_experts: int,
                            batch: int, reduce_counts: CountReducer | None = None
                            ) -> torch.Tensor:
    """Mean over the ``batch`` sequences of each one's ``E * sum_i f_i * P_i``.

    ``reduce_counts`` (context parallelism) sums each sequence's (B, E) counts over its shares.
    """
    t, k = top_idx.shape
    s = t // batch
    seq = torch.arange(t, device=top_idx.device).repeat_interleave(k) // s
    counts = torch.zeros(batch * n_experts, dtype=torch.long, device=top_idx.device)
    counts.index_add_(0, seq * n_experts + top_idx.reshape(-1), torch.ones_like(seq))
    shares = 1
    if reduce_counts is not None:
        counts, shares = reduce_counts(counts)
    f = counts.view(batch, n_experts).to(probs.dtype) / (s * k * shares)
    p = probs.view(batch, s, n_experts).mean(dim=1)
    return n_experts * (f * p).sum(dim=1).mean()


def capacity_per_sequence(seq_len: int, k: int, n_experts: int, factor: float) -> int:
    """Copies of one sequence (``seq_len`` tokens on this rank) an expert takes at most."""
    return max(1, math.ceil(factor * seq_len * k / n_experts))


@dataclass
class RouterStats:
    """One layer's routing over the current step, summed over micro-batches (detached)."""

    load: torch.Tensor | None = None  # (E,) copies routed to each expert (kept or dropped)
    dropped: float = 0.0  # copies past an expert's capacity
    aux: torch.Tensor | float = 0.0  # sum over micro-batches of the aux loss (coef included)
    micro_batches: int = 0

    def add(self, counts: torch.Tensor, dropped: float, aux: torch.Tensor | float) -> None:
        counts = counts.detach().double()
        self.load = counts if self.load is None else self.load + counts
        self.dropped += dropped
        self.aux += aux
        self.micro_batches += 1

    def reset(self) -> None:
        self.load, self.dropped, self.aux, self.micro_batches = None, 0.0, 0.0, 0


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights; runs each expert on its contiguous token slice."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x_sorted (N, H) grouped by expert, ``counts[e]`` rows each -> (N, H).

        Equal counts (capacity slots): one batched matmul per projection for all experts.
        """
        if len(set(counts)) == 1:
            x = x_sorted.view(len(counts), counts[0], x_sorted.shape[-1])  # (E, n, H)
            hidden = F.silu(torch.bmm(x, self.w1.transpose(1, 2))) * torch.bmm(
                x, self.w3.transpose(1, 2))
            return torch.bmm(hidden, self.w2.transpose(1, 2)).reshape(x_sorted.shape)
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
        weights, top_idx = moe.route(x, shape[0])
        return moe.combine(x, weights, top_idx, shape[0]).reshape(shape)


class MoE(nn.Module):
    """Top-k routed experts plus optional shared experts; stores its aux loss per forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.topk, self.coef = cfg.moe_experts, cfg.moe_topk, cfg.moe_aux_loss_coef
        self.balance, self.bias_rate = cfg.moe_balance, cfg.moe_bias_rate
        self.capacity = cfg.moe_capacity
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.dim, cfg.expert_hidden)
        self.shared = (
            SwiGLU(cfg.dim, cfg.expert_hidden * cfg.moe_shared_experts)
            if cfg.moe_shared_experts
            else None
        )
        # auxiliary-loss-free balancing: selection bias, not a parameter (no gradient)
        self.expert_bias: torch.Tensor | None = (
            torch.zeros(cfg.moe_experts) if cfg.moe_balance == "bias" else None)
        self.last_aux_loss: torch.Tensor | None = None
        self.stats = RouterStats()
        self.dispatcher = LocalDispatcher()
        self.exchange: Exchange | None = None  # set by expert parallelism
        self.reduce_counts: CountReducer | None = None  # global micro-batch counts (dp x cp)
        self.reduce_seq_counts: CountReducer | None = None  # a sequence's counts (cp)

    def build_buffers(self, device: torch.device | str) -> None:
        """The selection bias on ``device`` (a model built on the meta device has none)."""
        if self.expert_bias is not None and (self.expert_bias.is_meta
                                             or self.expert_bias.device != torch.device(device)):
            bias = (torch.zeros(self.n_experts) if self.expert_bias.is_meta
                    else self.expert_bias)
            self.expert_bias = bias.to(device=device, dtype=torch.float32)

    @property
    def tracking(self) -> bool:
        """Training forward: aux loss and router statistics (not in eval or generation). A
        recomputation (:func:`~meshlm.models.replay.replaying`) computes the aux loss again --
        its tensors are the ones backward needs -- but records nothing."""
        return self.training and torch.is_grad_enabled()

    def route(self, x: torch.Tensor, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (T, H) of ``batch`` sequences -> (weights (T, k), expert ids (T, k));
        records the aux loss (training only)."""
        probs, weights, top_idx = route_topk(self.router(x), self.topk, self.expert_bias)
        aux = None
        if self.tracking and self.coef and self.balance == "aux":
            aux = self.coef * load_balancing_loss(
                probs, top_idx, self.n_experts, self.reduce_counts)
        elif self.tracking and self.coef and self.balance == "seq_aux":
            aux = self.coef * sequence_balancing_loss(
                probs, top_idx, self.n_experts, batch, self.reduce_seq_counts)
        if not replaying():
            self.last_aux_loss = aux
        return weights, top_idx

    def combine(self, x: torch.Tensor, weights: torch.Tensor, top_idx: torch.Tensor,
                batch: int = 1) -> torch.Tensor:
        """Sum over each token's k experts of weight * expert(token), plus the shared expert."""
        flat = top_idx.reshape(-1)  # (T*k,) expert of each assignment
        counts_t = torch.bincount(flat, minlength=self.n_experts)
        if self.capacity > 0:
            slot, kept, counts = self._slots(flat, x.shape[0] // batch, batch)
            token_of = kept // self.topk  # source token of each kept assignment
            x_in = x.new_zeros(len(counts) * counts[0], x.shape[1]).index_copy(
                0, slot, x[token_of])
            out = self._run(x_in, counts, fixed=True)[slot]  # (kept, H)
            gate = weights.reshape(-1)[kept]
            dropped = flat.numel() - kept.numel()
        else:
            kept = torch.argsort(flat, stable=True)  # assignments grouped by expert
            token_of = kept // self.topk
            out = self._run(x[token_of], counts_t, fixed=False)  # (T*k, H)
            gate = weights.reshape(-1)[kept]
            dropped = 0
        if self.tracking and not replaying():  # (no device sync: tensors until the step's end)
            aux = self.last_aux_loss.detach() if self.last_aux_loss is not None else 0.0
            self.stats.add(counts_t, float(dropped), aux)
        y = torch.zeros_like(x).index_add_(
            0, token_of, (out * gate.unsqueeze(-1).to(out.dtype)).to(x.dtype))
        if self.shared is not None:
            y = y + self.shared(x)
        return y

    def _slots(self, flat: torch.Tensor, seq_len: int, batch: int
               ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Capacity: (slot of each kept assignment, the kept assignments' indices, rows per
        expert). Expert e's slots are [e B C, (e + 1) B C); sequence b's copies take
        [b C, (b + 1) C) of them, in sequence order; copies past C are not kept."""
        e = self.n_experts
        cap = capacity_per_sequence(seq_len, self.topk, e, self.capacity)
        seq = torch.arange(flat.numel(), device=flat.device) // (seq_len * self.topk)
        key = flat * batch + seq  # (expert, sequence) group of each assignment
        order = torch.argsort(key, stable=True)  # sequence order inside each group
        sizes = torch.bincount(key, minlength=e * batch)
        starts = torch.cumsum(sizes, 0) - sizes
        pos = torch.arange(flat.numel(), device=flat.device) - starts[key[order]]
        keep = pos < cap
        kept = order[keep]
        slot = key[kept] * cap + pos[keep]
        return slot, kept, [batch * cap] * e

    def _run(self, x_sorted: torch.Tensor, counts: torch.Tensor | list[int],
             fixed: bool) -> torch.Tensor:
        """The experts on copies grouped by expert (here, or through the exchange).

        ``counts``: copies per expert, Python ints for capacity slots (known without looking
        at the routing) or the device tensor of a dropless routing, read to the host once --
        here, or by the exchange together with its split sizes."""
        if self.exchange is not None:
            return self.exchange(self, x_sorted, counts, fixed)
        return self.experts(x_sorted, counts if isinstance(counts, list) else counts.tolist())

    def update_bias(self, load: torch.Tensor) -> None:
        """Auxiliary-loss-free step: raise the bias of underloaded experts, lower the others'
        (``load``: copies per expert over the global batch)."""
        if self.expert_bias is None or load.sum() == 0:
            return
        error = load.mean() - load
        self.expert_bias += self.bias_rate * torch.sign(error).to(self.expert_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H) -> (B, S, H) through this layer's dispatcher."""
        return self.dispatcher(self, x)
