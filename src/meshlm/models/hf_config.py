"""Hugging Face ``config.json`` <-> :class:`ModelConfig`: Llama, Mixtral, Qwen3, Qwen3-MoE and
DeepSeek-V3.

Architectures both ways (:func:`hf_architecture` picks the one a meshlm model exports as):

- ``LlamaForCausalLM``: dense grouped-query attention;
- ``MixtralForCausalLM``: an MoE MLP in every layer, softmax router, top-k renormalised, no
  shared expert; a window shorter than the context (``sliding_window``) is
  ``model.sliding_window``;
- ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``: Llama / MoE with a per-head RMSNorm of
  queries and keys (``model.qk_norm``), ``head_dim`` free of ``hidden_size``; the MoE's dense
  layers (``mlp_only_layers``, ``decoder_sparse_step``) must be the first ones
  (``model.moe_first_dense``), ``norm_topk_prob`` is ``model.moe_norm_topk``;
- ``DeepseekV3ForCausalLM``: sigmoid routing with group-limited selection (``n_group``,
  ``topk_group``), ``routed_scaling_factor``, ``norm_topk_prob``, shared experts,
  ``first_k_dense_replace`` dense layers and the auxiliary-loss-free selection bias
  (``e_score_correction_bias``: ``model.moe_balance=bias``); its attention layer and its
  extra stored layers are registered parts' (below).

A technique with keys of its own (its attention layer, its extra stored layers) is an
:class:`~meshlm.models.hf_part.HFPart` listed in ``models/hf_techniques.py``: this module
loops over the parts, which translate their keys both ways (:meth:`HFPart.from_hf`,
:meth:`HFPart.to_hf`, :meth:`HFPart.from_folder`), name the architecture a model using them
exports as (:meth:`HFPart.export_arch`) and what an architecture cannot express
(:meth:`HFPart.refuse_export`); each part's module describes its mapping.

Rotary embeddings: plain RoPE or YaRN (``rope_type`` ``yarn``: ``factor``,
``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
``mscale_all_dim``, ``attention_factor``; ``model.rope_*``), read from ``rope_parameters``
(transformers 5) or ``rope_scaling`` + ``rope_theta`` (earlier files), written as both.
Hugging Face scales YaRN's tables by ``attention_factor``, by default
``mscale(f, mscale) / mscale(f, mscale_all_dim)`` when both are set, else ``mscale(f, 1)``;
meshlm by ``mscale(f, model.rope_mscale) / mscale(f, model.rope_mscale_all_dim)`` (0: 1), and
DeepSeek's attention multiplies its softmax scale by ``mscale(f, mscale_all_dim)^2`` in both:
the mapping keeps the two equal, solving for ``model.rope_mscale`` where the file's pair is not
meshlm's.

Whatever meshlm cannot express (biases, other activations or rotary variants, MoE layers that
are not the last ones, ...) is refused with a ValueError naming the field. No communication;
no memory beyond the parsed JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import ModelConfig
from .hf_arch import DEEPSEEK_V3, LLAMA, MIXTRAL, QWEN3, QWEN3_MOE
from .hf_arch import get_key as _get
from .hf_arch import int_key as _int
from .hf_techniques import PARTS

_ARCH_OF_MODEL_TYPE = {"llama": LLAMA, "mixtral": MIXTRAL, "qwen3": QWEN3,
                       "qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3}
_MODEL_TYPE_OF_ARCH = {v: k for k, v in _ARCH_OF_MODEL_TYPE.items()}
_DEFAULT_THETA = {LLAMA: 10000.0, MIXTRAL: 1000000.0, QWEN3: 10000.0, QWEN3_MOE: 10000.0,
                  DEEPSEEK_V3: 10000.0}
_DEFAULT_EPS = {LLAMA: 1e-6, MIXTRAL: 1e-5, QWEN3: 1e-6, QWEN3_MOE: 1e-6, DEEPSEEK_V3: 1e-6}
_DEFAULT_MAX_POS = {LLAMA: 2048, MIXTRAL: 4096 * 32, QWEN3: 32768, QWEN3_MOE: 32768,
                    DEEPSEEK_V3: 4096}
# transformers' DeepseekV3Config defaults (the published V3 shape), for keys a file leaves out
_DEEPSEEK_DEFAULTS: dict[str, Any] = dict(
    intermediate_size=18432, moe_intermediate_size=2048, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True)
# architectures whose attention multiplies its softmax scale by YaRN's mscale(f, mscale_all_dim)^2
_SOFTMAX_MSCALE = frozenset({DEEPSEEK_V3})

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
    known = ", ".join(_ARCH_OF_MODEL_TYPE.values())
    if archs:
        if len(archs) != 1 or archs[0] not in _MODEL_TYPE_OF_ARCH:
            raise ValueError(f"architectures={archs}: meshlm reads {known} only")
        arch = archs[0]
        if model_type is not None and model_type != _MODEL_TYPE_OF_ARCH[arch]:
            raise ValueError(f"model_type={model_type!r} does not match architectures={archs}")
        return arch
    if model_type in _ARCH_OF_MODEL_TYPE:
        return _ARCH_OF_MODEL_TYPE[model_type]
    raise ValueError(f"model_type={model_type!r}: meshlm reads "
                     f"{', '.join(repr(k) for k in _ARCH_OF_MODEL_TYPE)} only")


def hf_architecture_of(path_or_dict: str | Path | Mapping[str, Any]) -> str:
    """The architecture an HF ``config.json`` names (ValueError for one meshlm does not read)."""
    return _architecture(_hf_dict(path_or_dict))


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's ``0.1 mscale ln(factor) + 1`` (1 when factor <= 1), as Hugging Face's."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_fields(key: str, rope: Mapping[str, Any], theta: float, max_pos: int,
                 softmax_mscale: bool) -> dict[str, Any]:
    """ModelConfig's rotary fields of one ``rope_parameters`` / ``rope_scaling`` mapping."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ValueError(f"{key}.partial_rotary_factor={rope['partial_rotary_factor']}: "
                         "meshlm rotates the whole head")
    if rope.get("rope_theta") is not None:
        theta = float(rope["rope_theta"])
    if kind == "default":
        return dict(rope_theta=theta)
    if kind != "yarn":
        raise ValueError(f"{key}={dict(rope)}: meshlm has plain RoPE and YaRN only "
                         f"(rope_type {kind!r})")
    if rope.get("truncate", True) is not True:
        raise ValueError(f"{key}.truncate={rope['truncate']}: meshlm's YaRN rounds its "
                         "correction range outwards (truncate true)")
    original = rope.get("original_max_position_embeddings") or max_pos
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_pos / float(original)
    if factor < 1:
        raise ValueError(f"{key}.factor={factor}: YaRN stretches the context (factor >= 1)")
    m, m_all, given = rope.get("mscale"), rope.get("mscale_all_dim"), rope.get("attention_factor")
    if m and m_all and given is None:  # (HF's table factor is meshlm's: the pair as it is)
        m_mesh, m_all_mesh = float(m), float(m_all)
    else:
        # HF scales the tables by ``table``; DeepSeek's scores by mscale(f, m_all)^2
        table = float(given) if given is not None else _yarn_mscale(factor, 1.0)
        m_all_mesh = float(m_all or 0.0) if softmax_mscale else 0.0
        if given is None and not m_all_mesh:
            m_mesh = 1.0
        elif factor == 1:
            if abs(table - 1.0) > 1e-12:
                raise ValueError(f"{key}.attention_factor={given} with factor 1")
            m_mesh = 1.0
        else:  # mscale(f, m) / mscale(f, m_all) = table
            m_mesh = (table * _yarn_mscale(factor, m_all_mesh) - 1.0) / (0.1 * math.log(factor))
    return dict(rope_theta=theta, rope_factor=factor, rope_original_max_len=int(original),
                rope_beta_fast=float(rope.get("beta_fast") or 32.0),
                rope_beta_slow=float(rope.get("beta_slow") or 1.0),
                rope_mscale=m_mesh, rope_mscale_all_dim=m_all_mesh)


