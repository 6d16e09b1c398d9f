"""The extra training heads techniques add, listed once: importing this module registers each in
``heads.TRAINING_HEADS`` (``models/llama.py`` imports it).

- "mtp": multi-token prediction (DeepSeek-V3), ``models/mtp.py``; its loss and tensor-parallel
  plan are ``parallel/multi_token.py`` (listed in ``parallel/training_heads.py``), its cost
  ``models/mtp_cost.py``, its Hugging Face names ``models/mtp_hf.py``.

Communication and memory: none.
"""

from __future__ import annotations

from . import mtp  # noqa: F401  (registers "mtp")
