"""Plain single-device models: the dense Llama-style decoder and its MoE variant.

The names are imported on first use: the shapes (``ModelConfig``, ``PRESETS``) without torch,
so configuration checks and the planner start without it.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import ModelConfig
from .presets import PRESETS, get_preset

_LAZY = {"Transformer": ".llama", "build_model": ".llama", "init_weights": ".llama"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model", "get_preset", "init_weights"]
