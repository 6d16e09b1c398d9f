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

Multi-head latent attention (``models/mla.py``; MLA_REGION): the heads are split as above
(``wq`` / ``wq_b`` / ``wkv_b`` column parallel, ``wo`` row parallel), while the down-projections
``wq_a``, ``wkv_a`` and their norms are replicated, computed by every tp rank on whole tokens
(DeepSeek-V3: about 8 % of the layer's attention matmuls, repeated t times). The region's
entrance moves to the latents: the layer's input passes no ``f`` (with sp, an all-gather whose
backward keeps this rank's chunk: the replicated work's gradient is already whole); the latents
pass one ``f`` together (backward: one all-reduce of ``b s (q_lora + kv_lora + rope)``
values); the output passes ``g`` as usual. Qwen3's per-head ``q_norm`` / ``k_norm`` weights
are shared by heads on every rank: their gradients are all-reduced over tp.

Multi-token prediction (``models/mtp.py``; MTP): its blocks are split as the layers are; its
``proj`` (2h -> h) is column parallel (h/t output rows per rank): the input enters through
``f`` (sp: the all-gather along seq) and the output shards are all-gathered to (b, s, h) (sp:
then this rank's sequence chunk taken), as Megatron-Core's ``eh_proj``: forward one
all-gather of ``b s h`` (sp: plus ``b s 2h`` along seq), backward one all-reduce of
``b s 2h`` (sp: all-gather of ``b s h`` and reduce-scatter of ``b s 2h``) per depth and
micro-batch; its norms are sequence parallel under sp. Each depth's head pass adds the loss's
3 all-reduces of ``b s`` values.

Memory per rank: sharded weights / t + replicated norm weights; activations inside the regions
/ t, outside them / t with sequence parallelism (b s h of each norm input instead of b s h).
Per micro-batch, the loss adds 3 all-reduces of ``b s`` fp32 values (max, target logit, sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import traceable
from ..distributed.comm import Comm
from ..distributed.spec import set_spec, spec_of
from ..models.llama import Attention, RMSNorm, Transformer, rms_norm
from ..models.mla import MultiHeadLatentAttention
from ..models.moe import MoE, SwiGLU
from .tensor_comm import (
    AXIS,
    _all_gather_seq,
    _conjugate,
    copy_to_tp,
    gather_last,
    gather_seq,
    gather_seq_two_ways,
    reduce_from_tp,
    scatter_seq,
)

# (module suffix, parameter, sharded dim): the plan for one decoder layer.
COLUMN, ROW = 0, 1
LAYER_PLAN: list[tuple[str, int]] = [
    ("attention.wq.weight", COLUMN), ("attention.wk.weight", COLUMN),
    ("attention.wv.weight", COLUMN), ("attention.wo.weight", ROW),
    ("feed_forward.w1.weight", COLUMN), ("feed_forward.w3.weight", COLUMN),
    ("feed_forward.w2.weight", ROW),
]
# Multi-head latent attention (models/mla.py): heads split like q/k/v above (wq as there);
# the down-projections wq_a, wkv_a and their norms stay replicated (see MLA_REGION below)
MLA_PLAN: list[tuple[str, int]] = [
    ("attention.wq_b.weight", COLUMN), ("attention.wkv_b.weight", COLUMN),
]
REGIONS = ("attention", "feed_forward")
# MoE layer: stacked experts w1/w3 (E, F, H) sharded on F (dim 1), w2 (E, H, F) on F (dim 2);
# the shared expert like a dense MLP; the router stays replicated.
MOE_PLAN: list[tuple[str, int]] = [
    ("feed_forward.experts.w1", 1), ("feed_forward.experts.w3", 1),
    ("feed_forward.experts.w2", 2), ("feed_forward.shared.w1.weight", COLUMN),
    ("feed_forward.shared.w3.weight", COLUMN), ("feed_forward.shared.w2.weight", ROW),
]


def _shard(p: nn.Parameter, dim: int, comm: Comm, padded: int | None = None) -> None:
    """Keep this rank's slice of ``p`` along ``dim`` (zero-padded to ``padded`` first) and
    record it in the parameter's shard spec."""
    spec = spec_of(p).shard(AXIS, dim, comm.rank(AXIS), comm.size(AXIS), padded)
    p.data = spec.take(p.data).contiguous()
    set_spec(p, spec)


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


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm on a sequence shard; the weight's gradient is all-reduced over tp."""

    def __init__(self, norm: RMSNorm, comm: Comm) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight, self.comm = norm.weight, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, copy_to_tp(self.weight, self.comm), self.eps)


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
    with per-row ``rows`` weights, their weighted sum (multi-token prediction)."""

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


class RegionInput(nn.Module):
    """The input of a column-parallel linear made whole on every tp rank: the
    sequence-parallel all-gather (backward: reduce-scatter), or the copy into the tp region
    (backward: all-reduce of the partial input gradient). The LM head's input (column
    parallel over the vocabulary) and multi-token prediction's ``proj`` input pass it."""

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


class HeadSharedRMSNorm(SequenceParallelRMSNorm):
    """A norm every tp rank applies to its own heads with one shared weight (Qwen3's
    ``q_norm`` / ``k_norm``): each rank's weight gradient covers its heads only, so it is
    all-reduced over tp (one all-reduce of ``head_dim`` values per norm and micro-batch)."""


