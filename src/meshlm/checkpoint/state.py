"""Save and restore the whole training state of a single-process run.

Layout of ``checkpoints/step_NNNNNNN/``:

- ``model.safetensors``  fp32 weights under the plain model's names (a tied head is stored once)
- ``optimizer.pt``       AdamW state (fp32 moments) and the grad-scaler state
- ``trainer.json``       step, sampler state, tokens seen
- ``rng.pt``             torch / numpy / python RNG states
- ``config.toml``        the run's resolved config; ``tokenizer.json`` the run's tokenizer

A checkpoint is written into ``step_NNNNNNN.tmp`` and renamed when complete, so an interrupted
save never leaves a directory that looks valid; a directory missing a file is reported, not
half-loaded. Disk: 12 bytes per parameter (weights + two Adam moments).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..models.weights import check_weights

REQUIRED = ("model.safetensors", "optimizer.pt", "trainer.json", "rng.pt", "config.toml")
_STEP_DIR = re.compile(r"^step_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A missing, incomplete or incompatible checkpoint; one line for the terminal."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def find_latest(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (None if there is none)."""
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    ]
    return max(found)[1] if found else None


def load_model_weights(model: nn.Module, path: Path) -> None:
    """Copy weights from a ``model.safetensors`` file into ``model``, checking names and shapes."""
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    params = dict(model.named_parameters())
    tied = ("output.weight",) if getattr(getattr(model, "cfg", None), "tie_embeddings", False) else ()
    try:
        check_weights({n: tuple(p.shape) for n, p in params.items()}, tensors, tied)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)


def save_state(
    directory: Path,
    weights: dict[str, torch.Tensor],
    optim_state: dict[str, Any],
    trainer_state: dict[str, Any],
    extra_files: dict[str, Path | str],
    scaler_state: dict | None = None,
) -> Path:
    """Write a complete checkpoint atomically to ``directory`` (a ``step_NNNNNNN`` path).

    ``weights`` are full tensors under the plain model's names (each tied tensor once) and
    ``optim_state`` is a one-process AdamW state dict: the format is the same for every layout.
    """
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().float().contiguous().cpu() for k, v in weights.items()},
              str(tmp / "model.safetensors"))
    torch.save({"optimizer": optim_state, "scaler": scaler_state or {}}, tmp / "optimizer.pt")
    (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=1))
    torch.save(
        {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        tmp / "rng.pt",
    )
    for name, src in extra_files.items():
        if isinstance(src, Path):
            shutil.copyfile(src, tmp / name)
        else:
            (tmp / name).write_text(src)
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory


def check_complete(directory: Path) -> None:
    missing = [f for f in REQUIRED if not (directory / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)}")


def load_state(directory: Path) -> dict[str, Any]:
    """Everything in a checkpoint: ``weights``, ``optimizer``, ``scaler``, ``trainer``, ``rng``."""
    check_complete(directory)
    path = directory / "model.safetensors"
    try:
        weights = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    try:
        opt = torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=False)
        rng = torch.load(directory / "rng.pt", map_location="cpu", weights_only=False)
        trainer_state = json.loads((directory / "trainer.json").read_text())
    except Exception as e:  # any corruption of these files is the same user-facing problem
        raise CheckpointError(f"checkpoint {directory} is corrupt: {type(e).__name__}: {e}") from None
    return {"weights": weights, "optimizer": opt["optimizer"], "scaler": opt.get("scaler", {}),
            "trainer": trainer_state, "rng": rng}


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
