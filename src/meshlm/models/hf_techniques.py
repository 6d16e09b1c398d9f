"""The techniques with a share of the Hugging Face mapping, listed once (torch-free).

Each is an :class:`~meshlm.models.hf_part.HFPart` in a module of its own:

- multi-head latent attention (``models/mla_hf.py``): DeepSeek-V3's attention keys, its
  projections' names and the order of its rotary rows;
- multi-token prediction (``models/mtp_hf.py``): DeepSeek-V3's extra stored layers, their
  names, copies of the embedding and head, and the layers a model may leave out.

``models/hf_config.py``, ``checkpoint/hf_names.py`` and ``checkpoint/hf.py`` loop over
:data:`PARTS` in this order. Communication and memory: none.
"""

from __future__ import annotations

from .hf_part import HFPart
from .mla_hf import MLA_HF
from .mtp_hf import MTP_HF

PARTS: tuple[HFPart, ...] = (MLA_HF, MTP_HF)

__all__ = ["PARTS"]
