"""Named choices of how a model runs: name -> factory, one small registry per kind.

- ``ATTENTION``: attention kernels, name -> kernel class (``models/attention.py``: the one
  list; ``model.attention`` names one; context parallelism composes around it);
- ``RECOMPUTE``: activation recomputation, name -> its plan (``recompute.py``): ``none``,
  ``selective``, ``op``, ``full``;
- ``PRECISION``: how a model computes, name -> :class:`PrecisionChoice`: ``fp32``, ``bf16``,
  ``fp16`` (an autocast dtype, ``meshlm.precision.DTYPES``), ``fp8`` (the decoder blocks'
  linears in float8, ``float8.py``; the rest in ``precision.fp8_rest``). A precision that
  changes the model's modules names a :class:`ModelConverter` (torchtitan's model converters):
  ``parallelize`` converts the plain model with it before any parallelism is applied.

The modules that define a choice register it when imported; ``extensions.apply_choices`` is the
one place that looks them up and applies them. Communication and memory: none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch
from torch import nn

from ..models.attention import ATTENTION
from ..precision import DTYPES

if TYPE_CHECKING:
    from ..distributed.comm import Comm

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


class ModelConverter(Protocol):
    """Swaps modules of a plain model for others holding the same parameters (names, state
    dict and shard specs unchanged), before any parallelism is applied: tensor parallelism
    then shards them as it shards the modules they replace.

    ``convert`` is idempotent (a module already converted alike is kept) and ``revert`` gives
    the plain modules back. A converted module whose numerics span the shards of its operands
    has ``bind_shards(comm, token_axes)`` (:func:`bind_shards`), called by
    ``extensions.apply_choices``, which ``parallelize`` runs once every technique that shards
    weights or tokens has been applied (``token_axes``: the axes that split the tokens, cp).
    Communication and memory: none (the converted modules state theirs)."""

    def convert(self, model: nn.Module) -> None: ...

    def revert(self, model: nn.Module) -> None: ...


def bind_shards(model: nn.Module, comm: Comm | None) -> None:
    """Tell every module of ``model`` that has ``bind_shards`` how its operands are sharded
    (its parameters' shard specs, and the token axes of ``comm``); no-op with no ``comm``."""
    if comm is None:
        return
    token_axes = ("cp",) if comm.size("cp") > 1 else ()
    for mod in model.modules():
        bind = getattr(mod, "bind_shards", None)
        if callable(bind):
            bind(comm, token_axes)


@dataclass(frozen=True)
class PrecisionChoice:
    """``dtype``: the autocast compute dtype (None: ``precision.fp8_rest``); ``converter``:
    the model converter of the precision's ``recipe`` (None: the model is left as it is)."""

    dtype: torch.dtype | None
    converter: Callable[[str], ModelConverter] | None = None

    @property
    def float8(self) -> bool:
        """Whether the precision converts the model (fp8: its decoder blocks' linears to
        float8 linears)."""
        return self.converter is not None


def _float8(recipe: str) -> ModelConverter:
    from .float8 import Float8Converter  # (torchao is imported only when fp8 is used)

    return Float8Converter(recipe)


PRECISION: Registry[PrecisionChoice] = Registry("precision")
for _name, _dtype in DTYPES.items():
    PRECISION.register(_name, PrecisionChoice(_dtype))
PRECISION.register("fp8", PrecisionChoice(None, converter=_float8))

__all__ = ["ATTENTION", "PRECISION", "RECOMPUTE", "ModelConverter", "PrecisionChoice",
           "Registry", "bind_shards"]
