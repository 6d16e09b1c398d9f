"""Step time of a layout: compute + exposed communication + pipeline bubble + optimizer.

**Compute** of one micro-batch on one pipeline stage, forward + backward (+ recomputation),
summed over its operations (a roofline per operation, Williams et al. 2009):

- each linear layer: forward ``2 M K N`` FLOPs, backward twice that (input and weight
  gradients), at the achievable GEMM rate of the dtype the precision runs it in
  (``precision_cost.py``: the decoder-block linears', or the rest's); on a GPU ``max`` with its operand bytes over memory
  bandwidth, on CPU plus the time to write its fresh output buffers (page faults add there;
  they dominate thin GEMMs with wide outputs, such as a small model's LM head);
- attention scores and values: ``2 s_q s (q + o)`` FLOPs forward (``q``, ``o``: the kernel's
  query and output widths, ``models/attention_cost.py``: ``4 s_q s h_q`` for grouped-query
  attention, each kind of attention layer its own widths), 3x for forward + backward, half of them done under the causal mask, at the
  fused-attention rate for the query/key head width (materialised scores, before
  FlashAttention: all of them at the GEMM rate);
- a MoE layer's routed experts: one GEMM per local expert of its share of the routed rows,
  each reading its own weights (``models/moe_cost.py``: the kernel family's efficiency and
  eager ops); the extra training heads' blocks are the last stage's layers, their own linears
  and extra head and loss passes the head's (``models/technique.py``);
- memory-bound work (norms, rotary embedding, SwiGLU/GELU, residual adds, autocast casts and
  their gradients): the compute dtype's traffic ratio (``precision_cost.py``: ``C_TRAFFIC``,
  counted, not fitted, on meshlm's block) x the bytes meshlm's block saves for backward
  (memory.py's ``meshlm`` profile, whatever profile the workload's memory uses) over memory
  bandwidth. It is the traffic of an eager PyTorch Llama block: fused kernels (Megatron, torch.compile) move less, and the planner does
  not credit them unless the workload says ``kernels="fused"``: then the traffic is counted
  per fused kernel, each reading its inputs and writing its outputs once per token
  (:data:`FUSED_ELEMENTS`: two RMSNorms, rotary on q and k, SwiGLU / GELU, two residual
  adds, forward and backward; norms and adds in fp32 where the states are, as meshlm's
  residual stream) -- Megatron-Core with Transformer Engine, NeMo, flash-attn's
  kernels, torch.compile'd blocks. Eager kernels run at ``Accelerator.eager_eff`` of the
  line rate where it was measured (H200: calibrated on meshlm's eager and compiled rows),
  fused ones at ``hbm_eff``. Under tensor parallelism the saved bytes split as the work
  does (norms over sequence shards with sp, the regions' interior over tp); tp adds 4
  activation copies per layer (the clones around its all-reduces,
  ``parallel/tensor_comm.py``);
- the loss: ``CE_PASSES`` passes over fp32 logits (casts, log-softmax, its gradient), or
  ``FUSED_CE_PASSES`` over the logits in their dtype for a fused loss; on CPU
  the measured per-element cost of (vocab-parallel) cross-entropy forward + backward;
  meshlm's chunked loss forms the head weight's gradient in fp32 (one of the head's three
  GEMMs on the CUDA cores: ``Accelerator.peak_fp32_simt``, TF32 being off by default);
- per-operation overhead: ``OPS_PER_LAYER`` eager ops per layer (counted with
  TorchDispatchMode on meshlm's block) x the dispatch cost; serial on CPU, hidden behind
  running kernels on a GPU (a layer then takes at least its kernels' launch time).

Recomputation adds what the mode redoes (``parallel/recompute_cost.py``: full one forward of
every layer, selective one forward of attention only, op-level the forwards of every other
matmul and of the memory-bound ops). On CPU, ranks beyond the cores
time-share them: the compute of each stretches by ranks / cores, and a pipeline rank's idle
bubble is used by others. A power-capped GPU computes at ``(cap / TDP) ** 0.58`` of its rate
(``hardware.POWER_EXPONENT``).

**Communication** per step (volumes are the comm log's bytes, the formulas of
``parallel/data.py``, ``zero.py``, ``zero3.py``, ``tensor.py``, ``pipeline.py``; the
Ultra-Scale Playbook for cp and ep), each timed over the link its axis crosses: the mesh orders
axes pp, dp, cp, tp from outer to inner, so an axis whose ranks span at most one node (stride x
size <= GPUs per node) uses NVLink, otherwise the network. Ring collectives over n ranks move
``(n-1)/n`` of the buffer per rank (twice for all-reduce) plus a latency per ring step;
all-reduce across nodes may use NCCL's tree (``2 log2 n`` steps). Overlap, as meshlm's engines
do it:

- the ZeRO stage's messages and what hides them are its description's
  (``parallel/zero_cost.py``: bucketed beside the last backward, beside each backward, after
  the optimizer step, ZeRO-3's prefetched gathers); with pipelining a once-per-step
  gradient reduction runs after the flush (meshlm, Megatron before Megatron-Core's
  overlap_grad_reduce): exposed, while ZeRO-2's reduce-scatter per micro-batch stays inside
  each backward; a stack that overlaps them (``Workload.dp_overlap``: Megatron-Core) hides
  the reduction behind the last micro-batch's backward and ZeRO-1's parameter all-gather
  behind the next forward;
- hybrid sharding (``dp_shard`` < dp): ZeRO's reduce-scatters and all-gathers run within the
  shard group (dp_shard x cp ranks, ``tp`` apart: inside a node when tp x dp_shard x cp <= GPUs
  per node), and the replicas' all-reduce of each gradient shard (experts: over edp_shard)
  runs between ranks ``tp x cp x dp_shard`` apart, typically across nodes, on the other link;
- DiLoCo islands (``islands`` > 1): each rank's owned shard all-reduced across islands once
  every ``inner_steps`` steps, in the cross-island dtype -- exposed, its time divided by H;
- tensor/sequence parallel collectives (``parallel/tensor_cost.py``) and pipeline sends are
  on the critical path: exposed (with ``tp_overlap`` -- async TP, published runs only -- the
  collectives hide behind the GEMMs; so do an interleaved schedule's sends where the stack
  overlaps them, ``Workload.pp_overlap``: Megatron-Core's overlap_p2p_comm);
  pipeline sends carry fp32 activations (meshlm's executor) or, for other frameworks
  (``Workload.p2p_dtype``), the compute dtype, split over tp with Megatron's scatter/gather
  (``p2p_split``: 1/tp per rank plus an all-gather over tp on the receiving stage);
- gradients cross data parallelism in the states' gradient dtype, or in fp32
  (``Workload.fp32_grad_reduce``: Megatron bf16, nanotron, torchtitan); a separate fp32
  accumulation pass (``grad_accum_pass``, nanotron) costs ``ACCUM_BYTES`` per parameter and
  micro-batch over memory bandwidth;
- context parallelism's messages and what hides them are its mode's
  (``parallel/context_cost.py``: ring attention beside the attention compute, Ulysses'
  all-to-alls exposed); with cp, weight gradients are reduced over dp x cp (comm-log axis
  ``dp_cp``); expert all-to-alls: exposed, unless the run overlaps them with another
  micro-batch (``Workload.ep_overlap``) or its schedule pairs passes (DualPipeV): then they
  hide behind the paired micro-batch's whole computation (attention and MLP alike);
- an all-to-all across nodes sends each peer its piece at once: the pieces for the group's
  ranks on the same node go over NVLink while the rest cross the network, and the longer of
  the two transfers is its time; an expert dispatcher that sends a token once per node
  (``Workload.ep_dispatch``, ``planner/dispatch.py``: DeepEP) puts fewer bytes on the
  network. The expert group's ranks are tp apart in meshlm's mesh, consecutive where the
  stack folds experts over tp (``experts_over_tp``: Megatron-Core's expert rank order) or
  the layout folds the expert group over tp x dp x cp (``Layout.ep_over_tp``: an expert's
  copies are then tp x dp x cp / ep ranks, ep apart);
- on CPU (gloo) nothing overlaps: the transport uses the same cores.

**Bubble**: the schedule's share of the other stages' micro-batch times
(``parallel/schedule_cost.py``: ``(p - 1) / v`` for AFAB, 1F1B, interleaved 1F1B and looped
BFS, ``(p - 1) / 3`` for ZB-H1, ZB-V / DualPipeV / interleaved zero bubble replayed, given the
forward / input-gradient / weight-gradient shares); with unequal stages (embedding, head and
loss on the ends) the slowest stage sets the pace and the bubble is the other stages' times. **Optimizer**: clipping and AdamW move
``ADAMW_BYTES[work.optimizer]`` per parameter a rank owns (torch's fused or foreach kernels;
CPU: measured per parameter). With fp32 states and 16-bit matmuls (meshlm) autocast's weight
casts and the fp32 gradient accumulation add the precision's cast bytes per parameter and
micro-batch (``precision_cost.py``: ``CAST_BYTES``).

MFU = model FLOPs (6N + attention, PaLM convention, ``ModelConfig.flops_per_token``) per
second / (ranks x peak: the precision's, ``precision_cost.py``); HFU also counts
recomputation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..layout import Layout
from ..models.attention_cost import projection_cost
from ..models.config import ModelConfig
from ..models.moe_cost import EXPERT_KERNELS
from ..models.techniques import HEADS
from ..parallel.context_cost import CONTEXT
from ..parallel.cost import Collective
from ..parallel.offload_cost import OFFLOAD
from ..parallel.recompute_cost import RECOMPUTE
from ..parallel.schedule_cost import SCHEDULES
from ..parallel.tensor_cost import TENSOR
from ..parallel.zero_cost import BUCKET_BYTES, ZERO
from ..precision_cost import (
    C_TRAFFIC,  # noqa: F401 (re-exported: a test recounts it)
    PrecisionCost,
    value_bytes,
)
from .dispatch import shares as dispatch_shares
from .hardware import Accelerator, Rates, _nearest
from .memory import (
    expert_copies,
    last_rank,
    layer_activations,
    layer_kinds,
    shard_ranks,
    stage_blocks,
    stage_params,
)
from .workload import FLASH_SPEED, Workload

# torch's cross-entropy on fp32 logits, forward + backward, in passes over the fp32 logits
# (counted with TorchDispatchMode on ``F.cross_entropy(logits.float(), y)``; a test recounts
# it): the cast up 1.5 (read 16-bit, write fp32), log-softmax 2, nll_loss's backward fills a
# zero gradient 1, log-softmax's backward 3 (gradient and output in, gradient out), the cast
# back 1.5
CE_PASSES = 9.0
FUSED_CE_PASSES = 3.0  # fused loss: read the logits (forward), read + write them (gradient)
# a separate fp32 gradient accumulation pass (Workload.grad_accum_pass): read the 16-bit
# gradient, read and write the fp32 buffer, per parameter and micro-batch
ACCUM_BYTES = 2 + 4 + 4
OPS_PER_LAYER = 203  # aten ops of one meshlm block, forward 68 + backward 135 (fp32)
# A MoE layer's extra aten ops, forward + backward (counted with TorchDispatchMode on
# tiny-moe with 4 and 8 experts, with and without a shared expert, ep 1 and 2): routing
# (router, top-k, sort, scatter) 24, each local expert 40 when they run one by one (the
# routed experts' ops are their kernel family's, models/moe_cost.py: meshlm's grouped GEMM
# adds 38 whatever the experts), a shared expert 35, the expert-parallel exchange (split
# sizes, two all-to-alls, regrouping) 34.
MOE_OPS = {"routing": 24, "expert": EXPERT_KERNELS["loop"].ops_per_expert, "shared": 35,
           "exchange": 34}
# ``kernels="fused"``: elements read + written per token by a fused block's memory-bound
# kernels, forward + backward, as (per hidden h, per KV width, per MLP hidden f, per MLP input
# of a non-gated MLP). Forward: RMSNorm 2h (x2), rotary 2(h + kv), residual add 3h (x2),
# SwiGLU 3f (read both halves, write the product; GELU 2f); backward: RMSNorm 3h (x2: x, dy
# -> dx), rotary 2(h + kv), residual gradient adds 3h (x2), SwiGLU 5f (GELU 3f). Sum:
# 26 h + 4 kv + 8 f (SwiGLU) or 5 f (GELU). Counted per kernel, not measured.
FUSED_ELEMENTS = {"h": 26.0, "kv": 4.0, "f_gated": 8.0, "f_plain": 5.0}
FUSED_ROTARY_H = 4.0  # of the 26 h: rotary on q (query width, compute dtype), fwd + bwd
FUSED_KERNELS_PER_LAYER = 20  # norms, rotary, activation, adds, attention, GEMMs, fwd + bwd
KERNELS_PER_LAYER = 96  # of which launch a kernel (the rest are views)
# Host link per GPU for ZeRO-Offload's copies: PCIe Gen4 / Gen5 x16, ~80 % of 32 / 64 GB/s per
# direction (nvbandwidth host-to-device figures); host AdamW: ~100 GB/s of a 2-socket host's
# memory bandwidth shared by 8 GPUs (DeepSpeed's CPU-Adam is bandwidth-bound)
HOST_LINK = {"gen4": 25e9, "gen5": 50e9}
# Host AdamW (``parallel.offload=cpu``) in seconds per parameter for one GPU's share of the
# host (16 cores on the measured H200 machine; an HGX node's ~112-128 cores over 8 GPUs is the
# same share). ``foreach``: calibrated on the measured 820M row (1.139 s/step: the step less
# the planner's GPU compute and host-link copies, over 820.6 M parameters, is 0.85 ns per
# parameter; the llama3-8b row, 7.95-8.87 s at its two steps, is then predicted at 8.5 s).
# meshlm streams the
# moments through in 1 Mi-element chunks, copies and host step in series
# (``parallel/offload.py``). ``fused``: torch's fused CPU AdamW, taken as 4x the foreach
# kernels' rate per parameter: ``benchmarks/offload_step.py`` on one core measured 5.2x in
# place and 2.1x through offload's staging, whose CPU-to-CPU copies (~0.3 s per 100 M
# parameters there) a GPU run makes over the host link instead, counted apart -- the host step
# alone is ~3.4x (not yet measured on a GPU host).
HOST_ADAM = {"foreach": 0.85e-9, "fused": 0.85e-9 / 4}
# AdamW's bytes per parameter, gradient clipping included, by torch implementation (counted
# with TorchDispatchMode on ``clip_grad_norm_(foreach=True)`` + ``AdamW.step``; a test
# recounts them): ``fused`` -- the norm reads g (4), the clip scales it (8), one kernel reads
# p, g, m, v and writes p, m, v (28); ``foreach`` -- the same clipping, then one pass per
# foreach op: weight decay on p (8), lerp of m (12), v scaled (8) and addcmul'd (12), sqrt
# into a temporary (8), its division and epsilon (8 + 8), addcdiv into p (16). meshlm steps
# with ``fused`` on CUDA (``train.adamw_impl=auto``); the H200 rows of
# ../shared/data/gpu_h200_2026-11.md were measured with ``foreach``.
ADAMW_BYTES = {"fused": 40.0, "foreach": 92.0}
OPTIM_BYTES = ADAMW_BYTES["fused"]


@dataclass
class CommEvent:
    """One kind of collective of a step: ``calls`` calls of ``nbytes`` (comm log bytes)."""

    name: str  # dimension: dp, tp, pp, cp, ep, islands
    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, send
    axis: str  # comm-log axis name
    nbytes: float
    calls: float
    group: int
    stride: int  # distance between consecutive group members in the rank order
    overlap: str  # how it hides (see module docstring)
    seconds: float = 0.0
    # an all-to-all's (network, NVLink) shares of ``nbytes`` for a group of n ranks, ``local``
    # per node, where a dispatcher decides them (planner/dispatch.py); None: one piece per peer
    shares: Callable[[int, int], tuple[float, float]] | None = None


@dataclass
class TimeBreakdown:
    """One optimizer step: its seconds and their parts, the rates, the communication."""

    step: float = 0.0  # seconds per step, the sum of ``items``
    items: dict[str, float] = field(default_factory=dict)  # seconds per step
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    hfu: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)  # per dimension, before overlap
    volumes: dict[str, float] = field(default_factory=dict)  # comm-log bytes per "op/axis"
    micro_batches: int = 1
    t_micro: float = 0.0  # the slowest stage's micro-batch time


# ---------------------------------------------------------------------- collectives
def threads_per_rank(hw: Accelerator, world: int) -> int:
    """meshlm's CPU launch: one process uses every core; workers get one thread each."""
    return (hw.cpu.cores if world == 1 else 1) if hw.cpu is not None else 1


