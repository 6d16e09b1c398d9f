"""Tensor names of Hugging Face folders, per architecture (``models/hf_config.py``).

:class:`HFNames` maps meshlm's parameter names to the HF keys of one architecture and back:

=============================================  ===============================================
meshlm                                         Hugging Face (``model.layers.{i}.`` elided)
=============================================  ===============================================
``tok_embeddings.weight`` / ``norm.weight``    ``model.embed_tokens.weight`` / ``model.norm.weight``
``output.weight``                              ``lm_head.weight``
``attention_norm`` / ``ffn_norm``              ``input_layernorm`` / ``post_attention_layernorm``
``attention.wq|wk|wv|wo``                      ``self_attn.q_proj|k_proj|v_proj|o_proj``
``attention.q_norm|k_norm`` (Qwen3)            ``self_attn.q_norm|k_norm``
``attention.wq_a|q_a_norm|wq_b`` (MLA)         ``self_attn.q_a_proj|q_a_layernorm|q_b_proj``
``attention.wkv_a|kv_a_norm|wkv_b`` (MLA)      ``self_attn.kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj``
``feed_forward.w1|w3|w2`` (dense)              ``mlp.gate_proj|up_proj|down_proj``
``feed_forward.router``                        ``mlp.gate`` (Mixtral: ``block_sparse_moe.gate``)
``feed_forward.experts.w1|w3|w2`` (E, ., .)    ``mlp.experts.{e}.gate_proj|up_proj|down_proj``
                                               (Mixtral: ``block_sparse_moe.experts.{e}.w1|w3|w2``)
``feed_forward.shared.w1|w3|w2`` (DeepSeek)    ``mlp.shared_experts.gate_proj|up_proj|down_proj``
MoE ``expert_bias`` (not a parameter)          ``mlp.gate.e_score_correction_bias`` (DeepSeek)
``mtp.{k}.enorm|hnorm|proj|norm`` (DeepSeek)   layer ``n + k``: ``enorm|hnorm|eh_proj|shared_head.norm``
``mtp.{k}.block.*``                            layer ``n + k``: the decoder layer's keys
=============================================  ===============================================

DeepSeek-V3's multi-token prediction layers (``num_nextn_predict_layers``) are stored as decoder
layers ``n_layers + k``, each with copies of the embedding (``embed_tokens``) and of the head
(``shared_head.head``): :meth:`HFNames.copies` names them (checked equal at load, written at
save). Its rotary rows are interleaved (``rope_interleave``): :meth:`HFNames.rope_rows` names
the weights whose output rows are reordered (``models/mla.py``: ``interleaved_to_half``).

Pure name arithmetic: no communication, no tensors.
"""

from __future__ import annotations

import re

from ..models.config import ModelConfig
from ..models.hf_config import DEEPSEEK_V3, LLAMA, MIXTRAL, QWEN3, QWEN3_MOE

