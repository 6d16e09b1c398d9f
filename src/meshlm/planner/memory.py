"""Per-GPU memory of a layout: model states, activations, communication buffers.

**States**: bytes per parameter of weights / gradients / optimizer states ``(w, g, o)`` are
the states mode's (``precision_cost.py``: ``(4, 4, 8)`` meshlm's fp32, ``(2, 2, 12)`` the ZeRO
paper's mixed precision); which of them a rank holds whole and which 1 / N of is the ZeRO
stage's (``parallel/zero_cost.py``, N: :func:`shard_ranks`). Ψ on a rank is the layers of its
pipeline stage, with attention and MLP weights split over tp (norms replicated), the
vocabulary padded to a multiple of tp, routed experts split over ep. With
``offload`` = ``cpu`` or ``disk`` (``parallel/offload_cost.py``) the optimizer states leave
the device: 0 device bytes, reported apart (``MemoryBreakdown.host``).
The shards a rank writes at a checkpoint (12 bytes per parameter it owns: fp32 weight and two
moments) are the host copy an asynchronous save keeps (``checkpoint.async``), reported apart as
``MemoryBreakdown.checkpoint_host``.

**Activations** per layer and micro-batch, in bytes per value of the precision's compute
dtype (``precision_cost.py``; Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4). Profile ``megatron`` is the paper's GPT
block at 16-bit (eq. 1 and table 2): ``s b h (34 + 5 a s / h)`` bytes without parallelism;
with tensor parallelism ``s b h (10 + 24 / t + 5 a s / (h t))``; with sequence parallelism
``s b h (34 + 5 a s / h) / t``. What recomputation keeps of them is the mode's
(``parallel/recompute_cost.py``): selective drops the ``5 a s / h`` attention-score term;
full keeps the layer input, ``2 s b h`` (``/ t`` with sp); op-level keeps the layer input,
every other matmul output in forward order (the 1st, 3rd, ...: q, v, then w1 and w2 of SwiGLU
or fc1 of a GELU MLP) and the attention output with its log-sum-exp (:func:`op_saved`). The
same items are written for grouped-query attention
(K, V of ``kv`` features), a SwiGLU MLP (4 tensors of width f instead of GELU's 2) and flash
attention (no scores; output plus an fp32 log-sum-exp per head). Profile ``meshlm`` counts what meshlm's block saves (measured with
``saved_tensors_hooks``): per token ``6h`` fp32 values in the two RMSNorms (input, normalised
input, output), ``q, k, v``, the attention output and the log-sum-exp, and ``4f`` in SwiGLU;
under bf16 autocast each linear saves its own bf16 copy of its input and the bf16 weight
copies live until backward. meshlm's sequence parallelism keeps the all-gathered input of
each region (it does not gather again in backward).

**The model's own kinds of layers** are described beside them: what an attention layer's
projections keep and how they split over tp (``models/attention_cost.py``: one description per
kind of attention layer, Qwen3's query/key norms), and the extra training heads' blocks, head
passes, linears and saved inputs on the last pipeline stage (``models/technique.py``: the
registered heads, summed).

**Precision** (``precision_cost.py``): the activations' bytes per value, the autocast weight
copies (under fp8 none of the decoder-block linears' weights) and the float8 casts, a
transient of the largest decoder-block linear (:func:`fp8_casts`), are the precision's; the
casts are counted in the backward, beside a fully recomputed layer's rebuilt activations.

**Pipeline**: the micro-batches whose activations rank r holds at its peak are the schedule's
(``parallel/schedule_cost.py``: ``min(p - r, m)`` under 1F1B, ``m`` under AFAB, ...).

**Eager norms on a GPU**: meshlm's ``F.rms_norm`` runs torch's fused CUDA kernel, which keeps
1/rms (4 bytes per token) instead of the normalised input; on a CPU torch runs the formula op by
op and keeps what the ``meshlm`` profile lists.

**Compiled blocks** (``kernels="fused"`` with the ``meshlm`` profile: ``train.compile``) save
what AOTAutograd's partitioner keeps (measured with ``saved_tensors_hooks`` on inductor's
graphs): the fp32 residual between the two halves, the norms' reciprocal RMS, each region's
input once in the compute dtype, q, k, v, the attention output twice (for SDPA's backward and
for the output projection) and its log-sum-exp, and SwiGLU's gate, up and product; the norms'
fp32 products, the SiLU and the casts are recomputed. The compiled loss keeps the logits in
their dtype and writes their gradient in that dtype in one kernel.

**The peak is a phase**, not a sum: what PyTorch holds at the end of the forward (weights,
Adam moments, saved activations, autocast weight copies), at the start of the backward (plus
the loss's transient; full recomputation: one rebuilt layer, while the gradients fill up), and
during the optimizer step (weights, gradients, moments and the step's temporaries: 4 bytes
per parameter for torch's foreach AdamW, whose ``_foreach_sqrt`` copies the second moments;
none for the fused kernel; clipping by a sharded norm squares each gradient tensor in fp64, 16
bytes per element of the largest). Gradients are alive in the forward only where something
keeps them between steps: gradient accumulation, data-parallel buckets, ZeRO shards, pipeline
micro-batches; one process with one micro-batch frees them after each step
(``zero_grad(set_to_none=True)``). **Reserved**: the accelerator's runtime memory (CUDA context,
library workspaces) plus the caching allocator's reserve, :data:`ALLOCATOR_RESERVE` of what is
allocated at the peak (measured: 6.34 GiB reserved-unallocated beside 132.62 GiB allocated,
4.8 %, at meshlm's ``llama3-8b`` out-of-memory on an H200).

**Transient**: the peak above the saved
activations -- the loss's backward (8 more bytes per logit: fp32 gradients of the
log-probabilities and logits, counted on ``F.cross_entropy``; none for a fused loss that
writes the gradient in place) or, with full recomputation, one layer's rebuilt activations,
whichever is larger. **Buffers**: the ZeRO stage's (``parallel/zero_cost.py``: buckets,
gathered layers; with the ``megatron`` profile DeepSpeed's live-parameter cap), and the
accelerator's reserved runtime memory.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

from ..layout import Layout, partition_layers
from ..models.attention_cost import projection_cost
from ..models.config import ModelConfig
from ..models.techniques import HEADS
from ..parallel.context_cost import CONTEXT
from ..parallel.offload_cost import OFFLOAD
from ..parallel.recompute_cost import RECOMPUTE
from ..parallel.schedule_cost import SCHEDULES
from ..parallel.tensor_cost import TENSOR
from ..parallel.zero_cost import ZERO
from ..precision_cost import fp8_linear_peak  # noqa: F401 (the float8 casts' count, re-exported)
from .hardware import Accelerator
from .workload import Workload

# bytes per logit live in the loss's backward beyond the saved 4: counted on F.cross_entropy,
# fp32 and under bf16 autocast alike (meshlm's vocab-parallel loss is assumed the same)
LOSS_WORKING = 8
# A checkpoint's bytes per parameter (checkpoint/sharded.py): the fp32 weight and AdamW's two
# fp32 moments; with DiLoCo islands, island 0 also writes the outer weights and momentum
CHECKPOINT_BYTES = 12
CHECKPOINT_OUTER_BYTES = 8
# the CUDA caching allocator's reserved-but-unallocated memory at the peak, per byte allocated
# (meshlm's llama3-8b run on one H200: 6.34 GiB beside 132.62 GiB, 4.8 %)
ALLOCATOR_RESERVE = 0.05
# bytes per parameter of the optimizer step's temporaries, by AdamW kernels
OPTIMIZER_TEMP = {"fused": 0, "foreach": 4}
# the items alive in each phase of a step (``reserved`` is added to every phase)
PHASES = {
    "forward": ("params", "optim", "activations", "buffers", "weight copies"),
    "backward": ("params", "optim", "activations", "transient", "buffers", "weight copies"),
    "optimizer step": ("params", "grads", "optim", "step temporaries"),
}


@dataclass
class StageParams:
    """Parameters one rank of a pipeline stage holds (after tp/ep splitting)."""

    layers: int
    dense: float  # sharded by ZeRO over dp x cp (hybrid: dp_shard x cp)
    expert: float  # sharded by ZeRO over dp x cp / ep (hybrid: dp_shard x cp / ep; folded: x tp)
    matmul: float  # weights that take part in matmuls (bf16 autocast copies)
    layer_unit: float  # one layer's parameters (ZeRO-3 gathers)
    root_unit: float  # embedding + final norm + head on this stage
    # the decoder-block linears' weights (attention, dense MLP, shared experts): float8 under
    # ``dtype="fp8"``, with no 16-bit copy
    block_linear: float = 0.0

    @property
    def total(self) -> float:
        return self.dense + self.expert


@dataclass
class MemoryBreakdown:
    """Bytes per rank on the most loaded pipeline stage: ``items`` by kind, ``phases`` the
    items alive together in each phase of the step (empty: all of them at once); the peak
    (``total``) is the largest phase."""

    items: dict[str, float] = field(default_factory=dict)
    stage: int = 0
    capacity: float = 0.0
    # bytes moved off the device (offload): not counted in ``total``
    host: dict[str, float] = field(default_factory=dict)
    phases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the shards this rank writes at a checkpoint: the host copy ``checkpoint.async`` keeps
    # between saves (host memory; not counted in ``total``)
    checkpoint_host: float = 0.0

    @property
    def states(self) -> float:
        return self.items["params"] + self.items["grads"] + self.items["optim"]

    def phase_bytes(self, phase: str) -> float:
        keys = self.phases[phase]
        return sum(map(self.items.get, keys, itertools.repeat(0.0, len(keys))))

    @property
    def peak_phase(self) -> str:
        """The phase of the step at which memory peaks ("" without phases)."""
        if not self.phases:
            return ""
        return max(self.phases, key=self.phase_bytes)

    @property
    def total(self) -> float:
        if not self.phases:
            return sum(self.items.values())
        return max(map(self.phase_bytes, self.phases))

    @property
    def allocated(self) -> float:
        """What PyTorch allocates at the peak: the total less the ``reserved`` entry."""
        return self.total - self.items.get("reserved", 0.0)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


# ---------------------------------------------------------------------- parameters
def shard_ranks(lo: Layout) -> int:
    """Ranks ZeRO shards the states over: dp x cp, or one shard group of dp_shard x cp under
    hybrid sharding (its replicas hold the same shards)."""
    return lo.shard_size * lo.cp


def expert_copies(lo: Layout, ranks: int) -> int:
    """Ranks holding the same experts among ``ranks`` (dp x cp, or one shard group): ranks / ep,
    or, with the expert group folded over tp (``Layout.ep_over_tp``), tp x ranks / ep."""
    return max(1, ranks * (lo.tp if lo.ep_over_tp else 1) // lo.ep)


def stage_layers(n_layers: int, lo: Layout, rank: int) -> list[int]:
    """Layer ids held by pipeline rank ``rank``: its stages of ``pp x pp_virtual`` (the
    schedule's placement, ``parallel/schedule_cost.py``: ``rank, rank + pp, ...``, Megatron's
    interleaving; in a V ``rank`` and ``2 pp - 1 - rank``), split as the trainer splits them."""
    return list(_stage_layers(n_layers, lo.pp, lo.pp_virtual, lo.pp_layers, rank,
                              lo.pp_schedule))


@functools.lru_cache(maxsize=4096)  # the search asks again for every layout of one pipeline
def _stage_layers(n_layers: int, pp: int, pp_virtual: int, pp_layers: str, rank: int,
                  schedule: str = "1f1b") -> tuple[int, ...]:
    stages = partition_layers(n_layers, pp * pp_virtual, pp_layers)
    return tuple(i for s in SCHEDULES[schedule].stages(pp, pp_virtual, rank) for i in stages[s])


def last_rank(lo: Layout) -> int:
    """The pipeline rank holding the last stage (final norm, head, loss): ``pp - 1``, or 0
    in a V (``parallel/schedule_cost.py``)."""
    return SCHEDULES[lo.pp_schedule].last_rank(lo.pp, lo.pp_virtual) if lo.pp > 1 else 0


def layer_kinds(work: Workload, lo: Layout, stage: int) -> dict[bool, int]:
    """How many dense (False) and MoE (True) decoder blocks pipeline rank ``stage`` holds: its
    layers, and on the last rank the model's blocks after them (the extra training heads',
    ``models/technique.py``)."""
    return dict(_layer_kinds(work.model.config, lo.pp, lo.pp_virtual, lo.pp_layers, stage,
                             lo.pp_schedule))


def stage_blocks(work: Workload, lo: Layout, stage: int) -> int:
    """Decoder blocks pipeline rank ``stage`` runs (:func:`layer_kinds`, summed)."""
    return sum(layer_kinds(work, lo, stage).values())


@functools.lru_cache(maxsize=4096)
def _layer_kinds(c: ModelConfig, pp: int, pp_virtual: int, pp_layers: str, stage: int,
                 schedule: str = "1f1b") -> tuple[tuple[bool, int], ...]:
    layers = _stage_layers(c.n_layers, pp, pp_virtual, pp_layers, stage, schedule)
    moe = sum(1 for i in layers if c.is_moe_layer(i))
    dense = len(layers) - moe
    last = SCHEDULES[schedule].last_rank(pp, pp_virtual) if pp > 1 else 0
    if stage == last:  # the blocks after the last layer (the extra training heads')
        extra = HEADS.blocks(c)
        moe += sum(extra)
        dense += len(extra) - sum(extra)
    return tuple((k, n) for k, n in ((False, dense), (True, moe)) if n)


def stage_params(work: Workload, lo: Layout, stage: int) -> StageParams:
    """Per-rank parameter counts of one pipeline stage (see module docstring)."""
    spec, c = work.model, work.model.config
    t, h = lo.tp, c.dim
    dense = expert = matmul = layer_unit = block_linear = 0.0
    kinds = layer_kinds(work, lo, stage)
    for is_moe, count in kinds.items():
        attn = projection_cost(c).params(c, t)  # (models/attention_cost.py)
        norms = 2 * h
        if is_moe:
            router = h * c.moe_experts
            per_expert = 3 * h * c.expert_hidden
            shared = c.moe_shared_experts * per_expert / t
            routed = c.moe_experts / lo.ep * per_expert
            dense += count * (attn + norms + router + shared)
            expert += count * routed
            # (the router runs in fp32 under autocast, models/moe.py: no 16-bit copy)
            matmul += count * (attn + shared + routed)
            block_linear += count * (attn + shared)
            layer_unit = max(layer_unit, attn + norms + router + shared + routed)
        else:
            mlp = spec.mlp_matrices * h * c.ffn_hidden / t
            dense += count * (attn + norms + mlp)
            matmul += count * (attn + mlp)
            block_linear += count * (attn + mlp)
            layer_unit = max(layer_unit, attn + norms + mlp)
    vocab = math.ceil(c.vocab_size / t) * h
    root = 0.0
    if stage == 0:
        root += vocab
    if stage == last_rank(lo):
        # An untied head is its own matrix; a tied one is a second copy on the last stage
        # when the embedding lives on another rank (Megatron keeps both in sync).
        apart = last_rank(lo) != 0
        root += h + (vocab if not c.tie_embeddings or apart else 0)
        matmul += vocab
        # the extra training heads' own layers (their blocks are among the kinds above), with
        # a copy of the embedding when it lives on another rank and the head is not one
        own = HEADS.params(c, t, apart and not c.tie_embeddings)
        root += own
        matmul += sum(i * o for i, o in HEADS.linears(c, t))
    dense += root
    return StageParams(sum(kinds.values()), dense, expert, matmul, layer_unit, root,
                       block_linear)


def state_bytes(work: Workload, lo: Layout, p: StageParams) -> dict[str, float]:
    """Weights, gradients and optimizer states of one rank, as its ZeRO stage holds them."""
    n_dense = shard_ranks(lo)
    zero = ZERO[lo.zero]
    out = zero.states(p.dense, p.expert, n_dense, expert_copies(lo, n_dense),
                      work.state_cost.bytes)
    if work.fp8_params and work.precision.float8_linears:
        # FP8 primary weights: the decoder-block linears held in float8, one byte each
        w = work.state_cost.bytes[0]
        out["params"] -= (w - 1) * p.block_linear / (n_dense if "params" in zero.sharded
                                                     else 1)
    return out


def checkpoint_host_bytes(lo: Layout, p: StageParams) -> float:
    """Bytes of the shards one rank of a stage writes at a checkpoint (the most loaded one:
    coordinate 0 of the axes holding copies): what it owns of the optimizer state -- 1 / N of
    the stage's parameters with ZeRO, all of them without -- times :data:`CHECKPOINT_BYTES`
    (+ :data:`CHECKPOINT_OUTER_BYTES` on island 0 of DiLoCo). ``checkpoint.async`` keeps a
    host copy of them."""
    zero = ZERO[lo.zero]
    n_dense = zero.owners(shard_ranks(lo))
    n_expert = zero.owners(expert_copies(lo, shard_ranks(lo)))
    per = CHECKPOINT_BYTES + (CHECKPOINT_OUTER_BYTES if lo.islands > 1 else 0)
    return per * (p.dense / n_dense + p.expert / n_expert)


# ---------------------------------------------------------------------- activations
def layer_activations(work: Workload, lo: Layout, moe: bool = False,
                      fused_norm: bool = False) -> dict[str, float]:
    """Bytes saved for backward by one layer for one micro-batch, without recomputation.

    Items are named after the tensors; ``scores`` is what selective recomputation of the
    attention core drops: the score matrix (softmax, dropout) or, with flash attention, the
    log-sum-exp. The core's output stays (it is the output projection's input). What the
    attention layer's projections keep (``q k v``, ``attention out``, a layer's own items such as latents, Qwen3's
    query/key norms) and how many linears read its input are its description's
    (``models/attention_cost.py``; ``fused_norm``: its norms keep 1/rms, not a copy).
    """
    c = work.model.config
    t = lo.tp
    tokens = lo.micro_batch * work.seq_len / lo.cp  # tokens of one micro-batch on this rank
    h, heads = c.dim, c.n_heads
    proj = projection_cost(c)
    f = c.expert_hidden * c.moe_topk + c.moe_shared_experts * c.expert_hidden if moe else (
        c.ffn_hidden)
    gated = work.model.gated_mlp or moe
    a = work.precision.act_bytes
    out_t = TENSOR[lo.sp].outside(t)  # tensors outside the tp regions (split only with sp)
    items: dict[str, float] = {}
    if work.profile == "megatron":
        # a linear's saved input: 16-bit, or its float8 copy (Transformer Engine under FP8)
        lin = 1 if work.fp8_saved_inputs and work.precision.float8_linears else 2
        items["norm inputs"] = 2 * h * 2 / out_t
        if work.dropout:
            items["dropout masks"] = 2 * h * 1 / out_t
        items["region inputs"] = 2 * h * lin / out_t  # Megatron gathers again in backward
        items.update(proj.saved(c, t, 2, work.profile, fused_norm))  # q k v, attention out
        items["attention out"] *= lin / 2  # the output projection's input
        # the first MLP linear's output (16-bit) and the activation's output, the second
        # linear's input (float8 under Transformer Engine's FP8)
        items["mlp"] = ((3 if gated else 1) * 2 + lin) * f / t
        # softmax output 2as + dropout mask as + dropout output 2as (sec. 4.1); flash attention
        # keeps an fp32 log-sum-exp per head instead
        items["scores"] = (heads * 4 if work.flash else (5 if work.dropout else 2) * heads
                           * work.seq_len / lo.cp) / t
    else:
        r = 4  # meshlm's RMSNorm and residual stream are fp32 (autocast leaves them)
        items["norm inputs"] = 2 * h * r / out_t
        items["norm normalised"] = 2 * (h + 1) * r / out_t
        # fp32: one tensor per region, shared by its linears; autocast: each linear's own copy
        items["region inputs"] = 2 * h * 4 if a == 4 else (
            proj.readers(c) + (2 if gated else 1)) * h * a
        items.update(proj.saved(c, t, a, work.profile, fused_norm))  # q k v, attention out
        items["mlp"] = (4 if gated else 2) * f * a / t
        # SDPA's log-sum-exp per head (fp32); eager attention keeps the softmax output
        items["scores"] = (heads * 4 if work.flash else 2 * heads * work.seq_len / lo.cp * a) / t
        if mask := attention_mask(work, lo):
            items["attention mask"] = mask / tokens
        if moe:  # the dispatch (models/moe.py), counted: per routed copy the gathered expert
            # input, its sorted-order copy and the expert's output (for the weighted combine);
            # fp32 router probabilities, top-k indices (int64) and weights, the sort's indices
            k = c.moe_topk
            items["routed copies"] = 3 * k * h * a
            items["routing"] = 4 * c.moe_experts + k * (8 + 4 + 4) + 2 * k * 8 + 12
    return {k: v * tokens for k, v in items.items()}


def attention_mask(work: Workload, lo: Layout) -> float:
    """Bytes of the attention mask one layer keeps for one micro-batch: the kernel's
    (``models/attention_spec.py``) when attention is more than causal and the kernel keeps one
    per layer, over the whole sequence; with cp, only where the mode keeps one
    (``parallel/context_cost.py``)."""
    kernel = work.attention
    if not work.attention_masked or not kernel.mask_per_layer or (
            lo.cp > 1 and not CONTEXT[lo.cp_attention].keeps_mask):
        return 0.0
    return kernel.mask_bytes(lo.micro_batch, work.seq_len, True, work.doc_len > 0)


def compiled(work: Workload) -> bool:
    """Whether the workload's blocks are meshlm's compiled ones (``train.compile``)."""
    return work.profile == "meshlm" and work.kernels == "fused"


def compiled_layer_activations(work: Workload, lo: Layout) -> dict[str, float]:
    """Bytes a compiled meshlm dense block saves for one micro-batch (module docstring;
    measured on inductor's graphs by tests/test_planner.py)."""
    c = work.model.config
    t = lo.tp
    tokens = lo.micro_batch * work.seq_len / lo.cp
    h = c.dim
    a = work.precision.act_bytes
    out_t = TENSOR[lo.sp].outside(t)
    items = {
        "residual": h * 4 / out_t,  # fp32, after the attention half
        "norm rstd": 2 * 4 / out_t,
        "region inputs": 2 * h * a,  # each region's input once, in the compute dtype
        # q k v; the attention output twice: SDPA's and the projection's input layout
        **projection_cost(c).compiled_saved(c, t, a),
        "scores": c.n_heads * 4 / t,  # log-sum-exp
        "mlp": (3 if work.model.gated_mlp else 2) * c.ffn_hidden * a / t,
    }
    if mask := attention_mask(work, lo):
        items["attention mask"] = mask / tokens
    return {k: v * tokens for k, v in items.items()}


def saved_layer(work: Workload, lo: Layout, hw: Accelerator, moe: bool = False
                ) -> dict[str, float]:
    """What one layer saves for one micro-batch without recomputation: the compiled block's
    tensors, or the eager ones (MoE feed-forwards stay eager). Eager on a GPU, ``F.rms_norm``
    is torch's fused kernel, which saves 1/rms beside its input instead of the normalised
    input (``Workload.fused_norm`` overrides the choice by device)."""
    if compiled(work) and not moe and RECOMPUTE[lo.recompute].whole_layer:
        return compiled_layer_activations(work, lo)
    fused_norm = not hw.is_cpu if work.fused_norm is None else work.fused_norm
    items = layer_activations(work, lo, moe, fused_norm and work.profile == "meshlm")
    if work.profile == "meshlm" and fused_norm:
        tokens = lo.micro_batch * work.seq_len / lo.cp
        items["norm normalised"] = 2 * 4 / TENSOR[lo.sp].outside(lo.tp) * tokens
    return items


def matmul_outputs(work: Workload, lo: Layout) -> list[float]:
    """Output features per token of a dense layer's matmuls on one rank, in forward order:
    the attention layer's (q, k, v, the output projection; ``models/attention_cost.py``),
    then the MLP's (w1, w3, w2 or fc1, fc2). Row-parallel outputs are partial sums of the
    full width."""
    c, t = work.model.config, lo.tp
    f = c.ffn_hidden
    mlp = [f / t, f / t, c.dim] if work.model.gated_mlp else [f / t, c.dim]
    return [o for _, o in projection_cost(c).linears(c, t)] + mlp


def op_saved(work: Workload, lo: Layout) -> float:
    """Bytes a dense layer keeps per micro-batch under op-level selective recomputation."""
    c = work.model.config
    tokens = lo.micro_batch * work.seq_len / lo.cp
    a = work.precision.act_bytes
    r = 2 if work.profile == "megatron" else 4  # the layer input (meshlm: fp32 residual)
    kept = sum(matmul_outputs(work, lo)[0::2]) * a  # the 1st, 3rd, ... matmul outputs
    out = projection_cost(c).widths(c).out
    kept += out / lo.tp * a + c.n_heads * 4 / lo.tp  # attention out + lse
    return (kept + c.dim * r / TENSOR[lo.sp].outside(lo.tp)) * tokens


def recomputed(items: dict[str, float], work: Workload, lo: Layout, moe: bool = False
               ) -> float:
    """Bytes one layer keeps for one micro-batch under ``lo.recompute`` (its description,
    ``parallel/recompute_cost.py``)."""
    tokens = lo.micro_batch * work.seq_len / lo.cp
    r = 2 if work.profile == "megatron" else 4  # the layer input (meshlm: fp32 residual)
    layer_input = work.model.config.dim * r * tokens / TENSOR[lo.sp].outside(lo.tp)
    return RECOMPUTE[lo.recompute].kept(items, moe, op_saved(work, lo), layer_input)


def block_linears(work: Workload, lo: Layout, moe: bool) -> list[tuple[float, float]]:
    """(input, output) features on one rank of a layer's decoder-block linears (the ones
    ``dtype="fp8"`` runs in float8): attention, then the dense MLP or a MoE layer's shared
    experts (the router and the routed experts are not among them)."""
    c, t, h = work.model.config, lo.tp, work.model.config.dim
    attn = projection_cost(c).linears(c, t)  # (models/attention_cost.py)
    if moe:
        fs = c.moe_shared_experts * c.expert_hidden / t
        return attn + ([(h, fs), (h, fs), (fs, h)] if fs else [])
    f = c.ffn_hidden / t
    return attn + ([(h, f), (h, f), (f, h)] if work.model.gated_mlp else [(h, f), (f, h)])


def fp8_casts(work: Workload, lo: Layout, stage: int) -> float:
    """Bytes of the float8 casts at their peak on pipeline rank ``stage``: the largest of its
    decoder-block linears' (the precision's ``cast_peak``; profile ``meshlm`` only, 0 when the
    linears are not float8). Transient: it comes and goes inside one linear's forward or
    backward."""
    precision = work.precision
    if not precision.float8_linears or work.profile != "meshlm":
        return 0.0
    tokens = lo.micro_batch * work.seq_len / lo.cp  # a region's input is whole over tp
    return max((precision.cast_peak(tokens, k, n)
                for moe in layer_kinds(work, lo, stage) for k, n in block_linears(work, lo, moe)),
               default=0.0)


def in_flight(lo: Layout, m: int, stage: int = 0) -> float:
    """Micro-batches (in units of the rank's whole layer share) pipeline rank ``stage`` holds
    at its peak: one without a pipeline, else the schedule's (``parallel/schedule_cost.py``)."""
    if lo.pp == 1:
        return 1.0
    return SCHEDULES[lo.pp_schedule].in_flight(lo.pp, lo.pp_virtual, m, stage)


def head_activations(work: Workload, lo: Layout, first: bool, last: bool) -> float:
    """Embedding (first stage) and final norm, head input and logits (last stage), once per
    head pass (the extra training heads add theirs, and their modules' own inputs:
    ``models/technique.py``)."""
    c = work.model.config
    tokens = lo.micro_batch * work.seq_len / lo.cp
    out_t = TENSOR[lo.sp].outside(lo.tp)
    a = work.precision.act_bytes
    total = 8.0 * tokens if first else 0.0  # token ids (int64)
    if work.profile == "megatron" and first and work.dropout:
        total += c.dim * tokens / out_t  # embedding dropout mask
    if last:
        norm = (2 * c.dim if work.profile == "megatron" else 2 * (c.dim + 1) * 4) / out_t
        head_in = c.dim * (4 if a == 4 and work.profile == "meshlm" else 2)
        v_local = math.ceil(c.vocab_size / lo.tp)
        # torch: fp32 log-probabilities; fused: the logits in their dtype (gradient in place);
        # chunked: no logits, the head input's fp32 gradient (formed in forward) instead
        logits = {"torch": 4 * v_local, "fused": a * v_local, "chunked": 4 * c.dim}[work.loss]
        if work.loss == "torch" and compiled(work) and lo.tp == 1:
            logits = a * v_local  # the compiled loss saves its input, the logits

        total += (norm + head_in + logits + 8) * tokens * HEADS.head_passes(c)
        # the extra training heads' own saved inputs (none without them)
        total += HEADS.saved(c, a, work.profile, out_t) * tokens
        if work.loss == "chunked":  # and the head weight's fp32 gradient (V/t x h)
            total += 4 * v_local * c.dim
    return total


# ---------------------------------------------------------------------- the breakdown
def largest_tensor(work: Workload, lo: Layout, stage: int) -> float:
    """Elements of the largest parameter tensor pipeline rank ``stage`` holds (after tp/ep)."""
    c, t = work.model.config, lo.tp
    h = c.dim
    sizes = [projection_cost(c).largest(c, t), work.model.mlp_matrices and c.ffn_hidden * h / t]
    if c.moe_experts:
        sizes.append(c.expert_hidden * h)
    if stage in (0, last_rank(lo)):
        sizes.append(math.ceil(c.vocab_size / t) * h)
    return max(sizes)


def step_temporaries(work: Workload, lo: Layout, p: StageParams, stage: int) -> float:
    """Device bytes the optimizer step allocates beyond the states: AdamW's temporaries
    (foreach: 4 bytes per parameter of the largest group it steps, the decayed matrices; none
    when the moments are offloaded, or fused), or -- before it, not beside it -- clipping by a
    sharded global norm (each gradient tensor squared in fp64: 16 bytes per element of the
    largest; torch's own clipping on whole gradients takes per-tensor norms)."""
    zero = ZERO[lo.zero]
    owned = p.total / zero.owners(shard_ranks(lo))
    adam = OPTIMIZER_TEMP[work.optimizer] * owned if not OFFLOAD[lo.offload].off_device else 0.0
    sharded_norm = lo.tp > 1 or lo.pp > 1 or lo.ep > 1 or (zero.shards and lo.dp * lo.cp > 1)
    clip = 16 * largest_tensor(work, lo, stage) if sharded_norm else 0.0
    return max(adam, clip)


def frees_gradients(lo: Layout) -> bool:
    """Whether a step of one micro-batch frees the gradients between steps: one process
    (no data, context, pipeline or island ranks) whose ZeRO stage shards nothing, so nothing
    keeps them (``zero_grad(set_to_none=True)``)."""
    return (not ZERO[lo.zero].shards and lo.dp * lo.cp == 1 and lo.pp == 1
            and lo.islands == 1)


def stage_memory(work: Workload, lo: Layout, hw: Accelerator, stage: int) -> MemoryBreakdown:
    p = stage_params(work, lo, stage)
    items = state_bytes(work, lo, p)
    host = {}
    if OFFLOAD[lo.offload].off_device:  # moments in host memory or a file
        host["optim"] = items["optim"]
        items["optim"] = 0.0
    m = lo.micro_batches(work.global_batch)
    per_layer = 0.0
    working = 0.0  # one layer's full activations, rebuilt during its backward
    for is_moe, count in layer_kinds(work, lo, stage).items():
        full = saved_layer(work, lo, hw, moe=is_moe)
        per_layer += count * recomputed(full, work, lo, is_moe)
        working = max(working, sum(full.values()))
    acts = per_layer * in_flight(lo, m, stage)
    acts += head_activations(work, lo, stage == 0, stage == last_rank(lo))
    items["activations"] = acts
    # Transient peaks on top of the saved activations (they do not coincide): the loss's
    # backward holds the fp32 gradients of the log-probabilities and of the logits beside the
    # saved log-probabilities (LOSS_WORKING bytes per logit; counted on torch's
    # cross_entropy; the compiled loss writes the logits' gradient in their dtype), and full
    # recomputation rebuilds one layer's activations in backward.
    tokens = lo.micro_batch * work.seq_len / lo.cp
    v_local = math.ceil(work.model.config.vocab_size / lo.tp)
    loss = 0.0
    if stage == last_rank(lo) and work.loss == "torch":
        per_logit = (work.precision.act_bytes if compiled(work) and lo.tp == 1
                     else LOSS_WORKING)
        loss = per_logit * tokens * v_local
    elif stage == last_rank(lo) and work.loss == "chunked":  # one chunk's logits, twice in fp32
        loss = LOSS_WORKING * min(tokens, work.loss_chunk) * v_local
    # the float8 casts of one linear: beside a fully recomputed layer's rebuilt activations
    recompute = RECOMPUTE[lo.recompute]
    rebuilt = working if recompute.input_only else 0.0
    items["transient"] = max(loss, rebuilt + fp8_casts(work, lo, stage))
    w, g, _ = work.state_cost.bytes
    # the ``megatron`` profile's ZeRO-3 is DeepSpeed's (its live-parameter cap)
    items["buffers"] = ZERO[lo.zero].buffers(p.total, p.layer_unit, p.root_unit, w, g,
                                             deepspeed=work.profile != "meshlm")
    # autocast's copies of the weights in the compute dtype: cached through the forward and
    # kept for backward by the matmuls (full recomputation rebuilds them layer by layer)
    # (the precision's: none without autocast, none of float8 linears' weights)
    copies = 0.0
    if work.profile == "meshlm":
        copies = work.precision.weight_copies(p.matmul, p.block_linear)
    items["weight copies"] = copies
    items["step temporaries"] = step_temporaries(work, lo, p, stage)
    # gradients alive through the forward and backward: kept between micro-batches or steps
    # by accumulation, buckets, shards or a pipeline; one process with one micro-batch frees
    # them each step, and they fill up during a fully recomputed backward beside it
    freed = frees_gradients(lo) and m == 1
    phases = {k: list(v) for k, v in PHASES.items()}
    if not freed or recompute.input_only:
        phases["backward"].append("grads")
    if not freed:
        phases["forward"].append("grads")
    if recompute.input_only:
        phases["backward"].remove("weight copies")
    out = MemoryBreakdown(items, stage, hw.memory, host,
                          {k: (*v, "reserved") for k, v in phases.items()},
                          checkpoint_host_bytes(lo, p))
    items["reserved"] = 0.0
    reserve = 0.0 if hw.is_cpu else ALLOCATOR_RESERVE * out.total
    items["reserved"] = hw.reserved + reserve
    return out


def memory(work: Workload, lo: Layout, hw: Accelerator) -> MemoryBreakdown:
    """Memory of the most loaded pipeline stage: the first, the last or the last rank (in a V
    rank 0 holds the first and the last stage, rank pp - 1 the most chunks in flight; any
    stage under an explicit ``pp_layers`` split)."""
    stages = range(lo.pp) if lo.pp_layers else {0, lo.pp - 1, last_rank(lo)}
    return max((stage_memory(work, lo, hw, s) for s in stages), key=lambda b: b.total)