def collective_time(hw: Accelerator, op: str, nbytes: float, n: int, stride: int,
                    procs: int = 1,
                    shares: Callable[[int, int], tuple[float, float]] | None = None) -> float:
    """Seconds of one collective over ``n`` ranks ``stride`` apart (see module docstring);
    ``shares``: an all-to-all's (network, NVLink) shares of ``nbytes`` (planner/dispatch.py)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if hw.cpu is not None:
        key = op if op in hw.cpu.collectives else "all_gather"
        lat, bw = _nearest(hw.cpu.collectives[key], n)
        # Calibrated with n processes alone; more processes than cores time-share the cores.
        scale = max(1.0, procs / hw.cpu.cores) / max(1.0, n / hw.cpu.cores)
        return (lat + nbytes / bw) * scale
    inter = stride * n > hw.gpus_per_node
    bw = hw.inter_bw * hw.inter_eff if inter else hw.intra_bw * hw.intra_eff
    step = hw.inter_step_latency if inter else hw.intra_step_latency
    frac = (n - 1) / n
    if op == "all_reduce":
        ring = 2 * (n - 1)
        steps = min(ring, 2 * math.ceil(math.log2(n))) if inter else ring
        return hw.coll_latency + steps * step + 2 * frac * nbytes / bw
    if op == "send":
        return hw.coll_latency + step + nbytes / bw
    if op == "all_to_all" and inter:
        # every rank sends 1/n of its buffer to each peer, all at once: the pieces for the
        # peers on its own node go over NVLink while the rest cross the network, in parallel
        local = max(1, min(n, hw.gpus_per_node // max(1, stride)))  # group members per node
        net, nvlink = shares(n, local) if shares else ((n - local) / n, (local - 1) / n)
        return (hw.coll_latency + (n - 1) * step
                + max(nvlink * nbytes / (hw.intra_bw * hw.intra_eff), net * nbytes / bw))
    return hw.coll_latency + (n - 1) * step + frac * nbytes / bw  # ag, rs, all-to-all


# ---------------------------------------------------------------------- compute
def _gemm(m: float, k: float, n: float, a: int, rate: float, rates: Rates) -> float:
    """Forward + backward seconds of one linear layer: its 3 GEMMs (output, input gradient,
    weight gradient). GPU: roofline per GEMM. CPU: compute plus writing the three fresh
    output buffers (page faults make that cost add, not overlap; it dominates thin GEMMs
    with wide outputs such as a small model's LM head)."""
    flops = 2 * m * k * n
    outputs = a * (m * n + m * k + k * n)
    if rates.serial_ops:
        return 3 * flops / rate + outputs / rates.bandwidth(a * m * max(n, k))
    nbytes = a * (m * k + k * n + m * n)
    return 3 * max(flops / rate, nbytes / rates.bandwidth(nbytes))


def folds_tp(work: Workload, lo: Layout) -> bool:
    """Whether a MoE layer's routed rows split over tp and its expert group's ranks are
    consecutive: the stack does so (``Workload.experts_over_tp``), or the layout folds the
    expert group over tp (``Layout.ep_over_tp``: each tp rank dispatches its own rows)."""
    return work.experts_over_tp or lo.ep_over_tp


def other_dtype(work: Workload) -> str:
    """The dtype of the matmuls outside the decoder-block linears (the LM head, the router,
    materialised attention scores, the extra heads' linears): the precision's compute dtype
    (``precision_cost.py``: no stack runs them in float8)."""
    return work.precision.compute.name


def expert_dtype(work: Workload) -> str:
    """The dtype of a MoE layer's routed experts: the linears' (float8) where the workload's
    stack runs them so (``Workload.fp8_experts``), else the compute dtype."""
    return work.precision.linears if work.fp8_experts else other_dtype(work)


def eager_saved(work: Workload, lo: Layout, moe: bool) -> float:
    """The bytes meshlm's block saves for one micro-batch on one rank under ``lo`` (memory.py's
    ``meshlm`` profile, whatever profile the workload's memory uses): the measure of its
    memory-bound work. Under tensor parallelism it splits as the elementwise work does --
    norms over sequence shards with sp, the regions' interior over tp -- and keeps what runs
    on gathered full-sequence tensors (each linear's autocast copy of its input) whole."""
    items = layer_activations(replace(work, profile="meshlm"), lo, moe)
    if work.fp8_saved_inputs and work.precision.float8_linears:
        # a stack that keeps the linears' inputs in float8 (Transformer Engine: the norm, the
        # activation and the cast fused, Workload.fp8_saved_inputs) writes and reads them at
        # one byte: each linear's input copy, the output projection's input and the second
        # MLP linear's input (one of the MLP's tensors; memory.py's megatron profile alike)
        a = work.precision.act_bytes
        tokens = lo.micro_batch * work.seq_len / lo.cp
        c = work.model.config
        f = (c.expert_hidden * (c.moe_topk + c.moe_shared_experts) if moe
             else c.ffn_hidden)  # (memory.py's layer_activations)
        items["region inputs"] /= a
        items["attention out"] /= a
        items["mlp"] -= (a - 1) * f / lo.tp * tokens
    return sum(items.values())


def moe_ops(c: ModelConfig, lo: Layout, experts: str = "grouped") -> float:
    """Eager ops a MoE layer adds to a dense block's :data:`OPS_PER_LAYER` on one rank, its
    routed experts' as the ``experts`` kernel family runs them (``models/moe_cost.py``)."""
    return (MOE_OPS["routing"] + EXPERT_KERNELS[experts].eager_ops(c.moe_experts / lo.ep)
            + MOE_OPS["shared"] * (c.moe_shared_experts > 0)
            + MOE_OPS["exchange"] * (lo.ep > 1))


def layer_compute(work: Workload, lo: Layout, hw: Accelerator, rates: Rates, moe: bool
                  ) -> dict[str, float]:
    """Seconds of one (dense or MoE) layer for one micro-batch: forward + backward +
    recomputation."""
    c = work.model.config
    t, a = lo.tp, work.precision.act_bytes
    tokens = lo.micro_batch * work.seq_len / lo.cp
    h = c.dim
    proj = projection_cost(c)  # the attention layer's projections (models/attention_cost.py)
    widths = proj.widths(c)
    g_rate, o_rate = rates.gemm[work.precision.linears], rates.gemm[other_dtype(work)]
    e_rate = rates.gemm[expert_dtype(work)]
    lin = proj.linears(c, t)
    casts = 0.0  # float8 casts' traffic (precision_cost.py)
    if moe:
        # balanced router: each rank computes this many rows (1/tp of them where the stack
        # splits the routed rows over tensor parallelism: Workload.experts_over_tp)
        routed = tokens * c.moe_topk / (t if folds_tp(work, lo) else 1)
        fe = c.expert_hidden
        # each local expert's rows by its own weights (models/moe_cost.py: the kernel family)
        kernel = EXPERT_KERNELS[work.experts]
        n_gemms, rows = kernel.gemms(routed, c.moe_experts / lo.ep)
        gemm = (n_gemms * 3 * _gemm(rows, h, fe, a, e_rate * kernel.efficiency, rates)
                + _gemm(tokens, h, c.moe_experts, a, o_rate, rates))
        if work.fp8_experts:
            local = c.moe_experts / lo.ep
            casts += sum(work.precision.cast_traffic(work.fp8_casts, work.fp8_recipe, routed,
                                                     k, n, weights=local)
                         for k, n in ((h, fe), (h, fe), (fe, h)))
        shared = [(h, fe * c.moe_shared_experts / t)] * 2 + [(fe * c.moe_shared_experts / t,
                                                              h)]
        lin += shared if c.moe_shared_experts else []
    else:
        f = c.ffn_hidden / t
        lin += ([(h, f), (h, f), (f, h)] if work.model.gated_mlp else [(h, f), (f, h)])
        gemm = 0.0
    per_linear = [_gemm(tokens, k, n, a, g_rate, rates) for k, n in lin]
    gemm += sum(per_linear)
    casts += sum(work.precision.cast_traffic(work.fp8_casts, work.fp8_recipe, tokens, k, n)
                 for k, n in lin)
    if work.fp8_rescale and work.precision.float8_linears:  # (Workload.fp8_rescale) the
        # backward GEMMs' scales applied in a pass of their own: dx (m x k) and dW (k x n)
        # read and written once more in the compute dtype
        casts += sum(2 * a * (tokens * k + k * n) for k, n in lin)
    # Causal attention over the whole sequence: queries of this rank's s/cp tokens. Flash
    # kernels compute the kernel's share of the scores (models/attention_spec.py: the causal
    # half; all of them under a boolean mask; the unmasked tiles of a block-sparse kernel);
    # materialised scores are full batched GEMMs.
    # scores over the query/key width, values over the value width: 2 + 2 FLOPs per pair
    attn_flops = 2 * tokens * work.seq_len * (widths.q + widths.out) / t
    attn_rate = rates.attention(widths.head_dim) * FLASH_SPEED[work.flash_kernel]
    attn_fwd = (work.score_fraction * attn_flops / attn_rate if work.flash
                else max(attn_flops / o_rate, tokens * work.seq_len * c.n_heads / t * a
                               / rates.bandwidth(tokens * h * a)))
    tensor = tokens * h * a
    # tensor parallelism copies each region's output before its all-reduce, forward and
    # backward (parallel/tensor_comm.py): 4 activation copies (read + write) per layer
    copies = 4 * 2 * tensor / TENSOR[lo.sp].outside(lo.tp) if t > 1 else 0.0
    if work.kernels == "fused":
        f_width = (c.expert_hidden * c.moe_topk if moe else c.ffn_hidden) / t
        # the norms and residual adds run on the residual stream: fp32 beside fp32 weights
        # (the states'; memory.py's ``meshlm`` profile saves them so), else the compute dtype
        r = work.state_cost.residual_bytes(a)
        resid = FUSED_ELEMENTS["h"] - FUSED_ROTARY_H
        # rotary on the query and key features (and norms inside attention): the attention
        # layer's (models/attention_cost.py; GQA: FUSED_ROTARY_H hq + FUSED_ELEMENTS["kv"] kv)
        per_token = (resid * h * r / TENSOR[lo.sp].outside(t)
                     + (proj.fused_elements(c, t)
                        + FUSED_ELEMENTS["f_gated" if work.model.gated_mlp else "f_plain"]
                        * f_width) * a)
        traffic = per_token * tokens
        bw = rates.bandwidth(tensor)
    else:
        traffic = work.precision.traffic * eager_saved(work, lo, moe)
        # one kernel per op reaches less of the line rate than fused kernels (hardware.py)
        bw = rates.bandwidth(tensor) * rates.eager_scale
    elem = (traffic + copies + casts) / bw
    out = {"gemm": gemm, "attention": 3 * attn_fwd, "memory-bound": elem}
    redo = RECOMPUTE[lo.recompute].compute(gemm, per_linear, attn_fwd, elem, moe, work.flash)
    if redo is not None:
        out["recompute"] = redo
    if rates.serial_ops:
        ops = OPS_PER_LAYER + (moe_ops(c, lo, work.experts) if moe else 0)
        out["op overhead"] = ops * rates.op_overhead
    else:  # launches overlap kernels; a layer cannot run faster than it can launch them
        kernels = FUSED_KERNELS_PER_LAYER if work.kernels == "fused" else KERNELS_PER_LAYER
        launch = kernels * rates.op_overhead
        busy = sum(out.values())
        if launch > busy:
            out["op overhead"] = launch - busy
    return out


def head_compute(work: Workload, lo: Layout, hw: Accelerator, rates: Rates, first: bool,
                 last: bool) -> dict[str, float]:
    """Embedding (first stage), LM head and loss (last stage) for one micro-batch, the head
    and loss once per head pass, with the extra training heads' linears
    (``models/technique.py``; their blocks are the stage's layers)."""
    c = work.model.config
    tokens = lo.micro_batch * work.seq_len / lo.cp
    a = work.precision.act_bytes
    v_local = math.ceil(c.vocab_size / lo.tp)
    out: dict[str, float] = {}
    if first:  # lookup + dense gradient of the (local) embedding table
        table = v_local * c.dim * 4
        out["embedding"] = (tokens * c.dim * a + 2 * table) / rates.bandwidth(table)
    if last:
        out["head gemm"] = _gemm(tokens, c.dim, v_local, a, rates.gemm[other_dtype(work)],
                                 rates)
        if work.loss == "chunked" and work.precision.compute.autocast and rates.sgemm:
            # meshlm's chunked loss accumulates the head weight's gradient in fp32
            # (``parallel/loss.py``: ``grad_w.addmm_(logits.t(), xc.float())``; in-place, so
            # autocast leaves it fp32): one of the three GEMMs on the CUDA cores, TF32 off
            out["head gemm"] = (2 * out["head gemm"]
                                + _gemm(tokens, c.dim, v_local, 4, rates.sgemm, rates)) / 3
        logits = tokens * v_local
        if rates.ce is not None:  # measured (CPU); tp > 1 uses the vocab-parallel loss
            out["loss"] = logits * (rates.ce_tp if lo.tp > 1 and rates.ce_tp else rates.ce)
        elif work.loss == "fused":
            out["loss"] = FUSED_CE_PASSES * a * logits / rates.bandwidth(a * logits)
        else:
            out["loss"] = CE_PASSES * 4 * logits / rates.bandwidth(4 * logits)
        passes = HEADS.head_passes(c)  # the extra training heads: the head and loss again
        out["head gemm"] = out["head gemm"] * passes + sum(
            _gemm(tokens, k, n, a, rates.gemm[other_dtype(work)], rates)
            for k, n in HEADS.linears(c, lo.tp))
        out["loss"] = out["loss"] * passes
    return out


# ---------------------------------------------------------------------- communication
def comm_events(work: Workload, lo: Layout, stage: int = 0) -> list[CommEvent]:
    """Every collective of one step on a rank of ``stage`` (comm-log bytes per call)."""
    c = work.model.config
    p = stage_params(work, lo, stage)
    w, g, _ = work.state_cost.bytes
    a = work.precision.act_bytes
    m = lo.micro_batches(work.global_batch)
    tokens = lo.micro_batch * work.seq_len / lo.cp
    # ZeRO's group: dp x cp, or one shard group (dp_shard x cp) whose replicas then reduce
    # each gradient shard across ``dp_rep`` (hybrid sharding; the mesh's axis names)
    zero = ZERO[lo.zero]
    hybrid = lo.hybrid and zero.shards
    n_dp = shard_ranks(lo) if hybrid else lo.dp * lo.cp
    dp_axis = "dp_cp" if lo.cp > 1 else "dp"  # the trainer reduces over dp x cp together
    if hybrid:
        dp_axis = "dp_shard_cp" if lo.cp > 1 else "dp_shard"
    ev: list[CommEvent] = []
    # expert parallelism: expert weights are reduced over their copies (edp), the rest over dp
    n_edp = expert_copies(lo, n_dp)
    expert = p.expert if lo.ep > 1 else 0.0
    groups = [(dp_axis, n_dp, p.total - expert, p.dense + p.expert - expert - p.root_unit)]
    if expert:
        groups.append(("edp_shard" if hybrid else "edp", n_edp, expert, expert))
    for axis, n, params, layer_params in groups:
        grads = params * (4 if work.fp32_grad_reduce else g)
        root = p.root_unit if axis == dp_axis else 0.0
        replicas = lo.dp_rep if hybrid else 1
        w_gather = w
        if (axis == dp_axis and work.fp8_param_gather and work.precision.float8_linears
                and params):
            # the block linears' weights are gathered in float8, one byte each
            # (Workload.fp8_param_gather): the bytes per weight of the gather ZeRO's stage
            # makes -- every parameter once (ZeRO-1 / 2), or the layers twice and the root
            # unit once (ZeRO-3)
            saved = (w - 1) * min(p.block_linear, params)
            w_gather = ((2 * (layer_params * w - saved) + root * w) / (2 * layer_params + root)
                        if zero.gathers_layers and layer_params else w - saved / params)
        for col in zero.collectives(grads, params, layer_params, root, w_gather, m, n,
                                    replicas):
            if col.over == "replica":  # the ranks holding the same shard
                ev.append(CommEvent("dp", col.op, "dp_rep", col.nbytes, col.calls, lo.dp_rep,
                                    lo.tp * n_dp, col.overlap))
            else:  # an expert's copies: every ep-th rank (of the dp x cp ranks, tp apart;
                # ep apart where the expert group folds over tp: Layout.ep_over_tp)
                edp = axis.startswith("edp")
                stride = (lo.ep if lo.ep_over_tp else lo.tp * lo.ep) if edp else lo.tp
                ev.append(CommEvent("dp", col.op, axis, col.nbytes, col.calls, n, stride,
                                    col.overlap))
    if lo.dp * lo.cp > 1 and (zero.shards or lo.ep > 1):  # some gradients differ over dp: norm
        # summed over dp x cp, hybrid sharding too (distributed/spec.py's ``norm_axes``)
        ev.append(CommEvent("dp", "all_reduce", "dp_cp" if lo.cp > 1 else "dp", 8, 1,
                            lo.dp * lo.cp, lo.tp, "exposed"))  # clip
    if lo.tp > 1:  # tensor / sequence parallelism's (parallel/tensor_cost.py)
        act = tokens * c.dim * a
        narrow = work.fp8_tp_gather and work.precision.float8_linears  # (one byte a value)
        cols = TENSOR[lo.sp].collectives(act, c.dim * 4, tokens, p.layers, stage == 0,
                                         stage == last_rank(lo), RECOMPUTE[lo.recompute].forwards,
                                         m, "gemm" if lo.tp_overlap else "exposed", c,
                                         block_gather=tokens * c.dim if narrow else None)
        ev += [CommEvent("tp", col.op, "tp", col.nbytes, col.calls, lo.tp, 1, col.overlap)
               for col in cols]
    if lo.pp > 1:
        # meshlm's executor moves fp32 activations forward and their gradients backward at
        # every stage boundary, one micro-batch at a time (parallel/pipeline.py).
        seq_split = TENSOR[lo.sp].split_sends
        split = seq_split or (work.p2p_split and lo.tp > 1)
        act = tokens * c.dim * (4 if work.p2p_dtype == "fp32" else a) / (lo.tp if split else 1)
        # activations out, gradients back, at the boundaries that cross ranks (a V's turn
        # stays on its rank: parallel/schedule_cost.py)
        sends, recvs = SCHEDULES[lo.pp_schedule].messages(lo.pp, lo.pp_virtual, stage)
        stride = lo.tp * lo.cp * lo.dp
        # a stack that overlaps an interleaved schedule's sends and receives with its compute
        # (Workload.pp_overlap: Megatron-Core's overlap_p2p_comm) hides them behind the GEMMs
        hide = "gemm" if work.pp_overlap and lo.pp_virtual > 1 else "exposed"
        ev.append(CommEvent("pp", "send", "pp", act, sends * m, 2, stride, hide))
        ev.append(CommEvent("pp", "recv", "pp", act, recvs * m, 2, stride, "free"))
        if split and not seq_split:  # scatter/gather: the received pieces gathered over tp
            ev.append(CommEvent("tp", "all_gather", "tp", act * lo.tp, recvs * m, lo.tp, 1,
                                "exposed"))
        ev.append(CommEvent("pp", "all_reduce", "pp", 8, 1, lo.pp, stride, "exposed"))  # clip
    if lo.cp > 1:
        ev += cp_events(work, lo, stage, tokens, m)
    if stage == last_rank(lo):  # the extra training heads' targets (models/technique.py)
        sizes = {"cp": (lo.cp, lo.tp), "dp": (lo.dp, lo.tp * lo.cp)}
        whole = m * lo.micro_batch * work.seq_len
        for op, axis, nbytes in HEADS.step_collectives(c, whole, work.doc_len > 0):
            group, stride = sizes[axis]
            if group > 1:
                ev.append(CommEvent(axis, op, axis, nbytes, 1, group, stride, "exposed"))
    ev += moe_events(work, lo, stage, tokens, m)
    if lo.islands > 1:
        ev.append(island_event(work, lo, p.total))
    return ev


def island_event(work: Workload, lo: Layout, params: float) -> CommEvent:
    """DiLoCo's synchronisation, per step: every ``inner_steps`` steps each rank all-reduces the
    pseudo-gradient of the elements it owns (its ZeRO shard of this stage's tp slices, or all of
    them) with the ranks owning the same elements in the other islands, in ``island_dtype``
    (streaming fragments split a round's bytes over staggered steps: the same mean per step).
    Islands are the outermost axis: the group's members are ``inner_size`` ranks apart."""
    owned = params / ZERO[lo.zero].owners(shard_ranks(lo))
    return CommEvent("islands", "all_reduce", "island", owned * value_bytes(work.island_dtype),
                     1 / work.inner_steps, lo.islands, lo.inner_size, "exposed")


def moe_events(work: Workload, lo: Layout, stage: int, tokens: float, m: int
               ) -> list[CommEvent]:
    """Expert parallelism's all-to-alls and the balancing losses' count reductions of one
    step (``tokens``: one micro-batch's on a rank; a balanced router)."""
    c = work.model.config
    moe = layer_kinds(work, lo, stage).get(True, 0)  # MoE blocks (the extra heads' too)
    if not moe:
        return []
    a = work.precision.act_bytes
    fwd = RECOMPUTE[lo.recompute].forwards
    ev = []
    if lo.ep > 1:  # dispatch + combine, forward and backward; copies sent = copies received
        routed = tokens * c.moe_topk * c.dim * a / (lo.tp if folds_tp(work, lo) else 1)
        calls = 2 * (fwd + 1) * moe * m
        # hidden behind the other micro-batch's computation (attention, MLP, everything the
        # paired chunk runs: DeepSeek-V3 sec. 3.2.1): all of them where the run says so
        # (Workload.ep_overlap), else the share of this rank's passes its schedule pairs
        # (DualPipeV's overlapped forward + backward: parallel/overlap.py)
        hidden = 1.0 if work.ep_overlap else (
            SCHEDULES[lo.pp_schedule].paired(lo.pp, m, stage) if lo.pp > 1 else 0.0)
        # the group's ranks: tp apart in meshlm's mesh (ep inside dp x cp); consecutive where
        # the stack folds the experts over tp x dp x cp (Megatron-Core's expert rank order
        # "tp-ep-dp-pp" with expert tp 1: ep innermost, so ep <= GPUs per node stays on NVLink)
        stride = 1 if folds_tp(work, lo) else lo.tp
        split = functools.partial(dispatch_shares, work.ep_dispatch, c)
        for share, how in ((hidden, "compute"), (1.0 - hidden, "exposed")):
            if share > 0:
                ev.append(CommEvent("ep", "all_to_all", "ep", routed, calls * share, lo.ep,
                                    stride, how, shares=split))
        if not c.moe_capacity:  # dropless: split sizes first (int64 per rank and expert)
            ev.append(CommEvent("ep", "all_gather", "ep", 8 * lo.ep * c.moe_experts,
                                fwd * moe * m, lo.ep, stride, "exposed"))
    if lo.tp > 1:  # the routing weights' f (parallel/tensor.py's TensorParallelDispatcher):
        # their fp32 gradient summed over tp in backward, T k values per MoE layer
        ev.append(CommEvent("tp", "all_reduce", "tp", tokens * c.moe_topk * 4, moe * m, lo.tp,
                            1, "gemm" if lo.tp_overlap else "exposed"))
    if c.moe_aux_loss_coef and c.moe_balance == "aux" and lo.dp * lo.cp > 1:
        ev.append(CommEvent("dp", "all_reduce", "dp_cp" if lo.cp > 1 else "dp",
                            8 * c.moe_experts, fwd * moe * m, lo.dp * lo.cp, lo.tp, "exposed"))
    if c.moe_aux_loss_coef and c.moe_balance == "seq_aux" and lo.cp > 1:
        ev.append(CommEvent("cp", "all_reduce", "cp", 8 * c.moe_experts * lo.micro_batch,
                            fwd * moe * m, lo.cp, lo.tp, "exposed"))
    return ev


def cp_events(work: Workload, lo: Layout, stage: int, tokens: float, m: int
              ) -> list[CommEvent]:
    """Context parallelism's messages of one step (``tokens``: one micro-batch's on a rank)."""
    c = work.model.config
    layers = stage_blocks(work, lo, stage)
    w = projection_cost(c).widths(c)  # the kernel's q, k, v, output (models/attention_cost.py)
    cols = CONTEXT[lo.cp_attention].collectives(
        tokens, (w.q, w.k, w.v, w.out), lo.tp, work.precision.act_bytes, lo.cp,
        RECOMPUTE[lo.recompute].forwards, layers, m)
    return [CommEvent("cp", col.op, "cp", col.nbytes, col.calls, point_to_point(col, lo.cp),
                      lo.tp, col.overlap) for col in cols]


def point_to_point(col: Collective, n: int) -> int:
    """Ranks a message of a group of ``n`` spans: a send and its receive are between two."""
    return 2 if col.op in ("send", "recv") else n


def comm_volumes(work: Workload, lo: Layout, stage: int = 0) -> dict[str, float]:
    """Comm-log bytes per step and ``op/axis`` (the quantity ``CommLog.bytes_by_op`` sums)."""
    out: dict[str, float] = {}
    for e in comm_events(work, lo, stage):
        key = f"{e.op}/{e.axis}"
        out[key] = out.get(key, 0.0) + e.nbytes * e.calls
    return out


# ---------------------------------------------------------------------- the step
def stage_compute(work: Workload, lo: Layout, hw: Accelerator, rates: Rates, stage: int
                  ) -> dict[str, float]:
    """Seconds of one micro-batch (forward + backward) on ``stage``, by item."""
    out: dict[str, float] = {}
    for is_moe, count in layer_kinds(work, lo, stage).items():
        for k, v in layer_compute(work, lo, hw, rates, is_moe).items():
            out[k] = out.get(k, 0.0) + count * v
    for k, v in head_compute(work, lo, hw, rates, stage == 0, stage == last_rank(lo)).items():
        out[k] = out.get(k, 0.0) + v
    return out


def step_time(work: Workload, lo: Layout, hw: Accelerator) -> TimeBreakdown:
    """The step time breakdown of ``lo`` (see module docstring); AdamW's cost follows
    ``work.optimizer`` (:data:`ADAMW_BYTES`, :data:`HOST_ADAM`)."""
    world = lo.world_size
    procs = min(world, hw.gpus_per_node)
    threads = threads_per_rank(hw, world)
    # On CPU, ranks beyond the cores time-share them: compute at one rank's own rate, then
    # stretch it by the oversubscription (below); the cores stay busy while a rank idles.
    rates = hw.rates(1, threads) if hw.cpu is not None else hw.rates(procs, threads)
    oversub = max(1.0, procs * threads / hw.cpu.cores) if hw.cpu is not None else 1.0
    m = lo.micro_batches(work.global_batch)
    busiest = max(range(lo.pp), key=lambda r: stage_blocks(work, lo, r))
    stages = sorted({0, lo.pp - 1, last_rank(lo), busiest})  # embedding, head, most layers
    per_stage = {s: stage_compute(work, lo, hw, rates, s) for s in stages}
    slow = max(per_stage, key=lambda s: sum(per_stage[s].values()))
    mb_items = per_stage[slow]
    t_mb = sum(mb_items.values())
    out = TimeBreakdown(micro_batches=m, t_micro=t_mb * oversub)
    for k, v in mb_items.items():
        out.items[f"compute: {k}"] = v * m * oversub
    bubble = 0.0
    if lo.pp > 1:
        # (p - 1) micro-batch times of the *other* stages: fill and drain wait on every stage
        # but the slowest, which sets the steady-state pace (equal stages: (p - 1) t_mb).
        times = {st: sum(v.values()) for st, v in per_stage.items()}
        middle = times[busiest]
        others = sum(times.values()) + (lo.pp - len(times)) * middle - t_mb
        # the passes' shares (backward = input + weight gradients, each one forward's time;
        # recomputation runs before the input gradient)
        rc = mb_items.get("recompute", 0.0)
        f = (t_mb - rc) / 3
        ranks = [times.get(r, middle) for r in range(lo.pp)]  # (a schedule may replay them)
        bubble = SCHEDULES[lo.pp_schedule].bubble(others, lo.pp_virtual, lo.pp, m,
                                                  (f, f + rc, f), ranks)
    # A time-shared core runs the other ranks while one waits in the bubble: the bubble only
    # costs what exceeds the extra time the sharing already added.
    out.items["pipeline bubble"] = max(0.0, bubble - (oversub - 1) * m * t_mb)

    fwd = (t_mb - mb_items.get("recompute", 0.0)) / 3  # backward = 2 forwards + recompute
    events = comm_events(work, lo, slow)
    for e in events:
        if e.overlap != "free":  # a receive is the other side of a timed send
            e.seconds = collective_time(hw, e.op, e.nbytes, e.group, e.stride, procs,
                                        e.shares) * e.calls
        out.comm[e.name] = out.comm.get(e.name, 0.0) + e.seconds
        key = f"{e.op}/{e.axis}"
        out.volumes[key] = out.volumes.get(key, 0.0) + e.nbytes * e.calls
    windows = {"fwd": fwd * m, "bwd": (t_mb - fwd) * m, "last_bwd": t_mb - fwd,
               "gemm": mb_items.get("gemm", 0.0) * m,
               "attention": mb_items.get("attention", 0.0) * m,
               "compute": t_mb * m,
               "layers": stage_blocks(work, lo, slow)}
    for name, v in exposed_comm(events, hw, lo, windows, work.dp_overlap).items():
        out.items[f"comm: {name}"] = v

    p = stage_params(work, lo, slow)
    owned = p.total / ZERO[lo.zero].owners(shard_ranks(lo))
    tensors = 2 * p.layers * 9 + 3  # parameter tensors per rank (foreach chunks)
    if rates.adam is not None:  # measured per parameter (CPU): foreach, and fused if measured
        per_param = (rates.adam_fused if work.optimizer == "fused" and rates.adam_fused
                     else rates.adam * ADAMW_BYTES[work.optimizer] / ADAMW_BYTES["foreach"])
        out.items["optimizer"] = per_param * owned * oversub
    else:
        out.items["optimizer"] = (ADAMW_BYTES[work.optimizer] * owned
                                  / rates.bandwidth(4 * owned / tensors))
    # autocast's weight casts and the fp32 gradient's accumulation (the precision's, with the
    # states'); a full recomputation casts the weights again. (CPU: inside the calibrated rates.)
    per_param = work.precision.weight_cast_bytes(work.state_cost,
                                                 RECOMPUTE[lo.recompute].forwards, m)
    if not rates.serial_ops and per_param:
        out.items["weight casts"] = per_param * p.total / rates.bandwidth(4 * p.total / tensors)
    if work.grad_accum_pass:
        out.items["gradient accumulation"] = (ACCUM_BYTES * p.total * m
                                              / rates.bandwidth(4 * p.total / tensors))
    offload = offload_time(lo, hw, rates, owned, work.optimizer)
    if offload:
        if OFFLOAD[lo.offload].host_step:  # AdamW on the host (counted in the offload term)
            out.items["optimizer"] = 0.0
        out.items["optimizer offload"] = offload * (oversub if hw.cpu is not None else 1)
    out.step = sum(out.items.values())
    tokens = work.tokens_per_step
    out.tokens_per_s = tokens / out.step
    flops = work.model.flops_per_token(work.seq_len) * tokens
    peak = model_peak(hw, work.precision, world)
    out.mfu = flops / (out.step * world * peak)
    extra = sum(v for k, v in out.items.items() if k == "compute: recompute")
    out.hfu = out.mfu * (1 + extra / max(1e-12, sum(
        v for k, v in out.items.items() if k.startswith("compute:") and k != "compute: recompute"
    )))
    return out


def offload_time(lo: Layout, hw: Accelerator, rates: Rates, owned: float,
                 adamw: str = "fused") -> float:
    """Seconds per step that optimizer-state offload adds, exposed: the mode's traffic
    (``parallel/offload_cost.py``) through the page cache at the rate of fresh (page-faulting)
    buffers, or on a GPU over the host link (:data:`HOST_LINK`) followed by AdamW on the host
    at :data:`HOST_ADAM` seconds per parameter of the ``adamw`` kernels, in series."""
    off = OFFLOAD[lo.offload]
    if off.page_bytes:
        return off.page_bytes * owned / rates.bandwidth(max(rates.mem_bw))
    if off.host_step and hw.cpu is None:  # a CPU run's moments are in host memory already
        link = HOST_LINK["gen4" if hw.name.startswith("a100") else "gen5"]
        return off.link_bytes * owned / link + HOST_ADAM[adamw] * owned
    return 0.0


def exposed_comm(events: list[CommEvent], hw: Accelerator, lo: Layout,
                 win: dict[str, float], dp_overlap: bool = False) -> dict[str, float]:
    """Seconds per dimension that no computation hides (overlap rules: module docstring).

    ``win`` holds the step's forward / backward time, the last micro-batch's backward, the
    GEMM and attention time, and the number of layers of the stage. With pipelining, a
    once-per-step gradient reduction waits for the flush -- unless ``dp_overlap`` (Megatron-
    Core's overlap_grad_reduce: it hides behind the last micro-batch's backward, as without
    pipelining); a reduce-scatter per micro-batch (ZeRO-2) runs inside each backward either
    way. ``dp_overlap`` also hides ZeRO-1's parameter all-gather behind the next forward.
    """
    exposed: dict[str, float] = {}
    budget = {"gemm": win["gemm"], "attention": win["attention"], "compute": win["compute"]}
    zero3 = {"fwd": 0.0, "bwd": 0.0, "first": 0.0}

    def add(name: str, seconds: float) -> None:
        exposed[name] = exposed.get(name, 0.0) + max(0.0, seconds)

    for e in events:
        per_call = e.seconds / max(e.calls, 1)
        if e.overlap == "free":
            continue
        if (dp_overlap and hw.overlap and e.name == "dp" and e.op == "all_gather"
                and e.overlap == "exposed"):  # ZeRO-1's gather under the next forward
            add(e.name, e.seconds - win["fwd"])
        elif not hw.overlap or e.overlap == "exposed" or (
                e.name == "dp" and lo.pp > 1 and e.overlap == "last_backward"
                and not dp_overlap):
            add(e.name, e.seconds)  # with pipelining gradients are reduced after the flush
        elif e.overlap == "last_backward":
            # buckets reduce while backward continues; the last bucket waits at the end
            tail = per_call / max(1, math.ceil(e.nbytes / BUCKET_BYTES))
            add(e.name, max(tail, e.seconds - win["last_bwd"]))
        elif e.overlap == "each_backward":
            add(e.name, e.seconds - win["bwd"])
        elif e.overlap == "zero3":
            if e.op == "all_gather":  # half in forward, half in backward, per micro-batch
                zero3["fwd"] += e.seconds / 2
                zero3["bwd"] += e.seconds / 2
                zero3["first"] += per_call / (2 * max(1, win["layers"]) + 1) * e.calls
            else:
                zero3["bwd"] += e.seconds
        else:  # hides behind the GEMMs (async TP), the attention (ring attention) or the
            # paired micro-batch's whole computation (expert all-to-alls under DualPipe)
            add(e.name, e.seconds - budget[e.overlap])
            budget[e.overlap] = max(0.0, budget[e.overlap] - e.seconds)
    if zero3["fwd"] or zero3["bwd"]:
        add("dp", max(0.0, zero3["fwd"] - win["fwd"]) + max(0.0, zero3["bwd"] - win["bwd"])
            + zero3["first"])
    return exposed


def model_peak(hw: Accelerator, precision: PrecisionCost, world: int) -> float:
    """The MFU denominator per rank: the datasheet peak the precision counts against
    (``precision_cost.py``); on CPU the measured matmul rate of one rank's threads (the
    trainer's) in the linears' dtype, fp32's where none was measured."""
    if hw.cpu is not None:
        rate = hw.cpu.peak.get(precision.linears, hw.cpu.peak["fp32"])
        return _nearest(rate, threads_per_rank(hw, world))
    return hw.peak_flops(precision.peak)