EXPERT_PROJ = ("w1", "w2", "w3")
_COMMON_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_GQA = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_QK_NORM = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_MLA = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_SHARED = {
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_HF_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Qwen3-MoE, DeepSeek
GLOBAL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
FUSED_GATE_UP = "mlp.experts.gate_up_proj"  # transformers 5.x in memory: (E, 2F, H)
FUSED_DOWN = "mlp.experts.down_proj"  # (E, H, F)
_MESHLM_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MESHLM_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^feed_forward\.experts\.(w[123])$")


class HFNames:
    """HF keys of the meshlm model ``cfg`` in architecture ``arch`` (module docstring).

    ``rope_interleave``: DeepSeek-V3's rotary rows are stored interleaved (its default).
    """

    def __init__(self, cfg: ModelConfig, arch: str, rope_interleave: bool = True) -> None:
        self.cfg, self.arch = cfg, arch
        self.rope_interleave = rope_interleave and arch == DEEPSEEK_V3
        layer: dict[str, str] = dict(_COMMON_LAYER)
        layer.update(_MLA if cfg.is_mla else _GQA)
        if arch in (QWEN3, QWEN3_MOE):
            layer.update(_QK_NORM)
        if arch == MIXTRAL:
            layer["feed_forward.router.weight"] = "block_sparse_moe.gate.weight"
        else:
            layer["feed_forward.router.weight"] = "mlp.gate.weight"
        if arch == DEEPSEEK_V3:
            layer.update(_SHARED)
        self._layer = layer
        self._layer_inv = {v: k for k, v in layer.items()}

    # ------------------------------------------------------------------ meshlm -> HF
    def layer_prefix(self, name: str) -> tuple[str, str] | None:
        """(HF layer prefix ``model.layers.{j}.``, the rest of the meshlm name) of a decoder
        block's parameter (multi-token prediction blocks: layer ``n_layers + k``); None
        otherwise."""
        m = _MESHLM_LAYER.match(name)
        if m:
            return f"model.layers.{m.group(1)}.", m.group(2)
        m = _MESHLM_MTP.match(name)
        if m and m.group(2).startswith("block."):
            j = self.cfg.n_layers + int(m.group(1))
            return f"model.layers.{j}.", m.group(2)[len("block."):]
        return None

    def expert_key(self, name: str, expert: int) -> str:
        """The HF key of expert ``expert`` of a stacked expert tensor."""
        where = self.layer_prefix(name)
        m = _EXPERT.match(where[1]) if where else None
        if where is None or m is None:
            raise ValueError(f"{name!r} is not a stacked expert tensor")
        proj = m.group(1)
        if self.arch == MIXTRAL:
            return f"{where[0]}block_sparse_moe.experts.{expert}.{proj}.weight"
        return f"{where[0]}mlp.experts.{expert}.{_HF_PROJ[proj]}.weight"

    def fused_expert(self, name: str) -> tuple[str, int] | None:
        """(fused HF key, which half) of a stacked expert tensor in transformers 5.x's
        in-memory layout: w1 is ``gate_up_proj``'s first half (0), w3 its second (1), w2
        ``down_proj`` (0)."""
        where = self.layer_prefix(name)
        m = _EXPERT.match(where[1]) if where else None
        if where is None or m is None:
            return None
        proj = m.group(1)
        if proj == "w2":
            return f"{where[0]}{FUSED_DOWN}", 0
        return f"{where[0]}{FUSED_GATE_UP}", 0 if proj == "w1" else 1

    def key(self, name: str) -> str:
        """The HF key of meshlm parameter ``name`` (not a stacked expert tensor: see
        :meth:`expert_key`); ValueError when the architecture has none."""
        if name in GLOBAL:
            return GLOBAL[name]
        where = self.layer_prefix(name)
        if where is not None and where[1] in self._layer:
            return where[0] + self._layer[where[1]]
        m = _MESHLM_MTP.match(name)
        if m and self.arch == DEEPSEEK_V3 and m.group(2) in _MTP:
            return f"model.layers.{self.cfg.n_layers + int(m.group(1))}.{_MTP[m.group(2)]}"
        raise ValueError(f"{name!r} has no {self.arch} counterpart")

    def is_stacked_expert(self, name: str) -> bool:
        where = self.layer_prefix(name)
        return where is not None and bool(_EXPERT.match(where[1]))

    def rope_rows(self, name: str) -> tuple[int, int, int] | None:
        """(blocks, plain rows, rotary rows) of a weight whose rotary output rows are stored
        interleaved (DeepSeek-V3: ``wq`` / ``wq_b`` per head, ``wkv_a`` once); None for the
        others."""
        if not (self.rope_interleave and self.cfg.is_mla):
            return None
        where = self.layer_prefix(name)
        if where is None:
            return None
        c = self.cfg
        if where[1] in ("attention.wq.weight", "attention.wq_b.weight"):
            return c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        if where[1] == "attention.wkv_a.weight":
            return 1, c.kv_lora_rank, c.qk_rope_head_dim
        return None

    def copies(self, name: str) -> list[str]:
        """HF keys stored as copies of meshlm parameter ``name``: each DeepSeek-V3
        multi-token prediction layer's ``embed_tokens`` (of the embedding) and
        ``shared_head.head`` (of the head; of the embedding when tied)."""
        if self.arch != DEEPSEEK_V3 or not self.cfg.mtp_depth:
            return []
        layers = [self.cfg.n_layers + k for k in range(self.cfg.mtp_depth)]
        out = []
        if name == "tok_embeddings.weight":
            out += [f"model.layers.{j}.embed_tokens.weight" for j in layers]
        if name == "output.weight" or (name == "tok_embeddings.weight"
                                       and self.cfg.tie_embeddings):
            out += [f"model.layers.{j}.shared_head.head.weight" for j in layers]
        return out

    def bias_key(self, layer: int) -> str | None:
        """The HF key of MoE layer ``layer``'s selection bias (DeepSeek-V3's
        ``e_score_correction_bias``; multi-token prediction blocks from ``n_layers`` on)."""
        if self.arch != DEEPSEEK_V3:
            return None
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"

    def mtp_layer(self, key: str) -> int | None:
        """The decoder layer index of an HF key when it is a multi-token prediction layer's
        (``n_layers`` or more), else None."""
        m = re.match(r"^model\.layers\.(\d+)\.", key)
        if m and int(m.group(1)) >= self.cfg.n_layers:
            return int(m.group(1))
        return None


def default_arch(cfg: ModelConfig) -> str:
    """The architecture of the cfg-less legacy names (Llama, Mixtral for MoE)."""
    return MIXTRAL if cfg.is_moe else LLAMA


__all__ = ["EXPERT_PROJ", "FUSED_DOWN", "FUSED_GATE_UP", "GLOBAL", "HFNames", "default_arch"]
