"""What the planner is asked about: a model, a batch, a precision (:class:`Workload`) and a layout.

The layout is :class:`meshlm.layout.Layout`, written on the command line as
``tp=8,pp=4,dp=16,zero=1,mbs=1,recompute=selective,schedule=interleaved,vpp=2``
(:func:`parse_layout`; ``dp_shard=N`` for hybrid sharding, as :meth:`Layout.describe` writes it).

Parameter and FLOP counts come from :class:`~meshlm.models.config.ModelConfig` (the one source
the trainer's MFU also uses). :class:`ModelSpec` adds the one thing published GPT-style models
need that meshlm's Llama block does not have: a two-matrix GELU MLP (``2 h f`` weights per
layer instead of SwiGLU's ``3 h f``).
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..dtypes import FP8_REST, PRECISIONS
from ..layout import SHORT_KEYS, V_SCHEDULES, Layout
from ..models.attention_spec import AttentionSpec, spec
from ..models.config import ModelConfig
from ..models.moe_cost import EXPERT_KERNELS
from ..models.presets import PRESETS
from ..precision_cost import (
    FP8_CAST_TRAFFIC,
    FP8_SCALINGS,
    PRECISION,
    STATE_MODES,
    PrecisionCost,
    StatesCost,
)
from .dispatch import EP_DISPATCHES

# A flash kernel's attention speed relative to FlashAttention-2's, the rate the hardware
# catalogue's ``attn_eff`` gives: FlashAttention 1.x and its Triton port run at about half
# (Dao 2023, "FlashAttention-2", abstract: "around 2x speedup compared to FlashAttention";
# sec. 4.1: 1.7-3.0x over FlashAttention, 1.3-2.5x over its Triton implementation)
FLASH_SPEED = {"flash2": 1.0, "flash1": 0.5}

# the dtypes meshlm trains in (precision.dtype), and fp8, which the planner models only
DTYPES = PRECISIONS
STATES = tuple(STATE_MODES)  # how weights, gradients and Adam moments are held
PROFILES = ("meshlm", "megatron")
LOSSES = ("torch", "fused", "chunked")
KERNELS = ("eager", "fused")
OPTIMIZER_KERNELS = ("fused", "foreach")


@dataclass(frozen=True)
class ModelSpec:
    """A model shape plus its MLP kind; counts delegate to :class:`ModelConfig`."""

    config: ModelConfig
    gated_mlp: bool = True  # SwiGLU (meshlm, Llama); False: GELU MLP with 2 matrices (GPT)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def _gelu_correction(self, layers: int) -> int:
        """Weights ModelConfig counts for a gated MLP that a 2-matrix MLP does not have."""
        return 0 if self.gated_mlp else layers * self.config.dim * self.config.ffn_hidden

    def dense_layers(self) -> int:
        return self.config.n_layers - self.config.n_moe_layers

    def layer_params(self, layer: int, active: bool = False) -> int:
        c = self.config
        extra = 0 if c.is_moe_layer(layer) else self._gelu_correction(1)
        return c.layer_params(layer, active) - extra

    def num_params(self, active: bool = False) -> int:
        return self.config.num_params(active) - self._gelu_correction(self.dense_layers())

    def matmul_params(self) -> int:
        return self.config.matmul_params() - self._gelu_correction(self.dense_layers())

    @functools.lru_cache(maxsize=64)  # noqa: B019 -- frozen, hashable; the search calls it often
    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM convention (6 N_matmul + 12 L H Q T)."""
        attn = self.config.flops_per_token(seq_len) - 6.0 * self.config.matmul_params()
        return 6.0 * self.matmul_params() + attn


