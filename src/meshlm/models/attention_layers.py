"""The attention layers techniques add, listed once: importing this module registers each in
``layers.ATTENTION_LAYERS`` (``models/llama.py`` imports it; ``Attention`` registers itself
there as "gqa").

- "mla": multi-head latent attention (DeepSeek-V2/V3), ``models/mla.py``; its tensor-parallel
  plan is ``parallel/mla_tp.py`` (listed in ``parallel/attention_plans.py``), its cost
  ``models/mla_cost.py``.

Communication and memory: none.
"""

from __future__ import annotations

from . import mla  # noqa: F401  (registers "mla")
