"""SwiGLU MLP and the Mixture-of-Experts layer that can replace it.

**Routing** (:func:`route_topk`; Mixtral, Qwen3-MoE and DeepSeek-V3 as published, checked
against Hugging Face's ``Qwen3MoeTopKRouter`` and ``DeepseekV3TopkRouter``). A linear router
scores every expert of each token:

- ``moe_score``: ``softmax`` over the experts (Mixtral, Qwen3-MoE) or an independent
  ``sigmoid`` per expert (DeepSeek-V3), the router's matmul included computed in fp32 (under
  autocast too: DeepSeek-V3 keeps its gating in full precision);
- the auxiliary-loss-free bias (``moe_balance=bias``) is added to the scores for *choosing*
  only;
- group-limited selection (``moe_n_group`` > 1, DeepSeek-V3's node-limited routing): the
  experts fall into n_group equal groups, a group scores the sum of its 2 best (biased)
  scores, the ``moe_topk_group`` best groups are kept and the top k is taken inside them;
- the gates are the chosen experts' unbiased scores, renormalised to sum to 1 when
  ``moe_norm_topk`` (DeepSeek-V3 adds 1e-20 to the sum; false: Qwen3's raw probabilities),
  then multiplied by ``moe_routed_scale`` (DeepSeek-V3's ``routed_scaling_factor``, after the
  normalisation as Hugging Face applies it).

Each expert is a SwiGLU MLP; all experts' weights are stacked in one tensor per projection
(``w1: (E, F, H)``) so expert parallelism shards them along dim 0. Dropless by default: every
token is processed by all of its k experts. An optional shared expert sees every token
(DeepSeek-MoE).

**Experts as one grouped GEMM** (:class:`GroupedExperts`): the token copies sorted by expert
run through ``torch._grouped_mm`` -- one call per projection for all experts, with the
experts' row offsets as a device tensor (``cumsum`` of the counts, int32) -- where the device
and dtype have a kernel (:func:`grouped_mm_supported`); its backward writes each expert's
weight gradient once (an expert with no rows gets zeros). Elsewhere the copies are scattered
into an ``(E, max rows, H)`` zero-padded batch and run by ``bmm`` (no Python loop either; see
:meth:`GroupedExperts.padded`). Capacity slots (equal rows per expert) always use ``bmm``.

Capacity (``moe_capacity`` = c > 0, Switch/GShard): each expert takes at most
``ceil(c * S * k / E)`` copies of each sequence (of S tokens here), the first in sequence order;
later copies are dropped (the token keeps its residual). Every expert then runs on exactly
``B * capacity`` rows (empty slots are zero rows): fixed shapes, and under expert parallelism
fixed all-to-all splits.

Load balancing (``moe_balance``), with P the router probabilities: the softmax, or the sigmoid
scores normalised per token to sum to 1 (DeepSeek-V3 eq. 19):

- ``aux``: Switch Transformer's loss (Fedus et al. 2021, eq. 4, generalised to top-k),
  ``coef * E * sum_i f_i * P_i``, ``f_i`` the fraction of the T*k assignments that go to expert
  i and ``P_i`` the mean router probability of expert i. ``f`` is counted over the *global
  micro-batch* -- this micro-batch of every data-parallel rank -- by ``reduce_counts`` (an
  all-reduce over dp x cp), and P over this rank's tokens; the mean over those ranks of their
  losses is then the loss of the global micro-batch, whatever the layout (Megatron-Core's
  global auxiliary loss). One process with ``micro_batch`` = dp x micro_batch computes the same.
- ``seq_aux``: the same per sequence, averaged over sequences (DeepSeek-V3's sequence-wise
  balance loss, eqs. 17-20): independent of any batch split; context parallelism sums a
  sequence's counts over its cp shares (``reduce_seq_counts``).
- ``bias``: auxiliary-loss-free balancing (DeepSeek-V3, Wang et al. 2024): the per-expert
  bias above, moved after each step by ``b_i += rate * sign(mean load - load_i)`` with the
  loads of the whole global batch (:meth:`MoE.update_bias`). No loss term.

The layer hands its tokens to a *dispatcher* (``moe.dispatcher(moe, x)``): :class:`LocalDispatcher`
routes and runs the experts here; tensor parallelism swaps in its own (experts sharded by
width). The expert computation on the sorted token copies goes through ``moe.exchange`` when it
is set: expert parallelism sends the copies to the ranks owning their experts and back.

**Host synchronisations** (``distributed/host_sync.py``): none in the layer, forward or
backward, without expert parallelism where the grouped GEMM runs -- counts come from a
``scatter_add`` (``bincount`` reads its maximum on a GPU), the capacity slots are computed
with fixed shapes (dropped copies go to a discarded slot instead of a boolean index), the
dropped count stays a tensor until the step's end. The padded fallback reads the largest
count once per forward. Expert parallelism reads its split sizes once per layer and
micro-batch (``parallel/expert.py``), dropless only.

Memory (one rank, no expert parallelism): ``E * 3 * H * F`` expert weights; activations of
``T * k`` routed token copies (the padded fallback: ``E * max rows``). Router statistics
(:class:`RouterStats`): ``E + 3`` numbers.
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


# ---------------------------------------------------------------------- routing
@dataclass(frozen=True)
class Routing:
    """How scores become the chosen experts and their gates (module docstring)."""

    score: str = "softmax"  # softmax | sigmoid
    norm_topk: bool = True  # renormalise the k gates to sum to 1
    n_group: int = 1  # experts in n_group equal groups ...
    topk_group: int = 1  # ... of which the top k is taken in the topk_group best
    scale: float = 1.0  # gates times this (DeepSeek-V3's routed_scaling_factor)

    @classmethod
    def of(cls, cfg: ModelConfig) -> Routing:
        return cls(cfg.moe_score, cfg.moe_norm_topk, cfg.moe_n_group, cfg.moe_topk_group,
                   cfg.moe_routed_scale)


def limit_to_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Selection scores (T, E) with every expert outside each token's ``topk_group`` best
    groups set to -inf; a group scores the sum of its 2 best (DeepSeek-V3's ``MoEGate``)."""
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)  # (T, groups, experts per group)
    group_score = grouped.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)  # (T, groups)
    best = group_score.topk(topk_group, dim=-1).indices  # (T, topk_group)
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)