def _rope(d: Mapping[str, Any], arch: str, max_pos: int) -> dict[str, Any]:
    """The rotary fields of an HF config (``rope_parameters`` or ``rope_scaling``; when both
    are given and not plain they must agree); ValueError for what meshlm cannot express."""
    theta = d.get("rope_theta")
    theta = float(theta if theta is not None else _DEFAULT_THETA[arch])
    found: list[tuple[str, dict[str, Any]]] = []
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise ValueError(f"{key}={rope!r}: expected a mapping or null")
        if any(isinstance(v, Mapping) for v in rope.values()):
            raise ValueError(f"{key}: rotary parameters per layer type are not supported "
                             "(meshlm has one rotary embedding for all layers)")
        found.append((key, _rope_fields(key, rope, theta, max_pos,
                                        arch in _SOFTMAX_MSCALE)))
    if d.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor={d['partial_rotary_factor']}: "
                         "meshlm rotates the whole head")
    scaled = [(k, f) for k, f in found if len(f) > 1]
    if len(scaled) == 2 and scaled[0][1] != scaled[1][1]:
        raise ValueError(f"rope_parameters={d['rope_parameters']} and rope_scaling="
                         f"{d['rope_scaling']} disagree")
    if scaled:
        return scaled[0][1]
    return found[0][1] if found else dict(rope_theta=theta)


