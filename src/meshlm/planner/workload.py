"""What the planner is asked about: a model, a batch, a precision (:class:`Workload`) and a layout.

A :class:`Layout` is one point of the 5D space -- ``dp x tp x pp x cp`` ranks (``ep`` carved out
of ``dp x cp``, Megatron-Core's layout), a ZeRO stage, a micro-batch size, activation
recomputation, a pipeline schedule and its virtual stages. It is written like
``tp=8,pp=4,dp=16,zero=1,mbs=1,recompute=selective,schedule=interleaved,vpp=2``.

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
from ..models.config import ModelConfig
from ..models.presets import PRESETS

RECOMPUTE = ("none", "selective", "op", "full")  # least to most recomputation
SCHEDULES = ("afab", "1f1b", "interleaved", "zb")
DTYPES = ("fp32", "bf16", "fp16", "fp8")
STATES = ("fp32", "mixed")
PROFILES = ("meshlm", "megatron")
LOSSES = ("torch", "fused")


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
    ``--cross-entropy-loss-fusion``).
    """

    model: ModelSpec
    seq_len: int
    global_batch: int
    dtype: str = "bf16"
    states: str = "fp32"
    profile: str = "meshlm"
    flash: bool = True
    loss: str = "torch"

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    def problems(self) -> list[str]:
        out = []
        if self.dtype not in DTYPES:
            out.append(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.states not in STATES:
            out.append(f"states {self.states!r} is not one of {', '.join(STATES)}")
        if self.loss not in LOSSES:
            out.append(f"loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.profile not in PROFILES:
            out.append(f"profile {self.profile!r} is not one of {', '.join(PROFILES)}")
        if self.seq_len < 1 or self.global_batch < 1:
            out.append(f"seq_len={self.seq_len} and global_batch={self.global_batch} must be >= 1")
        return out


@dataclass(frozen=True)
class Layout:
    """One parallel layout; ``world`` = dp * tp * pp * cp (ep lives inside dp * cp)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    zero: int = 0
    mbs: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    vpp: int = 1
    # Tensor-parallel collectives decomposed and overlapped with their GEMMs (Wang et al. 2022;
    # Megatron-LM --tp-comm-overlap, torchtitan async TP). meshlm does not do this, so the
    # search never sets it; it describes published runs that did.
    tp_overlap: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches per optimizer step on each pipeline (gradient accumulation)."""
        return max(1, global_batch // (self.dp * self.mbs))

    def describe(self) -> str:
        parts = [f"tp={self.tp}"] + (["sp"] if self.sp else []) + (
            ["tp_overlap"] if self.tp_overlap else [])
        parts += [f"pp={self.pp}", f"dp={self.dp}"]
        parts += [f"{k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) > 1]
        parts += [f"zero={self.zero}", f"mbs={self.mbs}", f"recompute={self.recompute}"]
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}")
            if self.vpp > 1:
                parts.append(f"vpp={self.vpp}")
        return ",".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_INT_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero", "mbs", "vpp")
_ALIASES = {"micro_batch": "mbs", "mb": "mbs", "pp_schedule": "schedule", "pp_virtual": "vpp"}


def parse_layout(text: str, world: int | None = None) -> Layout:
    """``"tp=8,pp=4,dp=16,zero=1,mbs=1,recompute=selective,schedule=interleaved,vpp=2"``.

    ``sp`` alone means ``sp=true``. Unset dp is inferred as world / (tp pp cp) when the world
    is given. Raises ConfigError with one line naming the bad item.
    """
    values: dict[str, Any] = {}
    for raw in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = raw.partition("=")
        key = _ALIASES.get(key.strip(), key.strip())
        if key in ("sp", "tp_overlap") and not eq:
            value = "true"
        if key not in {f.name for f in fields(Layout)}:
            raise ConfigError(f"--layout item {raw!r}: unknown key {key!r} (valid: dp, tp, sp, "
                              "pp, cp, ep, zero, mbs, recompute, schedule, vpp, tp_overlap)")
        value = value.strip()
        if key in _INT_KEYS:
            if not value.isdigit() or int(value) < (0 if key == "zero" else 1):
                raise ConfigError(f"--layout item {raw!r}: {key} must be a positive integer")
            values[key] = int(value)
        elif key in ("sp", "tp_overlap"):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"--layout item {raw!r}: {key} must be true or false")
            values[key] = value.lower() in ("true", "1")
        else:
            values[key] = value
    if "dp" not in values and world is not None:
        inner = values.get("tp", 1) * values.get("pp", 1) * values.get("cp", 1)
        if world % inner:
            raise ConfigError(f"--layout {text!r}: tp * pp * cp = {inner} does not divide "
                              f"--gpus {world}")
        values["dp"] = world // inner
    if values.get("vpp", 1) > 1 and "schedule" not in values:
        values["schedule"] = "interleaved"
    return Layout(**values)


def layout_problems(layout: Layout, work: Workload, world: int | None = None,
                    gpus_per_node: int | None = None, strict: bool = False) -> list[str]:
    """Why ``layout`` cannot run ``work`` (empty when it can).

    ``strict`` (the search) also demands an even split of the layers over pipeline stages
    and a micro-batch count that is a multiple of pp for interleaving (Megatron's rule);
    a layout given by hand may split layers unevenly (the slowest stage is modelled).
    """
    c, out = work.model.config, []
    lo = layout
    for key in ("dp", "tp", "pp", "cp", "ep", "mbs", "vpp"):
        if getattr(lo, key) < 1:
            out.append(f"{key}={getattr(lo, key)} must be >= 1")
    if out:
        return out
    if world is not None and lo.world != world:
        out.append(f"dp*tp*pp*cp = {lo.dp}*{lo.tp}*{lo.pp}*{lo.cp} = {lo.world} is not the "
                   f"{world} GPUs")
    if lo.zero not in (0, 1, 2, 3):
        out.append(f"zero={lo.zero} must be 0, 1, 2 or 3")
    if lo.recompute not in RECOMPUTE:
        out.append(f"recompute={lo.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if lo.schedule not in SCHEDULES:
        out.append(f"schedule={lo.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if gpus_per_node and lo.tp > gpus_per_node:
        out.append(f"tp={lo.tp} exceeds the {gpus_per_node} GPUs of a node")
    for key in ("n_heads", "n_kv_heads", "ffn_hidden"):
        if getattr(c, key) % lo.tp:
            out.append(f"tp={lo.tp} does not divide {key}={getattr(c, key)}")
    if c.is_moe and c.expert_hidden % lo.tp:
        out.append(f"tp={lo.tp} does not divide moe_ffn_hidden={c.expert_hidden}")
    if lo.sp and lo.tp == 1:
        out.append("sp needs tp > 1")
    if lo.sp and (work.seq_len // lo.cp) % lo.tp:
        out.append(f"sp: seq_len/cp = {work.seq_len // lo.cp} is not divisible by tp={lo.tp}")
    if work.seq_len % (2 * lo.cp) and lo.cp > 1:
        out.append(f"cp={lo.cp}: seq_len={work.seq_len} is not divisible by 2*cp (zigzag)")
    if lo.ep > 1 and not c.is_moe:
        out.append(f"ep={lo.ep} needs a Mixture-of-Experts model")
    if lo.ep > 1 and ((lo.dp * lo.cp) % lo.ep or c.moe_experts % lo.ep):
        out.append(f"ep={lo.ep} must divide dp*cp={lo.dp * lo.cp} and the "
                   f"{c.moe_experts} experts")
    stages = lo.pp * lo.vpp
    if stages > c.n_layers:
        out.append(f"pp*vpp={stages} exceeds the {c.n_layers} layers")
    if lo.vpp > 1 and lo.schedule != "interleaved":
        out.append(f"vpp={lo.vpp} needs schedule=interleaved")
    if lo.schedule == "interleaved" and lo.vpp < 2 and lo.pp > 1:
        out.append("schedule=interleaved needs vpp >= 2")
    if work.global_batch % (lo.dp * lo.mbs):
        out.append(f"global batch {work.global_batch} is not divisible by dp*mbs = "
                   f"{lo.dp}*{lo.mbs}")
    m = lo.micro_batches(work.global_batch)
    if lo.pp > 1 and m < lo.pp:
        out.append(f"{m} micro-batch(es) per step cannot fill a pipeline of pp={lo.pp} stages")
    if strict:
        if c.n_layers % stages:
            out.append(f"pp*vpp={stages} does not divide the {c.n_layers} layers")
        if lo.schedule == "interleaved" and m % lo.pp:
            out.append(f"interleaving needs micro-batches ({m}) divisible by pp={lo.pp}")
    return out


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
    """A preset name, or a TOML file with the model's dims (a ``[model]`` table or top level)."""
    if name_or_path in PRESETS:
        return ModelSpec(PRESETS[name_or_path])
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"--model {name_or_path!r} is neither a preset "
                          f"({', '.join(PRESETS)}) nor a TOML file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--model {str(path)!r} is not valid TOML: {e}") from None
    return model_from_mapping(data, str(path))
