"""Checkpoints: sharded, layout-free training state on disk, and loading a plain model back."""

from .sharded import ShardedCheckpoint, validate
from .state import CheckpointError, find_latest, latest_valid, prune, step_dir

__all__ = ["CheckpointError", "ShardedCheckpoint", "find_latest", "latest_valid", "prune",
           "step_dir", "validate"]
