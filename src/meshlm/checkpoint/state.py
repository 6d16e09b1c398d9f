"""Checkpoint directories: names, finding the latest, pruning, and the one-line error type.

A run keeps its checkpoints as ``checkpoints/step_NNNNNNN/`` (see :mod:`.sharded` for what is
inside). A directory is written as ``step_NNNNNNN.tmp`` and renamed only when every rank has
finished, so a name without ``.tmp`` is a complete checkpoint or a damaged one (a file lost or
truncated afterwards) -- never a half-written one. No communication; no memory to speak of.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

_STEP_DIR = re.compile(r"^step_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A missing, damaged or incompatible checkpoint; one line for the terminal."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, oldest first (``.tmp`` ones excluded)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def find_latest(root: Path) -> Path | None:
    """The checkpoint with the highest step under ``root`` (None if there is none)."""
    found = checkpoints(root)
    return found[-1] if found else None


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (keep = 0: keep all); returns the deleted."""
    found = checkpoints(root)
    gone = found[:-keep] if keep and len(found) > keep else []
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def remove_partial(root: Path) -> None:
    """Delete ``step_*.tmp`` directories left by an interrupted save."""
    if root.is_dir():
        for p in root.glob("step_*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
