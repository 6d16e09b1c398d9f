"""Tensor parallelism (Megatron-LM) and sequence parallelism over the mesh's ``tp`` axis.

Applied to a plain model from a declarative plan: in every block, q/k/v and the MLP's gate/up
projections are column parallel (output features sharded: each rank holds n_heads/t query
heads, n_kv_heads/t KV heads, ffn/t MLP columns), the attention output and MLP down
projections are row parallel (input features sharded). The attention and MLP modules are
TP *regions*: their input passes ``f`` (identity forward, all-reduce backward) and their
output ``g`` (all-reduce forward), so each block costs 2 all-reduces forward and 2 backward
of ``b s h`` elements. The embedding is vocab parallel (rows sharded; an all-reduce combines
the partial lookups) and the LM head is the same shard (tied or not), so the logits stay
sharded by vocabulary and :func:`vocab_parallel_cross_entropy` never gathers them. A vocabulary
that t does not divide is padded; padded logits are masked to -inf and never count.

Sequence parallelism (Korthikanti et al. 2022) shards the activations outside the regions
along the sequence: ``f``/``g`` become all-gather / reduce-scatter along seq (same volume),
the embedding's all-reduce becomes a reduce-scatter, the head's input is all-gathered, and the
replicated norm weights get their gradient all-reduced over tp (it is summed over seq shards).

The attention layer's plan is looked up by its name (``KernelSlot.layer_name``) in
:data:`ATTENTION_PLANS`: grouped-query attention's ("gqa") is the one above, and Qwen3's
per-head ``q_norm`` / ``k_norm`` weights are shared by heads on every rank: their gradients are
all-reduced over tp. A technique's attention layer registers its own plan beside it (listed in
``parallel/attention_plans.py``), built from the pieces in ``parallel/tensor_plan.py``
(``_shard``, ``_region_hooks``) and stating its own communication.

An extra training head (``models/heads.py``) is sharded by the plan registered under its
name in :data:`HEAD_PLANS` (listed in ``parallel/training_heads.py``, stating its own
communication); its decoder blocks are split as the layers are.

Memory per rank: sharded weights / t + replicated norm weights; activations inside the regions
/ t, outside them / t with sequence parallelism (b s h of each norm input instead of b s h).
Per micro-batch, the loss adds 3 all-reduces of ``b s`` fp32 values (max, target logit, sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.comm import Comm
from ..models.llama import Attention, KernelSlot, Transformer
from ..models.moe import MoE, SwiGLU
from .tensor_comm import (
    AXIS,
    copy_to_tp,
    gather_last,
    gather_seq_two_ways,
    reduce_from_tp,
    scatter_seq,
)
from .tensor_plan import (
    ATTENTION_PLANS,
    COLUMN,
    HEAD_PLANS,
    ROW,
    AttentionPlan,
    HeadPlan,
    RegionInput,
    SequenceParallelRMSNorm,
    _region_hooks,
    _shard,
    register_attention_plan,
)

# (parameter, sharded dim): the plan for one decoder layer -- its grouped-query attention
# (names inside ``attention``; another attention layer brings its plan, ATTENTION_PLANS) and
# its MLP (names inside the block).
GQA_PLAN: list[tuple[str, int]] = [
    ("wq.weight", COLUMN), ("wk.weight", COLUMN), ("wv.weight", COLUMN), ("wo.weight", ROW),
]
MLP_PLAN: list[tuple[str, int]] = [
    ("feed_forward.w1.weight", COLUMN), ("feed_forward.w3.weight", COLUMN),
    ("feed_forward.w2.weight", ROW),
]
REGIONS = ("attention", "feed_forward")
# MoE layer: stacked experts w1/w3 (E, F, H) sharded on F (dim 1), w2 (E, H, F) on F (dim 2);
# the shared expert like a dense MLP; the router stays replicated.
MOE_PLAN: list[tuple[str, int]] = [
    ("feed_forward.experts.w1", 1), ("feed_forward.experts.w3", 1),
    ("feed_forward.experts.w2", 2), ("feed_forward.shared.w1.weight", COLUMN),
    ("feed_forward.shared.w3.weight", COLUMN), ("feed_forward.shared.w2.weight", ROW),
]


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V_local) of the (padded) embedding; partial lookups are summed."""

    def __init__(self, weight: nn.Parameter, start: int, valid: int, comm: Comm, sp: bool):
        super().__init__()
        self.weight, self.start, self.valid, self.comm, self.sp = weight, start, valid, comm, sp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.valid)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # (B, S, h) partial sum
        return scatter_seq(out, self.comm) if self.sp else reduce_from_tp(out, self.comm)


