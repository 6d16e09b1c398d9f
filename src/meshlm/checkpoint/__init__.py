"""Checkpoints: sharded, layout-free training state on disk, and loading a plain model back.

``ShardedCheckpoint``, ``validate`` and ``latest_valid`` (torch, safetensors) are imported on
first use; the directory rules (``CheckpointError``, ``find_latest``, ...) without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .state import CheckpointError, find_latest, prune, step_dir

_LAZY = {"ShardedCheckpoint": ".sharded", "latest_valid": ".sharded", "validate": ".sharded"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CheckpointError", "ShardedCheckpoint", "find_latest", "latest_valid", "prune",
           "step_dir", "validate"]