def _rope_theta(d: Mapping[str, Any], arch: str) -> float:
    """The base of the rotary embedding (ValueError for a variant meshlm cannot express)."""
    max_pos = int(d.get("max_position_embeddings") or _DEFAULT_MAX_POS[arch])
    return float(_rope(d, arch, max_pos)["rope_theta"])


def _window(d: Mapping[str, Any], arch: str, n_layers: int, max_pos: int) -> int:
    """``model.sliding_window`` of an HF config (0: none); Qwen3's per-layer windows must
    cover every layer or none."""
    window = d.get("sliding_window")
    if arch in (QWEN3, QWEN3_MOE) and not d.get("use_sliding_window", False):
        window = None
    if arch == QWEN3 and window is not None:
        types = d.get("layer_types") or [
            "sliding_attention" if i >= int(d.get("max_window_layers", 28)) else "full_attention"
            for i in range(n_layers)]
        if set(types) != {"sliding_attention"}:
            raise ValueError(f"layer_types={types}: meshlm's sliding window covers every layer "
                             "or none (use_sliding_window with max_window_layers=0)")
    if arch in (LLAMA, DEEPSEEK_V3):
        window = None  # (these architectures have none, whatever the key says)
    window = int(window) if window is not None and int(window) < max_pos else 0
    if window and d.get("use_sliding_window") is False:
        window = 0  # (a window named but switched off)
    return window


def _qwen_first_dense(d: Mapping[str, Any], n_layers: int) -> int:
    """``model.moe_first_dense`` of a Qwen3-MoE config: its MoE layers must be the last ones."""
    step = _int(d, "decoder_sparse_step", 1)
    dense_only = d.get("mlp_only_layers") or []
    if step < 1:
        raise ValueError(f"decoder_sparse_step={step} must be >= 1")
    moe = [i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0]
    if not moe or moe != list(range(moe[0], n_layers)):
        raise ValueError(f"decoder_sparse_step={step}, mlp_only_layers={list(dense_only)}: "
                         f"MoE layers {moe} of {n_layers}; meshlm's MoE layers are the last "
                         "ones (model.moe_first_dense dense layers first)")
    return moe[0]


def _deepseek_fields(d: Mapping[str, Any], n_layers: int) -> dict[str, Any]:
    """The routing fields of a DeepSeek-V3 config (its attention's fields are a part's)."""
    g = {k: _get(d, k, v) for k, v in _DEEPSEEK_DEFAULTS.items()}
    score = d.get("scoring_func", "sigmoid")
    if score != "sigmoid":
        raise ValueError(f"scoring_func={score!r}: DeepseekV3ForCausalLM routes by sigmoid "
                         "scores")
    method = d.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ValueError(f"topk_method={method!r}: meshlm reads DeepSeek-V3's noaux_tc "
                         "(group-limited selection with the score correction bias)")
    if _int(d, "moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={d['moe_layer_freq']}: meshlm's MoE layers are "
                         "every layer from first_k_dense_replace on")
    first_dense = _int(d, "first_k_dense_replace", g["first_k_dense_replace"])
    experts = _int(d, "n_routed_experts", g["n_routed_experts"])
    if first_dense >= n_layers:
        experts = 0  # (every layer dense)
    out: dict[str, Any] = {}
    if experts:
        out.update(
            moe_experts=experts,
            moe_topk=_int(d, "num_experts_per_tok", g["num_experts_per_tok"]),
            moe_ffn_hidden=_int(d, "moe_intermediate_size", g["moe_intermediate_size"]),
            moe_shared_experts=_int(d, "n_shared_experts", g["n_shared_experts"]),
            moe_first_dense=first_dense,
            moe_score="sigmoid",
            moe_norm_topk=bool(g["norm_topk_prob"]),
            moe_n_group=_int(d, "n_group", g["n_group"]) or 1,
            moe_topk_group=_int(d, "topk_group", g["topk_group"]) or 1,
            moe_routed_scale=float(g["routed_scaling_factor"] or 1.0),
            moe_balance="bias",
        )
        if d.get("aux_loss_alpha") is not None:
            out["moe_aux_loss_coef"] = float(d["aux_loss_alpha"])
    return out


