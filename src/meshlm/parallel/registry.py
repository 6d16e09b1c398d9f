"""Named choices of how a model runs: name -> factory, one small registry per kind.

- ``ATTENTION``: attention kernels, name -> kernel class (``models/attention.py``: the one
  list; ``model.attention`` names one; context parallelism composes around it);
- ``RECOMPUTE``: activation recomputation, name -> its plan (``recompute.py``): ``none``,
  ``selective``, ``op``, ``full``;
- ``PRECISION``: how a model computes, name -> :class:`PrecisionChoice`: ``fp32``, ``bf16``,
  ``fp16`` (an autocast dtype, ``meshlm.precision.DTYPES``), ``fp8`` (the decoder blocks'
  linears in float8, ``float8.py``; the rest in ``precision.fp8_rest``).

The modules that define a choice register it when imported; ``extensions.apply_choices`` is the
one place that looks them up and applies them. Communication and memory: none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from ..models.attention import ATTENTION
from ..precision import DTYPES

T = TypeVar("T")


class Registry(Generic[T]):
    """Choices of one kind by name, in registration order."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = item
        return item

    def __getitem__(self, name: str) -> T:
        if name not in self._items:
            raise ValueError(f"{self.kind} {name!r} is not one of {', '.join(self._items)}")
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)


RECOMPUTE: Registry[object] = Registry("recompute mode")  # filled by recompute.py



@dataclass(frozen=True)
class PrecisionChoice:
    """``dtype``: the autocast compute dtype (None: ``precision.fp8_rest``); ``float8``: the
    decoder blocks' linear layers compute in float8 (``float8.py``)."""

    dtype: torch.dtype | None
    float8: bool = False


PRECISION: Registry[PrecisionChoice] = Registry("precision")
for _name, _dtype in DTYPES.items():
    PRECISION.register(_name, PrecisionChoice(_dtype))
PRECISION.register("fp8", PrecisionChoice(None, float8=True))

__all__ = ["ATTENTION", "PRECISION", "RECOMPUTE", "PrecisionChoice", "Registry"]
