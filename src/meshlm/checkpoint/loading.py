"""``meshlm.load_model``: the plain single-process model from a run or checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.llama import Transformer
from .state import CheckpointError, find_latest, load_model_weights


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run dir, a ``checkpoints/`` dir or a ``step_*`` dir."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint path {str(p)!r} does not exist")
    if (p / "model.safetensors").is_file():
        return p
    for root in (p / "checkpoints", p):
        latest = find_latest(root)
        if latest is not None:
            return latest
    raise CheckpointError(f"no checkpoint found in {str(p)!r} (expected checkpoints/step_*)")


def load_model(path: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """Build the model described by the checkpoint's config.toml and load its weights."""
    from ..config import ConfigError, load_config

    ckpt = resolve_checkpoint(path)
    if not (ckpt / "config.toml").is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no config.toml")
    try:
        cfg = load_config(ckpt / "config.toml", check_paths=False)
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {ckpt}: {e}") from None
    vocab = _vocab_size(ckpt)
    model = Transformer(cfg.model_config(vocab_size=vocab))
    load_model_weights(model, ckpt / "model.safetensors")
    return model.to(device).eval()


def _vocab_size(ckpt: Path) -> int:
    from safetensors import SafetensorError, safe_open

    path = ckpt / "model.safetensors"
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_slice("tok_embeddings.weight").get_shape()[0]
    except (SafetensorError, OSError, KeyError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
