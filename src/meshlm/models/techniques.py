"""The techniques that change a model's shape, listed once (torch-free).

Each is a module of its own that brings its config keys (a frozen dataclass whose fields are
``model.*`` keys, overriding the hooks of ``config.ModelShape`` it changes) and its cost as the
planner reads it:

- multi-head latent attention (``models/mla_cost.py``; the layer ``models/mla.py``): another
  attention layer, whose projections' cost registers in ``attention_cost.PROJECTIONS``;
- multi-token prediction (``models/mtp_cost.py``; the modules ``models/mtp.py``): extra blocks
  and head passes on the last pipeline stage, listed in :data:`HEADS`.

:data:`KEYS` are the bases of ``ModelConfig`` (its fields follow the core keys in this order's
reverse). Communication and memory: none.
"""

from __future__ import annotations

from .mla_cost import MLAKeys
from .mtp_cost import MTP, MTPKeys
from .technique import HeadCosts

KEYS: tuple[type, ...] = (MTPKeys, MLAKeys)
HEADS = HeadCosts((MTP,))

__all__ = ["HEADS", "KEYS"]