def _take_seq_shard(grad: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's sequence chunk of a gradient that is whole and equal on every tp rank."""
    s_local = grad.shape[1] // comm.size(AXIS)
    r = comm.rank(AXIS)
    return grad[:, r * s_local : (r + 1) * s_local].contiguous()


# all-gather along seq, backward: this rank's chunk (the consumers are replicated)
_GatherSeqWhole = _conjugate("_GatherSeqWhole", _all_gather_seq, _take_seq_shard)


class WholeInput(nn.Module):
    """MLA's ``whole_input`` under sequence parallelism: the layer's (B, S/t, h) input
    all-gathered to (B, S, h); the replicated down-projections that read it give a gradient
    that is whole and equal on every tp rank, so backward keeps this rank's chunk (no
    reduce-scatter)."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherSeqWhole.apply(x, self.comm)

    def extra_repr(self) -> str:
        return f"all-gather seq, tp={self.comm.size(AXIS)}"


class TensorParallelLatents(nn.Module):
    """MLA's ``latent_input`` under tp: the latents (and ``x`` for ``wq``) enter the heads'
    region through one ``f`` of their concatenation -- identity forward, backward one
    all-reduce of the heads' partial gradients, ``b s (q_lora + kv_lora + rope)`` values
    (``b s (h + kv_lora + rope)`` with ``wq``)."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        joint = copy_to_tp(torch.cat(xs, dim=-1), self.comm)
        return joint.split([x.shape[-1] for x in xs], dim=-1)

    def extra_repr(self) -> str:
        return f"copy_to_tp, tp={self.comm.size(AXIS)}"


def _mla_region(att: MultiHeadLatentAttention, comm: Comm, sp: bool) -> None:
    """Multi-head latent attention as a tp region (MLA_REGION in the module docstring)."""
    att.whole_input = WholeInput(comm) if sp else nn.Identity()
    att.latent_input = TensorParallelLatents(comm)
    _region_hooks(att, comm, sp, enter=False)


def _gather_features(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(b, s, h/t) on each rank -> (b, s, h): every rank's last-dim shard, in rank order."""
    t = comm.size(AXIS)
    b, s, f = x.shape
    out = traceable.all_gather(x.contiguous(), traceable.key_of(comm), AXIS)  # (t*b, s, h/t)
    return out.view(t, b, s, f).permute(1, 2, 0, 3).reshape(b, s, t * f)


def _own_features(g: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's last-dim shard of a tensor whole on every tp rank."""
    f = g.shape[-1] // comm.size(AXIS)
    r = comm.rank(AXIS)
    return g[..., r * f : (r + 1) * f].contiguous()


def _features_to_seq_shard(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _take_seq_shard(_gather_features(x, comm), comm)


def _seq_shard_to_features(g: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _own_features(_all_gather_seq(g.contiguous(), comm), comm)


# all-gather along the last dim, backward: this rank's features (the consumers' gradient is
# whole on every rank); with sp, then this rank's sequence chunk (backward: all-gather seq)
_GatherFeatures = _conjugate("_GatherFeatures", _gather_features, _own_features)
_FeaturesToSeqShard = _conjugate("_FeaturesToSeqShard", _features_to_seq_shard,
                                 _seq_shard_to_features)


class ProjOutput(nn.Module):
    """Multi-token prediction's ``proj_out`` under tp: the column shards of ``proj``'s output
    all-gathered to (b, s, h) (Megatron-Core's ``eh_proj``), with sp then this rank's chunk
    of the sequence. Backward: this rank's features of the whole, equal gradient (with sp:
    all-gathered along seq first)."""

    def __init__(self, comm: Comm, sp: bool) -> None:
        super().__init__()
        self.comm, self.sp = comm, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_FeaturesToSeqShard if self.sp else _GatherFeatures).apply(x, self.comm)

    def extra_repr(self) -> str:
        return f"all-gather features{', seq chunk' if self.sp else ''}, tp={self.comm.size(AXIS)}"


def _mtp_tensor_parallel(model: Transformer, comm: Comm, sp: bool) -> None:
    """Multi-token prediction under tp (MTP in the module docstring); its blocks are sharded
    as the model's layers are."""
    for depth in model.mtp or ():
        _shard(depth.proj.weight, COLUMN, comm)
        depth.proj_in, depth.proj_out = RegionInput(comm, sp), ProjOutput(comm, sp)
        if sp:
            depth.enorm = SequenceParallelRMSNorm(depth.enorm, comm)
            depth.hnorm = SequenceParallelRMSNorm(depth.hnorm, comm)
            depth.norm = SequenceParallelRMSNorm(depth.norm, comm)


def apply_tensor_parallel(model: Transformer, comm: Comm, sp: bool) -> TensorParallel:
    """Shard ``model`` in place over tp (see module docstring); returns its loss/state helper."""
    t, r = comm.size(AXIS), comm.rank(AXIS)
    cfg = model.cfg
    for layer in model.blocks().values():  # (multi-token prediction's blocks too)
        params = dict(layer.named_parameters())
        moe = isinstance(layer.feed_forward, MoE)
        plan = LAYER_PLAN[:4] + MLA_PLAN + (MOE_PLAN if moe else LAYER_PLAN[4:])
        for name, dim in plan:
            if name in params:  # (a MoE layer without shared expert has no shared.*; MLA)
                _shard(params[name], dim, comm)
        att = layer.attention
        if isinstance(att, MultiHeadLatentAttention):
            _mla_region(att, comm, sp)
        else:
            assert isinstance(att, Attention)
            _region_hooks(att, comm, sp)
            if att.qk_norm:
                att.q_norm = HeadSharedRMSNorm(att.q_norm, comm)
                att.k_norm = HeadSharedRMSNorm(att.k_norm, comm)
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
    _mtp_tensor_parallel(model, comm, sp)
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
