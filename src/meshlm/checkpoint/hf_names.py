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
``feed_forward.w1|w3|w2`` (dense)              ``mlp.gate_proj|up_proj|down_proj``
``feed_forward.router``                        ``mlp.gate`` (Mixtral: ``block_sparse_moe.gate``)
``feed_forward.experts.w1|w3|w2`` (E, ., .)    ``mlp.experts.{e}.gate_proj|up_proj|down_proj``
                                               (Mixtral: ``block_sparse_moe.experts.{e}.w1|w3|w2``)
``feed_forward.shared.w1|w3|w2`` (DeepSeek)    ``mlp.shared_experts.gate_proj|up_proj|down_proj``
MoE ``expert_bias`` (not a parameter)          ``mlp.gate.e_score_correction_bias`` (DeepSeek)
=============================================  ===============================================

A technique's own names come from its :class:`~meshlm.models.hf_part.HFPart` (listed in
``models/hf_techniques.py``; each part's module has its table): weights inside every decoder
layer (another attention layer's projections replace the grouped-query ones above), its own
decoder blocks stored as HF decoder layers from ``n_layers`` on, its weights outside blocks,
HF keys stored as copies of a meshlm tensor (:meth:`HFNames.copies`: checked equal at load,
written at save), stored keys a model may leave out (:meth:`HFNames.dropped`) and weights
whose rows HF stores in another order (:meth:`HFNames.row_order`).

Pure name arithmetic: no communication, no tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..models.config import ModelConfig
from ..models.hf_config import DEEPSEEK_V3, LLAMA, MIXTRAL, QWEN3, QWEN3_MOE
from ..models.hf_techniques import PARTS

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
_SHARED = {
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
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
_EXPERT = re.compile(r"^feed_forward\.experts\.(w[123])$")


class HFNames:
    """HF keys of the meshlm model ``cfg`` in architecture ``arch`` (module docstring).

    ``hf_config``: the folder's ``config.json`` when reading one (None when writing), for the
    parts whose names or row order depend on it.
    """

    def __init__(self, cfg: ModelConfig, arch: str,
                 hf_config: Mapping[str, Any] | None = None) -> None:
        self.cfg, self.arch, self.hf_config = cfg, arch, hf_config
        self.parts = PARTS
        layer: dict[str, str] = dict(_COMMON_LAYER)
        if cfg.attention_layer == "gqa":
            layer.update(_GQA)
        for part in self.parts:
            layer.update(part.layer_names(cfg, arch))
        if arch in (QWEN3, QWEN3_MOE):
            layer.update(_QK_NORM)
        if arch == MIXTRAL:
            layer["feed_forward.router.weight"] = "block_sparse_moe.gate.weight"
        else:
            layer["feed_forward.router.weight"] = "mlp.gate.weight"
        if arch == DEEPSEEK_V3:
            layer.update(_SHARED)
        self._layer = layer

    # ------------------------------------------------------------------ meshlm -> HF
    def layer_prefix(self, name: str) -> tuple[str, str] | None:
        """(HF layer prefix ``model.layers.{j}.``, the rest of the meshlm name) of a decoder
        block's parameter (a part's own blocks: the HF layer it names, from ``n_layers`` on);
        None otherwise."""
        m = _MESHLM_LAYER.match(name)
        if m:
            return f"model.layers.{m.group(1)}.", m.group(2)
        for part in self.parts:
            where = part.block_of(self.cfg, name)
            if where is not None:
                return f"model.layers.{where[0]}.", where[1]
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
        for part in self.parts:
            key = part.key(self.cfg, self.arch, name)
            if key is not None:
                return key
        raise ValueError(f"{name!r} has no {self.arch} counterpart")

    def is_stacked_expert(self, name: str) -> bool:
        where = self.layer_prefix(name)
        return where is not None and bool(_EXPERT.match(where[1]))

    def row_order(self, name: str) -> tuple[int, ...] | None:
        """The HF row of each meshlm row (dim 0) of a block weight whose rows the architecture
        stores in another order (a part's :meth:`HFPart.row_order`); None for the others."""
        where = self.layer_prefix(name)
        if where is None:
            return None
        for part in self.parts:
            rows = part.row_order(self.cfg, self.arch, self.hf_config, where[1])
            if rows is not None:
                return rows
        return None

    def copies(self, name: str) -> list[str]:
        """HF keys stored as copies of meshlm parameter ``name`` (the parts')."""
        return [k for part in self.parts for k in part.copies(self.cfg, self.arch, name)]

    def bias_key(self, layer: int) -> str | None:
        """The HF key of MoE block ``layer``'s selection bias (DeepSeek-V3's
        ``e_score_correction_bias``; the parts' own blocks from ``n_layers`` on)."""
        if self.arch != DEEPSEEK_V3:
            return None
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"

    def dropped(self, key: str) -> bool:
        """True for a stored HF key the model leaves out (a part's extra stored layers beyond
        what the model holds)."""
        return any(part.dropped(self.cfg, self.arch, self.hf_config, key)
                   for part in self.parts)


def default_arch(cfg: ModelConfig) -> str:
    """The architecture of the cfg-less legacy names (Llama, Mixtral for MoE)."""
    return MIXTRAL if cfg.is_moe else LLAMA


__all__ = ["EXPERT_PROJ", "FUSED_DOWN", "FUSED_GATE_UP", "GLOBAL", "HFNames", "default_arch"]
