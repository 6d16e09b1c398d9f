"""The tensor-parallel plans of the attention layers techniques add, listed once: importing
this module registers each in ``tensor.ATTENTION_PLANS`` under its layer's name
(``layers.ATTENTION_LAYERS``; ``parallel/tensor.py`` imports it when it shards a model, and
holds grouped-query attention's plan, "gqa", itself).

- "mla": multi-head latent attention, ``parallel/mla_tp.py``.

Communication and memory: none (each plan states its own).
"""

from __future__ import annotations

from . import mla_tp  # noqa: F401  (registers "mla")