@dataclass(frozen=True)
class Workload:
    """Model, sequence length, global batch (sequences per optimizer step) and precision.

    ``dtype`` is the matmul precision; ``states`` how weights, gradients and Adam moments are
    held: ``fp32`` is meshlm's (fp32 weights and gradients, fp32 moments: 4 + 4 + 8 bytes per
    parameter, autocast copies in the compute dtype), ``mixed`` the ZeRO paper's mixed precision
    (16-bit weights and gradients, fp32 master weights and moments: 2 + 2 + 12). ``profile``
    picks the activation accounting: ``meshlm`` (the tensors meshlm's own block saves) or
    ``megatron`` (Korthikanti et al. 2022's GPT block); ``flash`` whether attention scores
    are never materialised (FlashAttention / SDPA); ``loss`` the cross-entropy: ``torch``
    (``F.cross_entropy`` on fp32 logits, as meshlm) or ``fused`` (one kernel that keeps the
    logits in their dtype and writes the gradient in place: flash-attn's, Megatron-Core's
    ``--cross-entropy-loss-fusion``) or ``chunked`` (meshlm's ``train.loss=chunked``: the head
    and loss over ``loss_chunk`` tokens at a time, gradients formed in forward). ``kernels``
    is the family of the memory-bound kernels: ``eager`` (meshlm's PyTorch block, one kernel
    per op: what meshlm itself runs) or ``fused`` (Megatron-Core / Transformer Engine, NeMo,
    flash-attn's and torch.compile's fused norms, rotary, SwiGLU and residual adds).
    """

    model: ModelSpec
    seq_len: int
    global_batch: int
    dtype: str = "bf16"
    states: str = "fp32"
    profile: str = "meshlm"
    flash: bool = True
    # the flash kernel's generation (FLASH_SPEED): FlashAttention-2-class unless a run states
    # an older one
    flash_kernel: str = "flash2"
    loss: str = "torch"
    loss_chunk: int = 1024  # tokens per chunk of the ``chunked`` loss
    kernels: str = "eager"  # eager | fused (memory-bound kernels; see planner/timing.py)
    # AdamW's kernels: fused (one pass, no temporaries: torch's fused=True, apex FusedAdam,
    # Megatron's distributed optimizer) | foreach (torch's multi-tensor AdamW: its
    # ``_foreach_sqrt`` allocates 4 bytes per parameter of the group it steps)
    optimizer: str = "fused"
    # RMSNorm's kernel (meshlm's ``F.rms_norm``): fused (CUDA: saves its input and 1/rms) or
    # composite (CPU: the formula's ops, saving the normalised input too); None: by device
    fused_norm: bool | None = None
    # pipeline stage boundaries: ``fp32`` activations (meshlm's executor) or the compute
    # dtype (frameworks whose weights are 16-bit: Megatron, DeepSpeed, nanotron, torchtitan's
    # FSDP2 mixed precision); ``p2p_split``: with tp > 1 and no sp, each tp rank sends 1/tp of
    # the activation and the next stage all-gathers it over tp (Megatron's scatter/gather,
    # Narayanan et al. 2021, sec. 4.1)
    p2p_dtype: str = "fp32"
    p2p_split: bool = False
    # data-parallel gradient reduction in fp32 whatever ``states`` holds (Megatron's
    # accumulate_allreduce_grads_in_fp32, forced for bf16; nanotron's accumulate_grad_in_fp32;
    # torchtitan's FSDP2 reduce_dtype float32): 4 bytes per gradient on the wire
    fp32_grad_reduce: bool = False
    # fp32 gradient accumulation as its own pass after each micro-batch's backward (nanotron's
    # FP32GradientAccumulator adds the 16-bit gradient into an fp32 buffer; Megatron fuses it
    # into the weight-gradient GEMM, meshlm keeps fp32 gradients): ACCUM_BYTES per parameter
    grad_accum_pass: bool = False
    # DiLoCo islands (layouts with islands > 1): steps between synchronisations (H) and the
    # dtype of the cross-island all-reduce (diloco.inner_steps, diloco.reduce_dtype)
    inner_steps: int = 50
    island_dtype: str = "fp32"
    # dtype="fp8": what runs outside the decoder-block linears (precision.fp8_rest): bf16
    # autocast, or fp32 (no autocast: 4-byte activations, no weight copies)
    fp8_rest: str = "bf16"
    # dtype="fp8", as a stack runs it (precision_cost.py, planner/stacks.py): the float8 casts
    # "fused" into the kernels that produce each GEMM operand (Transformer Engine,
    # torch.compile: no traffic of their own) or "separate" kernels (torchao eager: an amax
    # pass, the scaled cast, a transposed copy); the scaling granularity (tensorwise: one
    # scale per tensor, delayed or current; rowwise / blockwise: one per row or block, each
    # operand cast once per GEMM orientation); whether a MoE layer's routed experts run in
    # float8 (Transformer Engine's grouped linears, DeepSeek-V3) or in the rest dtype
    fp8_casts: str = "fused"
    fp8_recipe: str = "tensorwise"
    fp8_experts: bool = False
    # expert parallelism's all-to-alls overlapped with another micro-batch's computation
    # (DualPipe's paired forward and backward, DeepSeek-V3 sec. 3.2.1; Megatron-Core's
    # overlap_moe_expert_parallel_comm): they hide behind the step's computation instead of
    # being exposed. meshlm's own plans leave this off: under
    # DualPipeV the planner hides the share of a rank's passes the table pairs
    # (parallel/schedule_cost.py, ``paired``), as meshlm's executor runs them.
    ep_overlap: bool = False
    # how expert parallelism's tokens reach other nodes (EP_DISPATCHES): "all-to-all" sends
    # one copy per selected expert (NCCL's all-to-all: meshlm, Megatron-Core's alltoall
    # dispatcher); "node-dedup" sends each token once per destination node over the network
    # and forwards it to that node's experts over NVLink (DeepEP's internode kernels,
    # DeepSeek-V3 sec. 3.2.2): the network carries the nodes a token touches, not its copies
    ep_dispatch: str = "all-to-all"
    # the ``megatron`` profile's memory (Korthikanti et al.'s count): whether the model trains
    # with dropout (its masks are saved for backward; Megatron-Core's default 0.1, the NeMo /
    # Megatron-Bridge providers of Llama 3, Nemotron-4 and GPT-3 set 0); whether an FP8 run's
    # linears keep the float8 copy of their input for backward instead of the 16-bit one
    # (Transformer Engine's Linear / LayerNormLinear); whether its weights are held in float8
    # (Transformer Engine's FP8 primary weights, NeMo's fp8_params / Megatron-Bridge's
    # fp8_param_gather: the fp32 master copy stays in the optimizer)
    dropout: bool = True
    # an interleaved schedule's sends and receives overlapped with the compute (Megatron-
    # Core's overlap_p2p_comm, on in NeMo's and Megatron-Bridge's recipes with virtual
    # stages); meshlm's executor waits for each group of them
    pp_overlap: bool = False
    fp8_saved_inputs: bool = False
    fp8_params: bool = False
    # ZeRO's / FSDP's parameter all-gather moves the block linears' weights in float8, one
    # byte each: Megatron-Core's fp8_param_gather (with FP8 primary weights), torchao's
    # enable_fsdp_float8_all_gather (tensorwise scaling: each shard cast before the gather).
    # meshlm gathers in the weights' dtype.
    fp8_param_gather: bool = False
    # an FP8 run's sequence-parallel all-gathers in the blocks carry float8, one byte per
    # value: the float8 linears' inputs forward and the row-parallel outputs' gradients
    # backward (Transformer Engine; torchao's float8 tensor-parallel styles; planner/stacks.py);
    # their reduce-scatters stay in the compute dtype. meshlm gathers in the compute dtype.
    fp8_tp_gather: bool = False
    # an FP8 run's two backward GEMMs per float8 linear apply their scales in a pass of their
    # own, reading and writing dx and dW once more in the compute dtype (torchao's rowwise
    # scaling: cuBLAS's tensorwise kernel, then the row scales; planner/stacks.py; counted
    # in planner/timing.py). meshlm's planner leaves it off.
    fp8_rescale: bool = False
    # the stack overlaps data-parallel reductions with a pipeline's backward too and ZeRO-1's
    # parameter all-gather with the next forward (Megatron-Core's overlap_grad_reduce /
    # overlap_param_gather; planner/stacks.py). meshlm reduces after the pipeline's flush.
    dp_overlap: bool = False
    # a MoE layer's routed rows are split over tensor parallelism (Megatron-Core: with
    # sequence parallelism each tp rank routes its own tokens, and the expert-tensor-parallel
    # alternative splits each expert's width instead -- the same share of the FLOPs):
    # each rank computes and dispatches 1/tp of the routed rows. meshlm replicates them.
    experts_over_tp: bool = False
    # document masking (data.doc_mask): the mean document length in tokens (0: no masking);
    # the attention kernel and the sliding window are the model's (model.attention, its
    # description in models/attention_spec.py; model.sliding_window)
    doc_len: float = 0.0
    # how a MoE layer's routed experts run (models/moe_cost.py): grouped (one grouped GEMM:
    # meshlm, Megatron-Core's grouped GEMM, DeepGEMM) | loop (one GEMM per expert)
    experts: str = "grouped"

    @property
    def attention(self) -> AttentionSpec:
        """The attention kernel's cost description (``model.attention``)."""
        return spec(self.model.config.attention)

    @property
    def attention_masked(self) -> bool:
        """Attention is more than plain causal: a window shorter than the sequence, or
        documents."""
        w = self.model.config.sliding_window
        return 0 < w < self.seq_len or self.doc_len > 0

    @property
    def score_fraction(self) -> float:
        """Share of the s x s attention scores the kernel computes (flash-type kernels)."""
        return self.attention.score_fraction(self.seq_len, self.model.config.sliding_window,
                                             self.doc_len, self.attention_masked)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def precision(self) -> PrecisionCost:
        """The precision's cost description (``precision_cost.py``), its rest dtype chosen:
        ``fp8_rest`` where ``dtype`` leaves it open (fp8)."""
        return PRECISION[self.dtype].with_rest(self.fp8_rest)

    @property
    def state_cost(self) -> StatesCost:
        """How weights, gradients and optimizer states are held (``precision_cost.py``)."""
        return STATE_MODES[self.states]

    @property
    def rest_dtype(self) -> str:
        """The dtype of activations and of the matmuls that are not float8: ``dtype``, or
        under ``fp8`` ``fp8_rest``."""
        return self.precision.compute.name

    def problems(self) -> list[str]:
        out = []
        if self.dtype not in PRECISION:
            out.append(f"dtype {self.dtype!r} is not one of {', '.join(PRECISION)}")
        if self.states not in STATE_MODES:
            out.append(f"states {self.states!r} is not one of {', '.join(STATE_MODES)}")
        if self.loss not in LOSSES:
            out.append(f"loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.profile not in PROFILES:
            out.append(f"profile {self.profile!r} is not one of {', '.join(PROFILES)}")
        if self.p2p_dtype not in ("fp32", "compute"):
            out.append(f"p2p_dtype {self.p2p_dtype!r} is not one of fp32, compute")
        if self.kernels not in KERNELS:
            out.append(f"kernels {self.kernels!r} is not one of {', '.join(KERNELS)}")
        if self.flash_kernel not in FLASH_SPEED:
            out.append(f"flash_kernel {self.flash_kernel!r} is not one of "
                       f"{', '.join(FLASH_SPEED)}")
        if self.optimizer not in OPTIMIZER_KERNELS:
            out.append(f"optimizer {self.optimizer!r} is not one of "
                       f"{', '.join(OPTIMIZER_KERNELS)}")
        if self.fp8_rest not in FP8_REST:
            out.append(f"fp8_rest {self.fp8_rest!r} is not one of {', '.join(FP8_REST)}")
        if self.fp8_casts not in FP8_CAST_TRAFFIC:
            out.append(f"fp8_casts {self.fp8_casts!r} is not one of "
                       f"{', '.join(FP8_CAST_TRAFFIC)}")
        if self.fp8_recipe not in FP8_SCALINGS:
            out.append(f"fp8_recipe {self.fp8_recipe!r} is not one of "
                       f"{', '.join(FP8_SCALINGS)}")
        if self.ep_dispatch not in EP_DISPATCHES:
            out.append(f"ep_dispatch {self.ep_dispatch!r} is not one of "
                       f"{', '.join(EP_DISPATCHES)}")
        if self.experts not in EXPERT_KERNELS:
            out.append(f"experts {self.experts!r} is not one of {', '.join(EXPERT_KERNELS)}")
        if self.doc_len < 0:
            out.append(f"doc_len={self.doc_len} must be >= 0 (0: no document masking)")
        if self.seq_len < 1 or self.global_batch < 1:
            out.append(f"seq_len={self.seq_len} and global_batch={self.global_batch} must be >= 1")
        return out


_TEXT_KEYS = ("dp", "tp", "sp", "pp", "cp", "ep", "zero", "mbs", "recompute", "schedule", "vpp",
              "tp_overlap", "ep_over_tp", "cp_attention", "offload", "dp_shard")
# --layout keys -> Layout fields: the short names, the config's names (micro_batch, pp_schedule,
# pp_virtual) and "mb"
_FIELD_OF = {**{k: {v: f for f, v in SHORT_KEYS.items()}.get(k, k) for k in _TEXT_KEYS},
             **{f: f for f in SHORT_KEYS}, "mb": "micro_batch"}
_INT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "pp_virtual", "dp_shard")
_BOOL_FIELDS = ("sp", "tp_overlap", "ep_over_tp")