class TensorParallelDispatcher:
    """MoE dispatch with experts sharded over tp: routing replicated, expert outputs partial sums.

    The router runs on whole tokens on every tp rank (same routing, same aux loss as one
    process) and its input gradient is whole, so it bypasses ``f``; the routing weights pass
    ``f`` because each rank's expert shard contributes part of their gradient. Communication
    per layer and micro-batch: without SP, all-reduce of b s h forward and of b s h + T k
    backward; with SP, one all-gather and one reduce-scatter of b s h each way + T k.
    Each rank runs its F/t-wide slice of every expert as the one-process layer runs them (one
    grouped GEMM where ``torch._grouped_mm`` takes F/t: ``models/moe.py``); no host
    synchronisation.
    """

    def __init__(self, comm: Comm, sp: bool) -> None:
        self.comm, self.sp = comm, sp

    def __call__(self, moe: MoE, x: torch.Tensor) -> torch.Tensor:
        b, _, h = x.shape
        if self.sp:
            x_sharded, x_replicated = gather_seq_two_ways(x, self.comm)  # (B, S, h) each
        else:
            x_sharded, x_replicated = copy_to_tp(x, self.comm), x
        weights, top_idx = moe.route(x_replicated.reshape(-1, h), b)
        weights = copy_to_tp(weights, self.comm)
        y = moe.combine(x_sharded.reshape(-1, h), weights, top_idx, b).view(b, -1, h)  # partial
        return scatter_seq(y, self.comm) if self.sp else reduce_from_tp(y, self.comm)


def exp_logits_(x: torch.Tensor, targets: torch.Tensor, start: int, valid: int,
                comm: Comm | None) -> tuple[torch.Tensor, ...]:
    """The cross-entropy pieces of fp32 logits ``x`` (N, V_local) whose columns are the global
    ids ``[start, start + valid)`` (padding beyond): ``x`` becomes ``exp(x - max)`` in place;
    returns (sum of exponentials, shifted target logit, local target index (N, 1), whether
    this rank holds the target). With ``comm``: max, target logit and sum all-reduced over tp.
    """
    if valid < x.shape[1]:
        x[:, valid:] = float("-inf")  # vocabulary padding never counts
    m = x.max(dim=-1).values
    if comm is not None:
        comm.all_reduce(m, AXIS, op="max")
    x -= m.unsqueeze(1)
    local = targets - start
    mine = (local >= 0) & (local < valid)
    idx = local.clamp(0, x.shape[1] - 1).unsqueeze(1)
    target_logit = x.gather(1, idx).squeeze(1) * mine
    if comm is not None:
        comm.all_reduce(target_logit, AXIS)
    x.exp_()
    sum_exp = x.sum(dim=-1)
    if comm is not None:
        comm.all_reduce(sum_exp, AXIS)
    return sum_exp, target_logit, idx, mine


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy of vocab-sharded logits (Megatron's ``vocab_parallel_cross_entropy``);
    with per-row ``rows`` weights, their weighted sum (an extra training objective's)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, valid: int,  # noqa: ANN001
                comm: Comm, rows: torch.Tensor | None = None) -> torch.Tensor:
        x = logits.float().clone()  # (N, V_local)
        sum_exp, target_logit, idx, mine = exp_logits_(x, targets, start, valid, comm)
        loss = sum_exp.log() - target_logit  # (N,)
        x /= sum_exp.unsqueeze(1)  # softmax of the local columns
        rows = None if rows is None else rows.float()
        ctx.save_for_backward(x, idx, mine, *(() if rows is None else (rows,)))
        ctx.in_dtype = logits.dtype
        return loss.mean() if rows is None else (loss * rows).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        softmax, idx, mine, *rows = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(1, idx, -mine.to(g.dtype).unsqueeze(1))
        if rows:
            g *= grad * rows[0].unsqueeze(1)
        else:
            g *= grad / g.shape[0]
        return g.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int,
                                 valid: int, comm: Comm, rows: torch.Tensor | None = None
                                 ) -> torch.Tensor:
    """Mean cross-entropy of (N, V/t) vocab-sharded logits whose columns are the global ids
    ``[start, start + valid)`` of this tp rank (padding columns beyond ``valid`` never count);
    ``rows`` (N,): the weighted sum instead."""
    return _VocabParallelCE.apply(logits, targets, start, valid, comm, rows)