def route_topk(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None,
               routing: Routing = Routing()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (probabilities (T, E) for the balancing losses, gates (T, k),
    expert ids (T, k)); see the module docstring. ``bias`` (E,): added to the scores for
    choosing the experts only."""
    logits = logits.float()
    if routing.score == "sigmoid":
        scores = logits.sigmoid()
        probs = scores / scores.sum(dim=-1, keepdim=True)  # (DeepSeek-V3 eq. 19)
    else:
        scores = probs = logits.softmax(dim=-1)
    choice = scores.detach() if bias is None else scores.detach() + bias
    if routing.n_group > 1:
        choice = limit_to_groups(choice, routing.n_group, routing.topk_group)
    top_idx = choice.topk(k, dim=-1).indices
    gates = scores.gather(1, top_idx)
    if routing.norm_topk:
        total = gates.sum(dim=-1, keepdim=True)
        gates = gates / (total + 1e-20 if routing.score == "sigmoid" else total)
    if routing.scale != 1.0:
        gates = gates * routing.scale
    return probs, gates, top_idx


def expert_counts(idx: torch.Tensor, n: int) -> torch.Tensor:
    """How many of ``idx``'s entries name each of ``0..n-1`` (int64, on the device): a
    ``scatter_add`` of fixed size, where ``bincount`` reads the maximum to the host on a GPU."""
    flat = idx.reshape(-1)
    return torch.zeros(n, dtype=torch.long, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def load_balancing_loss(probs: torch.Tensor, top_idx: torch.Tensor, n_experts: int,
                        reduce_counts: CountReducer | None = None) -> torch.Tensor:
    """``E * sum_i f_i * P_i`` (unscaled; see module docstring).

    ``reduce_counts`` sums the assignment counts over the ranks holding the rest of the tokens
    and returns how many ranks that is: ``f`` is then theirs together, and the mean over those
    ranks of each one's loss is the loss of all their tokens.
    """
    t, k = top_idx.shape
    counts = expert_counts(top_idx, n_experts)
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
    counts = expert_counts(seq * n_experts + top_idx.reshape(-1), batch * n_experts)
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
    """One layer's routing over the current step, summed over micro-batches (detached tensors
    on the device until the step's end: no host synchronisation)."""

    load: torch.Tensor | None = None  # (E,) copies routed to each expert (kept or dropped)
    dropped: torch.Tensor | float = 0.0  # copies past an expert's capacity
    aux: torch.Tensor | float = 0.0  # sum over micro-batches of the aux loss (coef included)
    micro_batches: int = 0

    def add(self, counts: torch.Tensor, dropped: torch.Tensor | float,
            aux: torch.Tensor | float) -> None:
        counts = counts.detach().double()
        self.load = counts if self.load is None else self.load + counts
        self.dropped = self.dropped + dropped
        self.aux += aux
        self.micro_batches += 1

    def reset(self) -> None:
        self.load, self.dropped, self.aux, self.micro_batches = None, 0.0, 0.0, 0


# ---------------------------------------------------------------------- experts
# Where torch._grouped_mm has a kernel (torch 2.13: aten/native/GroupedMMUtils.h,
# cuda/GroupedBlas.cpp, cuda/GroupMM.cu): CPU in fp32 / bf16 / fp16 (a loop of mm in C++,
# torch >= 2.9; no float64); CUDA through CUTLASS for bf16 on compute capability 9.x and 10.x,
# fewer than 1024 groups, 16-byte aligned data pointers -- every other CUDA case (fp32, fp16,
# 8.x) runs a C++ fallback that copies the offsets to the host (a synchronisation) on each of
# the 9 calls of a forward + backward. On both, every operand's leading stride must be a
# multiple of 16 bytes (H and F multiples of 4 fp32 or 8 bf16 values: "strides should be
# multiple of 16 bytes"), and rows past the last offset are left unwritten (here the offsets
# always end at N). Blackwell (10.x) is left out: its kernel gives experts with no rows
# non-zero weight gradients (pytorch/pytorch#172439, open).
GROUPED_MM_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16),
                     "cuda": (torch.bfloat16,)}
