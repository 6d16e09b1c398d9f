"""Multi-token prediction in Hugging Face folders (torch-free): DeepSeek-V3's MTP layers.

The :class:`~meshlm.models.hf_part.HFPart` of ``models/mtp.py``'s modules (listed in
``models/hf_techniques.py``):

- ``config.json``: ``num_nextn_predict_layers`` (``num_mtp_layers`` in some files) is
  ``model.mtp_depth``; a model with multi-token prediction exports as
  ``DeepseekV3ForCausalLM``, the one architecture that stores it. A folder's depth is the
  number of those layers whose weights it holds, all or none (:func:`stored_depth`;
  transformers' own ``save_pretrained`` writes none).
- tensor names: depth k is stored as decoder layer ``n = n_layers + k``:

  ==========================================  ===============================================
  meshlm                                      Hugging Face
  ==========================================  ===============================================
  ``mtp.{k}.enorm|hnorm|proj|norm``           ``model.layers.{n}.enorm|hnorm|eh_proj|shared_head.norm``
  ``mtp.{k}.block.*``                         ``model.layers.{n}.*`` (the decoder layer's keys)
  (copies of) ``tok_embeddings.weight``       ``model.layers.{n}.embed_tokens.weight``
  (copies of) ``output.weight``               ``model.layers.{n}.shared_head.head.weight``
                                              (of the embedding when the head is tied)
  ==========================================  ===============================================

  The copies are checked equal to the model's embedding and head at load and written at
  save (meshlm's modules share them). A model with ``mtp_depth`` below the folder's leaves the
  layers beyond it out (:meth:`MTPHF.dropped`). The MoE selection-bias rows of the modules'
  blocks follow the model's (``n_layers + k``, as ``model.n_blocks`` counts them).

No communication; no memory beyond the folder's tensor names (:func:`stored_depth`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .hf_arch import DEEPSEEK_V3
from .hf_arch import int_key as _int
from .hf_part import HFPart

if TYPE_CHECKING:
    from .config import ModelConfig

_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_MESHLM = re.compile(r"^mtp\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def stored_depth(keys: list[str], n_layers: int, declared: int) -> int:
    """How many of the ``declared`` multi-token prediction layers (decoder layer indices
    ``n_layers + k``) the tensor names ``keys`` hold: all or none (ValueError otherwise)."""
    held = [k for k in range(declared)
            if any(key.startswith(f"model.layers.{n_layers + k}.") for key in keys)]
    if held and held != list(range(declared)):
        raise ValueError(f"num_nextn_predict_layers={declared}: the folder holds the weights "
                         f"of multi-token prediction layers {[n_layers + k for k in held]} "
                         f"only")
    return len(held)


class MTPHF(HFPart):
    """Multi-token prediction's HF part (module docstring)."""

    name = "mtp"

    def export_arch(self, cfg: ModelConfig) -> str | None:
        return DEEPSEEK_V3 if cfg.mtp_depth else None

    def refuse_export(self, cfg: ModelConfig, arch: str) -> str | None:
        if cfg.mtp_depth and arch != DEEPSEEK_V3:
            return f"mtp_depth={cfg.mtp_depth}: only {DEEPSEEK_V3} stores multi-token prediction"
        return None

    def to_hf(self, cfg: ModelConfig, arch: str) -> dict[str, Any]:
        return {"num_nextn_predict_layers": cfg.mtp_depth} if arch == DEEPSEEK_V3 else {}

    def from_hf(self, d: Mapping[str, Any], arch: str,
                fields: Mapping[str, Any]) -> dict[str, Any]:
        if arch != DEEPSEEK_V3:
            return {}
        return {"mtp_depth": _int(d, "num_nextn_predict_layers", _int(d, "num_mtp_layers", 0))}

    def from_folder(self, fields: Mapping[str, Any], d: Mapping[str, Any], arch: str,
                    keys: Callable[[], list[str]]) -> dict[str, Any]:
        declared = int(fields.get("mtp_depth") or 0)
        if arch != DEEPSEEK_V3 or not declared:
            return {}
        try:
            names = keys()
        except (ValueError, OSError):
            return {}  # (the weights' reader reports the folder's problem)
        return {"mtp_depth": stored_depth(names, int(fields["n_layers"]), declared)}

    def block_of(self, cfg: ModelConfig, name: str) -> tuple[int, str] | None:
        m = _MESHLM.match(name)
        if m and m.group(2).startswith("block."):
            return cfg.n_layers + int(m.group(1)), m.group(2)[len("block."):]
        return None

    def key(self, cfg: ModelConfig, arch: str, name: str) -> str | None:
        m = _MESHLM.match(name)
        if m and arch == DEEPSEEK_V3 and m.group(2) in _NAMES:
            return f"model.layers.{cfg.n_layers + int(m.group(1))}.{_NAMES[m.group(2)]}"
        return None

    def copies(self, cfg: ModelConfig, arch: str, name: str) -> list[str]:
        if arch != DEEPSEEK_V3 or not cfg.mtp_depth:
            return []
        layers = [cfg.n_layers + k for k in range(cfg.mtp_depth)]
        out = []
        if name == "tok_embeddings.weight":
            out += [f"model.layers.{j}.embed_tokens.weight" for j in layers]
        if name == "output.weight" or (name == "tok_embeddings.weight" and cfg.tie_embeddings):
            out += [f"model.layers.{j}.shared_head.head.weight" for j in layers]
        return out

    def dropped(self, cfg: ModelConfig, arch: str, d: Mapping[str, Any] | None,
                key: str) -> bool:
        m = _HF_LAYER.match(key)
        if m is None or arch != DEEPSEEK_V3 or d is None:
            return False
        declared = d.get("num_nextn_predict_layers") or 0
        return cfg.n_layers + cfg.mtp_depth <= int(m.group(1)) < cfg.n_layers + declared


MTP_HF = MTPHF()

__all__ = ["MTPHF", "MTP_HF", "stored_depth"]
