"""Name and shape checks for weights loaded into a model, shared by every loader."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def check_weights(expected: Mapping[str, tuple[int, ...]], weights: Mapping[str, torch.Tensor],
                  ignore_missing: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming the first mismatch between ``weights`` and the expected shapes.

    ``ignore_missing``: names that may be absent (a tied head stored once under its embedding).
    """
    missing = sorted(n for n in expected if n not in weights and n not in ignore_missing)
    unexpected = sorted(n for n in weights if n not in expected)
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    for name, t in weights.items():
        if tuple(t.shape) != tuple(expected[name]):
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)}, model "
                             f"{tuple(expected[name])}")