GROUPED_MM_CUDA_MAJOR = (9,)
GROUPED_MM_MAX_GROUPS_CUDA = 1023  # (CUTLASS path: "Can't process more than 1024 groups")


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


def grouped_mm_supported(dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs the experts ``weight`` (E, F, H) on inputs of
    ``dtype`` without a host synchronisation (see the table above)."""
    dev = weight.device
    if not hasattr(torch, "_grouped_mm") or dtype not in GROUPED_MM_DTYPES.get(dev.type, ()):
        return False
    if dev.type == "cpu" and not _torch_at_least(2, 9):
        return False
    if dev.type == "cuda" and (
            torch.cuda.get_device_capability(dev)[0] not in GROUPED_MM_CUDA_MAJOR
            or weight.shape[0] > GROUPED_MM_MAX_GROUPS_CUDA):
        return False
    align = 16 // dtype.itemsize
    return weight.shape[1] % align == 0 and weight.shape[2] % align == 0


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's where it is on (``_grouped_mm`` is not autocast-aware)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights, run on token copies grouped by expert.

    Three ways, one result (:meth:`forward`): equal rows per expert (capacity slots) -- one
    ``bmm`` per projection; otherwise one ``torch._grouped_mm`` per projection where it has a
    kernel (:func:`grouped_mm_supported`); else :meth:`padded`. No Python loop over experts,
    no host synchronisation but the padded fallback's one; each expert's weight gradient is
    written once (zeros for an expert without rows).
    """

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor | list[int],
                max_count: int | None = None) -> torch.Tensor:
        """x_sorted (N, H) grouped by expert, ``counts[e]`` rows each (a device tensor, or
        Python ints) -> (N, H). ``max_count``: the largest count when the host knows it
        (spares the padded fallback its read)."""
        if isinstance(counts, list):
            if len(set(counts)) == 1:  # capacity slots: one batched matmul for all experts
                return self.batched(x_sorted, counts[0])
            max_count = max(counts) if max_count is None else max_count
            counts = torch.tensor(counts, device=x_sorted.device)
        if grouped_mm_supported(_compute_dtype(x_sorted), self.w1):
            return self.grouped(x_sorted, counts)
        return self.padded(x_sorted, counts, max_count)

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w1.to(dtype), self.w3.to(dtype), self.w2.to(dtype)

    def batched(self, x_sorted: torch.Tensor, rows: int) -> torch.Tensor:
        """``rows`` copies per expert: (E * rows, H) -> (E * rows, H) by ``bmm``."""
        x = x_sorted.view(self.w1.shape[0], rows, x_sorted.shape[-1])  # (E, rows, H)
        hidden = F.silu(torch.bmm(x, self.w1.transpose(1, 2))) * torch.bmm(
            x, self.w3.transpose(1, 2))  # (E, rows, F)
        return torch.bmm(hidden, self.w2.transpose(1, 2)).reshape(x_sorted.shape)

    def grouped(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``torch._grouped_mm`` with the row offsets on the device (int32 ``cumsum``)."""
        dtype = _compute_dtype(x_sorted)
        w1, w3, w2 = self.weights(dtype)
        x = x_sorted.to(dtype)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # end row of each expert
        mm = torch._grouped_mm
        hidden = F.silu(mm(x, w1.transpose(1, 2), offs=offs)) * mm(
            x, w3.transpose(1, 2), offs=offs)  # (N, F)
        return mm(hidden, w2.transpose(1, 2), offs=offs)  # (N, H)

    def padded(self, x_sorted: torch.Tensor, counts: torch.Tensor,
               max_count: int | None = None) -> torch.Tensor:
        """The fallback: expert e's rows placed at ``[e M, e M + counts[e])`` of an
        ``(E, M, H)`` zero batch, M the largest count (read to the host once unless given),
        run by :meth:`batched`, and gathered back. Memory: ``E * M`` rows instead of N of
        every activation (``max / mean`` load times the grouped path's); the padding rows are
        zeros and give zero gradients."""
        n, e = x_sorted.shape[0], counts.numel()
        m = int(counts.max()) if max_count is None else max_count  # (the one host read)
        starts = torch.cumsum(counts, 0) - counts
        expert = torch.repeat_interleave(torch.arange(e, device=counts.device), counts,
                                         output_size=n)  # (N,) expert of each row
        slot = expert * m + torch.arange(n, device=counts.device) - starts[expert]
        x = x_sorted.new_zeros(e * m, x_sorted.shape[-1]).index_copy(0, slot, x_sorted)
        return self.batched(x, m)[slot]


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
        self.routing = Routing.of(cfg)
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

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, E) in fp32, under autocast too: the gating keeps full precision
        (DeepSeek-V3 sec. 3.3.2; Hugging Face's ``DeepseekV3TopkRouter``), so a 16-bit run
        chooses the experts a fp32 run would, but for its own rounding of ``x``."""
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            with torch.autocast(kind, enabled=False):
                return F.linear(x.float(), self.router.weight.float())
        return F.linear(x.float(), self.router.weight.float())

    def route(self, x: torch.Tensor, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (T, H) of ``batch`` sequences -> (gates (T, k), expert ids (T, k));
        records the aux loss (training only)."""
        probs, weights, top_idx = route_topk(self.router_logits(x), self.topk,
                                             self.expert_bias, self.routing)
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
        """Sum over each token's k experts of gate * expert(token), plus the shared expert."""
        flat = top_idx.reshape(-1)  # (T*k,) expert of each assignment
        counts = expert_counts(flat, self.n_experts)  # (E,) on the device
        dropped: torch.Tensor | float = 0.0
        if self.capacity > 0:
            slot, rows = self._slots(flat, x.shape[0] // batch, batch)  # (T*k,), E B C
            token_of = torch.arange(flat.numel(), device=x.device) // self.topk
            # every copy to its slot; dropped copies to the extra row ``rows``, discarded
            x_in = x.new_zeros(rows + 1, x.shape[1]).index_add_(0, slot, x[token_of])
            out = self._run(x_in[:rows], [rows // self.n_experts] * self.n_experts, fixed=True)
            out = torch.cat([out, out.new_zeros(1, out.shape[1])])[slot]  # (T*k, H), 0 dropped
            gate = weights.reshape(-1)
            dropped = (slot == rows).sum()
        else:
            kept = torch.argsort(flat, stable=True)  # assignments grouped by expert
            token_of = kept // self.topk
            out = self._run(x[token_of], counts, fixed=False)  # (T*k, H)
            gate = weights.reshape(-1)[kept]
        if self.tracking and not replaying():  # (no device sync: tensors until the step's end)
            aux = self.last_aux_loss.detach() if self.last_aux_loss is not None else 0.0
            self.stats.add(counts, dropped, aux)
        y = torch.zeros_like(x).index_add_(
            0, token_of, (out * gate.unsqueeze(-1).to(out.dtype)).to(x.dtype))
        if self.shared is not None:
            y = y + self.shared(x)
        return y

    def _slots(self, flat: torch.Tensor, seq_len: int, batch: int) -> tuple[torch.Tensor, int]:
        """Capacity: (the slot of every assignment, the number of slots ``E B C``). Expert e's
        slots are [e B C, (e + 1) B C); sequence b's copies take [b C, (b + 1) C) of them, in
        sequence order; copies past C get slot ``E B C`` (dropped). Fixed shapes throughout:
        no host synchronisation."""
        e, n = self.n_experts, flat.numel()
        cap = capacity_per_sequence(seq_len, self.topk, e, self.capacity)
        idx = torch.arange(n, device=flat.device)
        key = flat * batch + idx // (seq_len * self.topk)  # (expert, sequence) group
        order = torch.argsort(key, stable=True)  # sequence order inside each group
        sizes = expert_counts(key, e * batch)
        starts = torch.cumsum(sizes, 0) - sizes
        pos = torch.empty_like(idx).scatter_(0, order, idx - starts[key[order]])  # in group
        rows = e * batch * cap
        return torch.where(pos < cap, key * cap + pos, rows), rows

    def _run(self, x_sorted: torch.Tensor, counts: torch.Tensor | list[int],
             fixed: bool) -> torch.Tensor:
        """The experts on copies grouped by expert (here, or through the exchange).

        ``counts``: copies per expert, Python ints for capacity slots (known without looking
        at the routing) or the device tensor of a dropless routing (the grouped GEMM's
        offsets; expert parallelism reads it to the host once with its split sizes)."""
        if self.exchange is not None:
            return self.exchange(self, x_sorted, counts, fixed)
        return self.experts(x_sorted, counts)

    def update_bias(self, load: torch.Tensor) -> None:
        """Auxiliary-loss-free step: raise the bias of underloaded experts, lower the others'
        (``load``: copies per expert over the global batch; all equal -- none at all
        included -- moves nothing)."""
        if self.expert_bias is None:
            return
        error = load.mean() - load
        self.expert_bias += self.bias_rate * torch.sign(error).to(self.expert_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H) -> (B, S, H) through this layer's dispatcher."""
        return self.dispatcher(self, x)
