"""Where parameter values come from: one protocol for initial values, checkpoints and HF folders.

A :class:`TensorSource` answers "the values of global tensor ``name`` inside ``box``" -- ``name``
is the one-process model's parameter name (a tied head is stored once, as
``tok_embeddings.weight``) and ``box`` a tuple of slices of the global tensor. Construction,
resuming and importing ask a source for exactly the part of each parameter a rank holds
(:func:`read_local`), so no rank ever reads more than its shards -- plus, for initial values,
one global parameter at a time (its generator cannot skip ahead).

:func:`local_pieces` maps a flat range of a rank's local tensor (a ZeRO shard's part, or the
whole tensor) to boxes of the global tensor, leaving out vocabulary padding: the unit in which
checkpoints are written and read.

No communication; memory: the requested range (+ one global tensor for :class:`InitSource`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..models.config import ModelConfig
from ..models.llama import initial_value
from .boxes import Box, box_shape, flat_boxes, intersect, shift
from .spec import ShardSpec


class TensorSource(Protocol):
    """Values of global tensors by name (see module docstring)."""

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Global shape of ``name``; None when the source does not hold it."""

    def read(self, name: str, box: Box) -> torch.Tensor:
        """fp32 values of ``name`` inside ``box`` (a tensor of the box's shape)."""


class InitSource:
    """The seed's initial values: each global tensor drawn from (seed, name), then cut.

    The last drawn tensor is cached, so a rank reading several boxes of one parameter draws it
    once; :meth:`release` frees it.
    """

    def __init__(self, cfg: ModelConfig, seed: int, shapes: dict[str, tuple[int, ...]]) -> None:
        self.cfg, self.seed, self.shapes = cfg, seed, shapes
        self._last: tuple[str, torch.Tensor] | None = None

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.shapes.get(name)

    def read(self, name: str, box: Box) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = None  # (free the previous tensor before drawing the next)
            self._last = (name, initial_value(self.cfg, name, self.shapes[name], self.seed))
        return self._last[1][box]

    def release(self) -> None:
        self._last = None


@dataclass(frozen=True)
class Piece:
    """Part of a flat range of a local tensor that lies inside the global tensor.

    ``flat[start - lo : end - lo].view(run)[rel]`` holds the values of ``box`` (global coords).
    """

    box: Box  # in the global tensor
    start: int
    end: int
    run: tuple[int, ...]  # shape of the contiguous run [start, end)
    rel: Box  # the valid part inside the run

    def of(self, flat: torch.Tensor, lo: int) -> torch.Tensor:
        return flat[self.start - lo : self.end - lo].view(self.run)[self.rel]


def local_pieces(spec: ShardSpec, lo: int, hi: int) -> list[Piece]:
    """The global boxes held by the flat range ``[lo, hi)`` of a rank's local tensor."""
    valid = tuple(slice(0, s.stop) for s in spec.valid())
    out = []
    for run_box, s, e in flat_boxes(spec.shape, lo, hi):
        inside = intersect(run_box, valid)
        if inside is None:
            continue  # all padding
        rel = shift(inside, tuple(-r.start for r in run_box))
        out.append(Piece(shift(inside, spec.offsets), s, e, box_shape(run_box), rel))
    return out


def read_local(source: TensorSource, spec: ShardSpec, lo: int, hi: int,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The flat range ``[lo, hi)`` of this rank's local tensor, read from ``source`` (fp32;
    zero where the local tensor overhangs the global one)."""
    out = torch.zeros(hi - lo, dtype=torch.float32, device=device)
    for piece in local_pieces(spec, lo, hi):
        piece.of(out, lo).copy_(source.read(spec.name, piece.box))
    return out


def assign(p: nn.Parameter, values: torch.Tensor) -> None:
    """Give parameter ``p`` the tensor ``values`` in place, also when ``p`` is on the meta device
    (its tensor is swapped: every module holding ``p`` and its shard spec keep seeing it)."""
    if not p.is_meta:
        p.data = values
        return
    attrs = dict(p.__dict__)
    torch.utils.swap_tensors(p, nn.Parameter(values, requires_grad=p.requires_grad))
    p.__dict__.update(attrs)