@dataclass
class TensorParallel:
    """What a tensor-parallel model needs beyond its modules: the loss and whole logits."""

    comm: Comm
    sp: bool
    vocab_size: int
    vocab_start: int
    vocab_valid: int

    @property
    def size(self) -> int:
        return self.comm.size(AXIS)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor,
             weight: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token loss over (B, S) of vocab-sharded (B, S, V/t) logits (``weight``
        (B, S): the weighted sum instead)."""
        return vocab_parallel_cross_entropy(
            logits.flatten(0, 1), targets.flatten(), self.vocab_start, self.vocab_valid,
            self.comm, None if weight is None else weight.flatten())

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_last(logits, self.comm)[..., : self.vocab_size]


class HeadSharedRMSNorm(SequenceParallelRMSNorm):
    """A norm every tp rank applies to its own heads with one shared weight (Qwen3's
    ``q_norm`` / ``k_norm``): each rank's weight gradient covers its heads only, so it is
    all-reduced over tp (one all-reduce of ``head_dim`` values per norm and micro-batch)."""


def _gqa_region(att: KernelSlot, comm: Comm, sp: bool) -> None:
    """Grouped-query attention as a tp region (module docstring): q/k/v column parallel, ``wo``
    row parallel, the input through ``f`` and the output through ``g``."""
    assert isinstance(att, Attention)
    params = dict(att.named_parameters())
    for name, dim in GQA_PLAN:
        _shard(params[name], dim, comm)
    _region_hooks(att, comm, sp)
    if att.qk_norm:
        att.q_norm = HeadSharedRMSNorm(att.q_norm, comm)
        att.k_norm = HeadSharedRMSNorm(att.k_norm, comm)


register_attention_plan("gqa", _gqa_region)


def attention_plan(att: KernelSlot) -> AttentionPlan:
    """The tensor-parallel plan of the attention layer ``att``."""
    from . import attention_plans  # noqa: F401  (registers the techniques' plans)

    if att.layer_name not in ATTENTION_PLANS:
        raise ValueError(f"attention layer {att.layer_name!r} has no tensor-parallel plan "
                         f"(one of {', '.join(ATTENTION_PLANS)})")
    return ATTENTION_PLANS[att.layer_name]


def head_plan(name: str) -> HeadPlan:
    """The tensor-parallel plan of the training head ``name``."""
    from . import training_heads  # noqa: F401  (registers the techniques' plans)

    if name not in HEAD_PLANS:
        raise ValueError(f"training head {name!r} has no tensor-parallel plan "
                         f"(one of {', '.join(HEAD_PLANS) or 'none'})")
    return HEAD_PLANS[name]


def apply_tensor_parallel(model: Transformer, comm: Comm, sp: bool) -> TensorParallel:
    """Shard ``model`` in place over tp (see module docstring); returns its loss/state helper."""
    t, r = comm.size(AXIS), comm.rank(AXIS)
    cfg = model.cfg
    for layer in model.blocks().values():  # (the training heads' blocks too)
        params = dict(layer.named_parameters())
        moe = isinstance(layer.feed_forward, MoE)
        attention_plan(layer.attention)(layer.attention, comm, sp)
        for name, dim in MOE_PLAN if moe else MLP_PLAN:
            if name in params:  # (a MoE layer without shared expert has no shared.*)
                _shard(params[name], dim, comm)
        if moe:
            layer.feed_forward.dispatcher = TensorParallelDispatcher(comm, sp)
        else:
            assert isinstance(layer.feed_forward, SwiGLU)
            _region_hooks(layer.feed_forward, comm, sp)
        if sp:
            layer.attention_norm = SequenceParallelRMSNorm(layer.attention_norm, comm)
            layer.ffn_norm = SequenceParallelRMSNorm(layer.ffn_norm, comm)
    if sp:
        model.norm = SequenceParallelRMSNorm(model.norm, comm)
    for name, extra in model.training_heads().items():  # (their own weights)
        head_plan(name)(extra, comm, sp)
    # Vocabulary: pad to a multiple of t, rows [r V_p / t, (r + 1) V_p / t) on rank r.
    v = cfg.vocab_size
    padded = -(-v // t) * t
    per = padded // t
    start, valid = r * per, max(0, min(per, v - r * per))
    emb = model.tok_embeddings.weight
    _shard(emb, 0, comm, padded)
    model.tok_embeddings = VocabParallelEmbedding(emb, start, valid, comm, sp)
    if not cfg.tie_embeddings:
        _shard(model.output.weight, 0, comm, padded)
    # The head is column parallel over the vocabulary: its input must be whole on every rank.
    model.head_input = RegionInput(comm, sp)
    return TensorParallel(comm, sp, v, start, valid)