def parse_layout(text: str, world: int | None = None) -> Layout:
    """``"tp=8,pp=4,dp=16,zero=1,mbs=1,recompute=selective,schedule=interleaved,vpp=2"``.

    ``sp`` alone means ``sp=true``. Unset dp is inferred as world / (tp pp cp) when the world
    is given; ``vpp`` is 2 for the V schedules (``schedule=zbv``, ``dualpipev``) unless given. Raises ConfigError with one line naming the bad item.
    """
    values: dict[str, Any] = {}
    for raw in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = (part.strip() for part in raw.partition("="))
        name = _FIELD_OF.get(key)
        if name is None:
            raise ConfigError(f"--layout item {raw!r}: unknown key {key!r} (valid: "
                              f"{', '.join(_TEXT_KEYS)})")
        if name in _BOOL_FIELDS and not eq:
            value = "true"
        if name in _INT_FIELDS:
            if not value.isdigit() or int(value) < (0 if name == "zero" else 1):
                raise ConfigError(f"--layout item {raw!r}: {key} must be a positive integer")
            values[name] = int(value)
        elif name in _BOOL_FIELDS:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"--layout item {raw!r}: {key} must be true or false")
            values[name] = value.lower() in ("true", "1")
        else:
            values[name] = value
    if "dp" not in values and world is not None:
        inner = values.get("tp", 1) * values.get("pp", 1) * values.get("cp", 1)
        if world % inner:
            raise ConfigError(f"--layout {text!r}: tp * pp * cp = {inner} does not divide "
                              f"--gpus {world}")
        values["dp"] = world // inner
    if values.get("pp_virtual", 1) > 1 and "pp_schedule" not in values:
        values["pp_schedule"] = "interleaved"
    if values.get("pp_schedule") in V_SCHEDULES and "pp_virtual" not in values:
        values["pp_virtual"] = 2  # (a V: exactly two chunks per rank)
    return Layout(**values)