def model_config_from_hf(path_or_dict: str | Path | Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of an HF ``config.json`` (a folder, the file, or its parsed dict).

    Raises ValueError naming the field for anything meshlm's model cannot express. The
    registered parts read their keys (:meth:`HFPart.from_hf`) and, for a folder, what its
    stored tensors decide (:meth:`HFPart.from_folder`).
    """
    d = _hf_dict(path_or_dict)
    arch = _architecture(d)
    name = _MODEL_TYPE_OF_ARCH[arch]
    folder: Path | None = None
    if not isinstance(path_or_dict, Mapping):
        p = Path(path_or_dict)
        folder = p if p.is_dir() else p.parent
        name = folder.resolve().name or name
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if d.get(key) is None:
            raise ValueError(f"config.json has no {key}")
    if arch != DEEPSEEK_V3 and d.get("intermediate_size") is None:
        raise ValueError("config.json has no intermediate_size")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: meshlm's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ValueError(f"{key}={d[key]}: meshlm's projections have no biases")
    max_pos = int(d.get("max_position_embeddings") or _DEFAULT_MAX_POS[arch])
    dim, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    n_layers = int(d["num_hidden_layers"])
    head_dim: int = 0
    if arch == QWEN3:
        head_dim = int(d.get("head_dim") or 128)
    elif arch != DEEPSEEK_V3 and d.get("head_dim") is not None:
        head_dim = int(d["head_dim"])
    head_dim = head_dim if head_dim and head_dim * heads != dim else 0
    if arch == DEEPSEEK_V3 and (dim % heads or (dim // heads) % 2):
        # (unused by DeepSeek-V3's attention; keeps ModelConfig's grouped-query checks quiet)
        head_dim = 2 * max(1, dim // heads // 2)
    if head_dim == 0 and dim % heads:
        raise ValueError(f"hidden_size={dim} is not divisible by num_attention_heads={heads} "
                         "and config.json gives no head_dim")
    kv = d.get("num_key_value_heads")
    fields: dict[str, Any] = dict(
        name=name,
        vocab_size=int(d["vocab_size"]),
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=int(kv) if kv is not None else heads,
        ffn_hidden=int(_get(d, "intermediate_size", _DEEPSEEK_DEFAULTS["intermediate_size"])),
        head_dim=head_dim,
        norm_eps=float(d.get("rms_norm_eps") or _DEFAULT_EPS[arch]),
        max_seq_len=max_pos,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=float(d.get("initializer_range", 0.02)),
        sliding_window=_window(d, arch, n_layers, max_pos),
        **_rope(d, arch, max_pos),
    )
    if arch == MIXTRAL:
        fields.update(
            moe_experts=int(d.get("num_local_experts", 8)),
            moe_topk=int(d.get("num_experts_per_tok", 2)),
            moe_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        )
    elif arch in (QWEN3, QWEN3_MOE):
        fields["qk_norm"] = True
    if arch == QWEN3_MOE:
        experts = _int(d, "num_experts", _int(d, "num_local_experts", 128))
        if experts:
            fields.update(
                moe_experts=experts,
                moe_topk=_int(d, "num_experts_per_tok", 8),
                moe_ffn_hidden=_int(d, "moe_intermediate_size", 768),
                moe_first_dense=_qwen_first_dense(d, n_layers),
                moe_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
                moe_score="softmax",
                moe_norm_topk=bool(d.get("norm_topk_prob", False)),
            )
    if arch == DEEPSEEK_V3:
        fields.update(_deepseek_fields(d, n_layers))
    for part in PARTS:
        fields.update(part.from_hf(d, arch, fields))
    if folder is not None:
        where = folder
        for part in PARTS:
            fields.update(part.from_folder(fields, d, arch, lambda: _folder_keys(where)))
    return ModelConfig(**fields)


def _folder_keys(folder: Path) -> list[str]:
    """Tensor names of an HF folder, from its index or its one file's header."""
    index = folder / INDEX_FILE
    if index.is_file():
        return list(_read_json(index).get("weight_map") or {})
    single = folder / SINGLE_FILE
    if not single.is_file():
        return []
    with open(single, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return [k for k in header if k != "__metadata__"]


# ---------------------------------------------------------------------------------- export


def hf_architecture(cfg: ModelConfig) -> str:
    """The HF architecture ``cfg`` exports as: the one a registered part asks for
    (:meth:`HFPart.export_arch`); DeepseekV3ForCausalLM for sigmoid routing;
    Qwen3(Moe)ForCausalLM with ``qk_norm``; else MixtralForCausalLM (MoE) or
    LlamaForCausalLM."""
    for part in PARTS:
        arch = part.export_arch(cfg)
        if arch is not None:
            return arch
    if cfg.is_moe and cfg.moe_score == "sigmoid":
        return DEEPSEEK_V3
    if cfg.qk_norm:
        return QWEN3_MOE if cfg.is_moe else QWEN3
    return MIXTRAL if cfg.is_moe else LLAMA


def _refuse_export(cfg: ModelConfig, arch: str) -> None:
    """ValueError naming the field when ``arch`` cannot express ``cfg`` (the registered
    parts' reasons first)."""
    for part in PARTS:
        why = part.refuse_export(cfg, arch)
        if why is not None:
            raise ValueError(why)
    moe_fields = cfg.is_moe
    checks: list[tuple[bool, str]] = []
    if arch == DEEPSEEK_V3:
        checks += [
            (cfg.qk_norm, f"qk_norm=True: {DEEPSEEK_V3} has no query/key norm"),
            (moe_fields and cfg.moe_score != "sigmoid", f"moe_score={cfg.moe_score!r}: "
             f"{DEEPSEEK_V3} routes by sigmoid scores"),
            (cfg.sliding_window > 0, f"sliding_window={cfg.sliding_window}: {DEEPSEEK_V3} "
             "has no sliding window"),
            (moe_fields and cfg.moe_experts // cfg.moe_n_group < 2, f"moe_n_group="
             f"{cfg.moe_n_group}: {DEEPSEEK_V3} scores a group by its 2 best experts "
             f"(moe_experts={cfg.moe_experts} gives fewer per group)"),
        ]
    else:
        checks += [
            (moe_fields and cfg.moe_n_group > 1, f"moe_n_group={cfg.moe_n_group}: {arch} has "
             f"no group-limited routing ({DEEPSEEK_V3} has)"),
            (moe_fields and cfg.moe_routed_scale != 1.0, f"moe_routed_scale="
             f"{cfg.moe_routed_scale}: {arch} does not scale the routed output"),
            (moe_fields and cfg.moe_shared_experts > 0, f"moe_shared_experts="
             f"{cfg.moe_shared_experts}: {arch} has no shared experts"),
        ]
    if arch == MIXTRAL:
        checks += [
            (cfg.moe_first_dense > 0, f"moe_first_dense={cfg.moe_first_dense}: {MIXTRAL} has "
             "an MoE MLP in every layer"),
            (not cfg.moe_norm_topk, f"moe_norm_topk=False: {MIXTRAL} renormalises the top-k "
             f"weights ({QWEN3_MOE}, with model.qk_norm, has norm_topk_prob)"),
        ]
    if arch == LLAMA:
        checks.append((cfg.sliding_window > 0, f"sliding_window={cfg.sliding_window}: {LLAMA} "
                       "has no sliding window (MixtralForCausalLM has)"))
    for bad, why in checks:
        if bad:
            raise ValueError(why)


def _rope_out(cfg: ModelConfig) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling`` (transformers < 5) and ``rope_parameters`` (5.x)."""
    if cfg.rope_factor <= 1:
        return {"rope_theta": cfg.rope_theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    f, m, m_all = cfg.rope_factor, cfg.rope_mscale, cfg.rope_mscale_all_dim
    yarn: dict[str, Any] = {"rope_type": "yarn", "factor": f,
                            "original_max_position_embeddings": cfg.rope_original_max_len,
                            "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow}
    if m and m_all:
        yarn.update(mscale=m, mscale_all_dim=m_all)
    else:
        table = _yarn_mscale(f, m) / _yarn_mscale(f, m_all)
        if m_all:
            yarn["mscale_all_dim"] = m_all  # (DeepSeek's softmax factor)
        if table != _yarn_mscale(f, 1.0):
            yarn["attention_factor"] = table
    return {"rope_theta": cfg.rope_theta, "rope_scaling": {"type": "yarn", **yarn},
            "rope_parameters": {**yarn, "rope_theta": cfg.rope_theta}}


def hf_config_from_model(cfg: ModelConfig) -> dict[str, Any]:
    """config.json content for ``cfg``, as :func:`hf_architecture` picks it.

    Raises ValueError naming the field when that architecture cannot express ``cfg``.
    """
    arch = hf_architecture(cfg)
    _refuse_export(cfg, arch)
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _MODEL_TYPE_OF_ARCH[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.expert_hidden if arch == MIXTRAL else cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads if arch == DEEPSEEK_V3 else cfg.n_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        **_rope_out(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
        "attention_bias": False,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if arch != DEEPSEEK_V3:
        out["head_dim"] = cfg.hd
    if arch == LLAMA:
        out["mlp_bias"] = False
    if arch == MIXTRAL:
        out.update({
            "num_local_experts": cfg.moe_experts,
            "num_experts_per_tok": cfg.moe_topk,
            "router_aux_loss_coef": cfg.moe_aux_loss_coef,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "sliding_window": cfg.sliding_window or None,
        })
    if arch in (QWEN3, QWEN3_MOE):
        window = cfg.sliding_window or None
        out.update({"use_sliding_window": window is not None, "sliding_window": window,
                    "max_window_layers": 0 if window else cfg.n_layers})
    if arch == QWEN3:
        out["layer_types"] = ["sliding_attention" if window else "full_attention"] * cfg.n_layers
    if arch == QWEN3_MOE:
        out.update({
            "num_experts": cfg.moe_experts,
            "num_experts_per_tok": cfg.moe_topk,
            "moe_intermediate_size": cfg.expert_hidden,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(cfg.moe_first_dense)),
            "norm_topk_prob": cfg.moe_norm_topk,
            "router_aux_loss_coef": cfg.moe_aux_loss_coef,
            "output_router_logits": False,
        })
    for part in PARTS:
        out.update(part.to_hf(cfg, arch))
    if arch == DEEPSEEK_V3:
        out.update(_deepseek_out(cfg))
    return out


def _deepseek_out(cfg: ModelConfig) -> dict[str, Any]:
    """The DeepSeek-V3 routing keys of ``cfg`` (a dense model: every layer
    ``first_k_dense_replace``)."""
    out: dict[str, Any] = {
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
    }
    if cfg.is_moe:
        out.update({
            "n_routed_experts": cfg.moe_experts,
            "num_experts_per_tok": cfg.moe_topk,
            "moe_intermediate_size": cfg.expert_hidden,
            "n_shared_experts": cfg.moe_shared_experts,
            "first_k_dense_replace": cfg.moe_first_dense,
            "n_group": cfg.moe_n_group,
            "topk_group": cfg.moe_topk_group,
            "routed_scaling_factor": cfg.moe_routed_scale,
            "norm_topk_prob": cfg.moe_norm_topk,
            "aux_loss_alpha": cfg.moe_aux_loss_coef,
        })
    else:
        out.update({"first_k_dense_replace": cfg.n_layers, "n_routed_experts": 1,
                    "num_experts_per_tok": 1, "n_shared_experts": 0, "n_group": 1,
                    "topk_group": 1, "moe_intermediate_size": cfg.ffn_hidden})
    return out
