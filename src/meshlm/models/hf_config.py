"""Hugging Face ``config.json`` <-> :class:`ModelConfig` for Llama and Mixtral models.

What meshlm cannot express (biases, scaled or partial rotary embeddings, other activations, a
a sliding window on Llama) is refused with a ValueError naming the field; a window shorter than
the context (``sliding_window``, Mixtral's) is ``model.sliding_window``. No communication; no memory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import ModelConfig

LLAMA = "LlamaForCausalLM"
MIXTRAL = "MixtralForCausalLM"
_ARCH_OF_MODEL_TYPE = {"llama": LLAMA, "mixtral": MIXTRAL}
_MODEL_TYPE_OF_ARCH = {v: k for k, v in _ARCH_OF_MODEL_TYPE.items()}
_DEFAULT_THETA = {LLAMA: 10000.0, MIXTRAL: 1000000.0}
_DEFAULT_EPS = {LLAMA: 1e-6, MIXTRAL: 1e-5}
_DEFAULT_MAX_POS = {LLAMA: 2048, MIXTRAL: 4096 * 32}

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# ---------------------------------------------------------------------------------- configs


def is_hf_folder(path: str | Path) -> bool:
    """True for a folder holding ``config.json`` and safetensors weights (single or sharded)."""
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and (
        (p / SINGLE_FILE).is_file() or (p / INDEX_FILE).is_file()
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"missing file {path}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _hf_dict(path_or_dict: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    p = Path(path_or_dict)
    return _read_json(p / CONFIG_FILE if p.is_dir() else p)


def _architecture(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if archs:
        if len(archs) != 1 or archs[0] not in _MODEL_TYPE_OF_ARCH:
            raise ValueError(f"architectures={archs}: meshlm reads {LLAMA} or {MIXTRAL} only")
        arch = archs[0]
        if model_type is not None and model_type != _MODEL_TYPE_OF_ARCH[arch]:
            raise ValueError(f"model_type={model_type!r} does not match architectures={archs}")
        return arch
    if model_type in _ARCH_OF_MODEL_TYPE:
        return _ARCH_OF_MODEL_TYPE[model_type]
    raise ValueError(f"model_type={model_type!r}: meshlm reads 'llama' or 'mixtral' only")


def _rope_theta(d: Mapping[str, Any], arch: str) -> float:
    """The base of plain RoPE; ValueError for any scaled or partial rotary variant."""
    theta = d.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise ValueError(f"{key}={rope!r}: expected a mapping or null")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{key}={dict(rope)}: meshlm has plain RoPE only (no scaling)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{key}.partial_rotary_factor={rope['partial_rotary_factor']}: "
                             "meshlm rotates the whole head")
        if rope.get("rope_theta") is not None:
            theta = rope["rope_theta"]
    if d.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor={d['partial_rotary_factor']}: "
                         "meshlm rotates the whole head")
    return float(theta if theta is not None else _DEFAULT_THETA[arch])


def model_config_from_hf(path_or_dict: str | Path | Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of an HF ``config.json`` (a folder, the file, or its parsed dict).

    Raises ValueError naming the field for anything meshlm's model cannot express.
    """
    d = _hf_dict(path_or_dict)
    arch = _architecture(d)
    name = _MODEL_TYPE_OF_ARCH[arch]
    if not isinstance(path_or_dict, Mapping):
        p = Path(path_or_dict)
        name = (p if p.is_dir() else p.parent).resolve().name or name
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size"):
        if d.get(key) is None:
            raise ValueError(f"config.json has no {key}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: meshlm's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ValueError(f"{key}={d[key]}: meshlm's projections have no biases")
    theta = _rope_theta(d, arch)
    max_pos = int(d.get("max_position_embeddings") or _DEFAULT_MAX_POS[arch])
    window = d.get("sliding_window")
    window = int(window) if window is not None and int(window) < max_pos else 0
    if window and d.get("use_sliding_window") is False:
        window = 0  # (a window named but switched off)
    dim, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    head_dim = d.get("head_dim")
    head_dim = int(head_dim) if head_dim is not None and head_dim != dim // heads else 0
    if head_dim == 0 and dim % heads:
        raise ValueError(f"hidden_size={dim} is not divisible by num_attention_heads={heads} "
                         "and config.json gives no head_dim")
    kv = d.get("num_key_value_heads")
    fields: dict[str, Any] = dict(
        name=name,
        vocab_size=int(d["vocab_size"]),
        dim=dim,
        n_layers=int(d["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(kv) if kv is not None else heads,
        ffn_hidden=int(d["intermediate_size"]),
        head_dim=head_dim,
        norm_eps=float(d.get("rms_norm_eps") or _DEFAULT_EPS[arch]),
        rope_theta=theta,
        max_seq_len=max_pos,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=float(d.get("initializer_range", 0.02)),
        sliding_window=window,
    )
    if arch == MIXTRAL:
        fields.update(
            moe_experts=int(d.get("num_local_experts", 8)),
            moe_topk=int(d.get("num_experts_per_tok", 2)),
            moe_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        )
    return ModelConfig(**fields)


def hf_config_from_model(cfg: ModelConfig) -> dict[str, Any]:
    """config.json content for ``cfg``: LlamaForCausalLM (dense) or MixtralForCausalLM (MoE).

    Raises ValueError naming the field when Mixtral cannot express the MoE layout.
    """
    if cfg.is_moe and cfg.moe_first_dense:
        raise ValueError(f"moe_first_dense={cfg.moe_first_dense}: {MIXTRAL} has an MoE MLP "
                         "in every layer")
    if cfg.sliding_window and not cfg.is_moe:
        raise ValueError(f"sliding_window={cfg.sliding_window}: {LLAMA} has no sliding "
                         "window (MixtralForCausalLM has)")
    if cfg.is_moe and cfg.moe_shared_experts:
        raise ValueError(f"moe_shared_experts={cfg.moe_shared_experts}: {MIXTRAL} has no "
                         "shared experts")
    arch = MIXTRAL if cfg.is_moe else LLAMA
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _MODEL_TYPE_OF_ARCH[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.expert_hidden if cfg.is_moe else cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.hd,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers < 5 reads rope_theta / rope_scaling, 5.x reads rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if cfg.is_moe:
        out.update({
            "num_local_experts": cfg.moe_experts,
            "num_experts_per_tok": cfg.moe_topk,
            "router_aux_loss_coef": cfg.moe_aux_loss_coef,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "sliding_window": cfg.sliding_window or None,
        })
    else:
        out.update({"attention_bias": False, "mlp_bias": False})
    return out


# ---------------------------------------------------------------------------------- names
