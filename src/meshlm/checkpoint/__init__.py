"""Checkpoints: whole training state on disk, and loading a plain model back."""

from .state import CheckpointError, find_latest, load_state, save_state

__all__ = ["CheckpointError", "find_latest", "load_state", "save_state"]
