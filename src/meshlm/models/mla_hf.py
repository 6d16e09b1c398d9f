"""Multi-head latent attention in Hugging Face folders (torch-free): DeepSeek-V3's attention.

The :class:`~meshlm.models.hf_part.HFPart` of ``models/mla.py``'s layer (listed in
``models/hf_techniques.py``):

- ``config.json`` (``DeepseekV3ForCausalLM`` only, which has no other attention):
  ``q_lora_rank`` (null: 0, no query compression), ``kv_lora_rank``, ``qk_nope_head_dim``,
  ``qk_rope_head_dim``, ``v_head_dim`` are the ``model.*`` keys of the same names; one key and
  value per head (``num_key_value_heads`` = ``num_attention_heads``); a file leaving a key out
  gets transformers' ``DeepseekV3Config`` default (the published V3 shape); written with
  ``rope_interleave: true``. A model with latent attention exports as DeepSeek-V3 and another
  architecture refuses it; DeepSeek-V3 refuses a model without it (``kv_lora_rank``).
- tensor names, in every decoder layer:

  ==========================================  ===============================================
  meshlm                                      Hugging Face (``model.layers.{i}.`` elided)
  ==========================================  ===============================================
  ``attention.wq`` (no query compression)     ``self_attn.q_proj``
  ``attention.wq_a|q_a_norm|wq_b``            ``self_attn.q_a_proj|q_a_layernorm|q_b_proj``
  ``attention.wkv_a|kv_a_norm|wkv_b``         ``self_attn.kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj``
  ``attention.wo``                            ``self_attn.o_proj``
  ==========================================  ===============================================

- rotary rows: DeepSeek's checkpoints store the rotary output rows interleaved, pairs
  (2i, 2i + 1) (``rope_interleave``, true unless the file says otherwise); meshlm rotates
  halves, pairs (i, i + r/2). :meth:`MLAHF.row_order` gives the permutation of ``wq`` /
  ``wq_b`` (per head: ``qk_nope_head_dim`` plain rows, then ``qk_rope_head_dim`` rotary ones)
  and of ``wkv_a`` (once: ``kv_lora_rank`` plain rows, then the shared rotary key), the same
  as ``models/mla.py``'s ``interleaved_to_half``.

No communication; no memory beyond the permutation (one int per row of a weight).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .hf_arch import DEEPSEEK_V3
from .hf_arch import int_key as _int
from .hf_part import HFPart

if TYPE_CHECKING:
    from .config import ModelConfig

# transformers' DeepseekV3Config defaults, for keys a file leaves out
_DEFAULTS: dict[str, int] = dict(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                                 v_head_dim=128, qk_nope_head_dim=128)
_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}


@functools.lru_cache(maxsize=64)
def interleaved_rows(blocks: int, nope: int, rope: int) -> tuple[int, ...]:
    """The HF row of each meshlm row of ``blocks`` blocks of ``nope`` plain then ``rope``
    rotary rows, the rotary ones stored interleaved: meshlm's rotary row j < r/2 is HF's
    2j, row r/2 + j is HF's 2j + 1."""
    order = list(range(0, rope, 2)) + list(range(1, rope, 2))
    per = nope + rope
    return tuple(b * per + i for b in range(blocks)
                 for i in [*range(nope), *(nope + o for o in order)])


class MLAHF(HFPart):
    """Multi-head latent attention's HF part (module docstring)."""

    name = "mla"

    def export_arch(self, cfg: ModelConfig) -> str | None:
        return DEEPSEEK_V3 if cfg.is_mla else None

    def refuse_export(self, cfg: ModelConfig, arch: str) -> str | None:
        if arch == DEEPSEEK_V3 and not cfg.is_mla:
            return (f"kv_lora_rank={cfg.kv_lora_rank}: {DEEPSEEK_V3} has multi-head latent "
                    "attention only (another of the model's keys asks for that architecture)")
        if arch != DEEPSEEK_V3 and cfg.is_mla:
            return f"kv_lora_rank={cfg.kv_lora_rank}: only {DEEPSEEK_V3} has latent attention"
        return None

    def to_hf(self, cfg: ModelConfig, arch: str) -> dict[str, Any]:
        if arch != DEEPSEEK_V3:
            return {}
        return {
            "q_lora_rank": cfg.q_lora_rank or None,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "rope_interleave": True,  # (weights are written in DeepSeek's interleaved rows)
        }

    def from_hf(self, d: Mapping[str, Any], arch: str,
                fields: Mapping[str, Any]) -> dict[str, Any]:
        if arch != DEEPSEEK_V3:
            return {}
        heads = int(fields["n_heads"])
        kv = d.get("num_key_value_heads")
        if kv is not None and int(kv) != heads:
            raise ValueError(f"num_key_value_heads={kv}: multi-head latent attention has one "
                             f"key and value per head (num_attention_heads={heads})")
        out: dict[str, Any] = {k: _int(d, k, _DEFAULTS[k]) for k in _KEYS}
        if out["kv_lora_rank"] <= 0:
            raise ValueError(f"kv_lora_rank={d.get('kv_lora_rank')}: DeepSeek-V3's attention "
                             "is multi-head latent attention (kv_lora_rank > 0)")
        return {"n_kv_heads": heads, **out}

    def layer_names(self, cfg: ModelConfig, arch: str) -> Mapping[str, str]:
        return _NAMES if cfg.is_mla else {}

    def row_order(self, cfg: ModelConfig, arch: str, d: Mapping[str, Any] | None,
                  rest: str) -> tuple[int, ...] | None:
        if arch != DEEPSEEK_V3 or not cfg.is_mla:
            return None
        if d is not None and not bool(d.get("rope_interleave", True)):
            return None
        if rest in ("attention.wq.weight", "attention.wq_b.weight"):
            return interleaved_rows(cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim)
        if rest == "attention.wkv_a.weight":
            return interleaved_rows(1, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        return None


MLA_HF = MLAHF()

__all__ = ["MLAHF", "MLA_HF", "interleaved_rows"]