# ---------------------------------------------------------------------- model files
_SPEC_KEYS = {"mlp"}


def model_from_mapping(data: dict[str, Any], origin: str) -> ModelSpec:
    """``{"preset": ..., "dim": ..., "mlp": "swiglu" | "gelu", ...}`` -> ModelSpec."""
    data = dict(data.get("model", data))
    base = PRESETS.get(str(data.pop("preset", "")), None)
    mlp = str(data.pop("mlp", "swiglu")).lower()
    if mlp not in ("swiglu", "gelu"):
        raise ConfigError(f"{origin}: mlp={mlp!r} must be swiglu or gelu")
    names = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(data) - names - _SPEC_KEYS)
    if unknown:
        raise ConfigError(f"{origin}: unknown model keys {', '.join(unknown)} "
                          f"(valid: preset, mlp, {', '.join(sorted(names))})")
    try:
        cfg = replace(base, **data) if base is not None else ModelConfig(**data)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{origin}: {e}") from None
    return ModelSpec(cfg, gated_mlp=mlp == "swiglu")


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name, a published model (``models/published.py``: ``gpt3-175b``, ...), or a
    TOML file with the model's dims (a ``[model]`` table or top level)."""
    from ..models.published import CATALOGUE

    if name_or_path in PRESETS:
        return ModelSpec(PRESETS[name_or_path])
    if name_or_path in CATALOGUE:
        entry = CATALOGUE[name_or_path]
        return ModelSpec(entry.config, gated_mlp=entry.gated_mlp)
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"--model {name_or_path!r} is neither a preset "
                          f"({', '.join(PRESETS)}), a published model "
                          f"({', '.join(k for k in CATALOGUE if k not in PRESETS)}) nor a "
                          "TOML file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--model {str(path)!r} is not valid TOML: {e}") from None
    return model_from_mapping(data, str(path))
