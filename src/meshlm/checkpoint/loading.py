"""``meshlm.load_model``: the plain one-process model from a checkpoint or a Hugging Face folder.

Accepts a run directory, its ``checkpoints/`` directory, one ``step_*`` checkpoint or a Hugging
Face folder (Llama, Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3: ``checkpoint/hf.py``). The model
is built on the meta device and each parameter is read once from the sharded files (or the HF
safetensors): peak memory is the model plus one tensor.
Nothing is unpickled. No communication.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..distributed.source import TensorSource
from ..distributed.spec import ShardSpec, set_spec
from ..models.config import ModelConfig
from ..models.hf_config import is_hf_folder
from ..models.llama import Transformer, build_model
from ..parallel import materialize
from .sharded import INDEX, ShardedCheckpoint, check_model, latest_valid
from .state import CheckpointError


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run dir, a ``checkpoints/`` dir or a ``step_*`` dir (the
    newest valid one; a damaged newer one is reported on stderr and skipped)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint path {str(p)!r} does not exist")
    if (p / INDEX).is_file():
        return p
    damaged: list[str] = []
    for root in (p / "checkpoints", p):
        latest = latest_valid(root, log=damaged.append)
        if latest is not None:
            for line in damaged:
                print(f"meshlm: {line}", file=sys.stderr)
            return latest
    if damaged:
        raise CheckpointError(damaged[0].split("; ")[0])
    raise CheckpointError(f"no complete checkpoint found in {str(p)!r} (expected "
                          "checkpoints/step_*/index.json)")


def checkpoint_model_config(ckpt: ShardedCheckpoint) -> ModelConfig:
    """The model shape of a checkpoint: recorded in trainer.json (else its config.toml, with
    the vocabulary of the stored embedding)."""
    from ..config import ConfigError, load_config

    recorded = ckpt.trainer.get("model")
    if isinstance(recorded, dict):
        try:
            return ModelConfig(**recorded)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{ckpt.directory / 'trainer.json'}: model: {e}") from None
    try:
        cfg = load_config(ckpt.directory / "config.toml", check_paths=False)
        vocab = ckpt.shapes["tok_embeddings.weight"][0]
        return cfg.model_config(vocab_size=vocab)
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"checkpoint {ckpt.directory}: {e}") from None


def model_from_source(cfg: ModelConfig, source: TensorSource,
                      device: str | torch.device = "cpu") -> Transformer:
    """A one-process model whose every parameter is read whole from ``source``."""
    model = build_model(cfg, device="meta")
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        set_spec(p, ShardSpec(name, shape, shape, (0,) * len(shape)))
    materialize(model, source, torch.device(device))
    return model


def load_model(path: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """The model of a checkpoint (see module docstring), in eval mode."""
    p = Path(path).expanduser()
    if p.is_dir() and is_hf_folder(p):
        from .hf import HFSource

        with HFSource(p) as src:
            model = model_from_source(src.model_config(), src, device).eval()
            model.set_expert_biases(src.expert_biases())  # (DeepSeek-V3's)
            return model
    with ShardedCheckpoint(resolve_checkpoint(p)) as ckpt:
        cfg = checkpoint_model_config(ckpt)
        expected = {n: tuple(q.shape) for n, q in build_model(cfg, device="meta").named_parameters()}
        check_model(ckpt, expected)
        model = model_from_source(cfg, ckpt.source("weight"), device).eval()
        model.set_expert_biases(ckpt.trainer.get("moe_bias"))  # auxiliary-loss-free routing
        return model
