"""Where a parameter lives: one :class:`ShardSpec` per parameter, set by the techniques that shard it.

Every parameter of a parallelised model carries a spec (``spec_of(p)``). The spec starts as "the
whole tensor, replicated on every data axis" (:func:`attach_specs`); each technique updates it
when it applies itself -- tensor parallelism shards a dimension over ``tp``, the pipeline marks
tied embedding copies, a ZeRO engine records which flat range of the tensor this rank's
optimizer owns. Clipping, the data-parallel engines, checkpoints and initialisation read the
spec and nothing else, so a new technique adds a placement, not a flag.

A rank *owns* the elements of the global tensor that lie inside its slice (``offsets`` +
``shape``, clipped to ``global_shape``: a padded vocabulary overhangs it) and, when ``flat`` is
set, inside that range of the flattened local tensor. Copies on ``replicated`` axes are
identical, so a norm counts each of them ``1 / copies`` (:meth:`ShardSpec.norm_weight`).

No communication; memory: a few small tuples per parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..layout import AXES
from .mesh import Mesh, covered_dims

ATTR = "_meshlm_spec"


@dataclass(frozen=True)
class ShardSpec:
    """Placement of one parameter on the mesh (see module docstring)."""

    name: str  # name of the global tensor in the one-process model (checkpoint key)
    global_shape: tuple[int, ...]
    shape: tuple[int, ...]  # this rank's tensor (may overhang global_shape: padding)
    offsets: tuple[int, ...]  # start of this rank's slice in each dim of the global tensor
    shards: tuple[tuple[str, int], ...] = ()  # (axis, dim) pairs that split it
    replicated: tuple[str, ...] = ()  # axes holding identical copies
    tied_axis: str | None = None  # axis whose copies' gradients are summed (tied embeddings)
    reduce_axis: str = "dp"  # gradients are averaged over this axis (the engine's group; dp_cp)
    flat: tuple[int, int] | None = None  # [lo, hi) of the flattened tensor this rank's optimizer owns

    def shard(self, axis: str, dim: int, rank: int, size: int, padded: int | None = None
              ) -> ShardSpec:
        """This spec split ``size`` ways along ``dim`` over ``axis``; rank ``rank``'s part.

        ``padded``: the dimension is first padded to that length (a multiple of ``size``).
        """
        length = padded if padded is not None else self.shape[dim]
        if length % size:
            raise ValueError(f"{self.name}: dim {dim} of size {length} does not split {size} ways")
        per = length // size
        shape = list(self.shape)
        shape[dim] = per
        offsets = list(self.offsets)
        offsets[dim] += rank * per
        return replace(self, shape=tuple(shape), offsets=tuple(offsets),
                       shards=(*self.shards, (axis, dim)),
                       replicated=tuple(a for a in self.replicated if a != axis))

    def norm_weight(self, mesh: Mesh, axes: tuple[str, ...] | None = None) -> float:
        """Share of this copy in a global norm: 1 / number of identical copies -- counting only
        copies on ``axes`` (those the squared sums are added over; default: every axis)."""
        # (by grid dimension: the tied embedding's copies sit on two pp ranks, an expert's on
        # the dp x cp ranks of one ep rank, a hybrid shard's on the dp replicas)
        over = None if axes is None else {x for a in axes for x in covered_dims(a)}
        return 1.0 / math.prod(mesh.size(a) for a in self.replicated
                               if over is None or covered_dims(a) & over)

    def valid(self) -> tuple[slice, ...]:
        """Slices of the local tensor that lie inside the global one (padding excluded)."""
        return tuple(slice(0, max(0, min(n, g - o)))
                     for n, g, o in zip(self.shape, self.global_shape, self.offsets, strict=True))

    def global_slices(self) -> tuple[slice, ...]:
        """Where the valid part of the local tensor sits in the global tensor."""
        return tuple(slice(o, o + s.stop) for o, s in zip(self.offsets, self.valid(), strict=True))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's tensor cut from the global one (zero where it overhangs: padding)."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"{self.name}: shape {tuple(full.shape)}, expected "
                             f"{self.global_shape}")
        if self.shape == self.global_shape:
            return full
        out = full.new_zeros(self.shape)
        out[self.valid()] = full[self.global_slices()]
        return out


def first_copy(spec: ShardSpec, mesh: Mesh) -> bool:
    """Whether this rank holds the first of the identical copies of its range (coordinate 0 of
    every axis holding copies): the one a checkpoint writes and a norm counts once."""
    return all(mesh.local_rank(a) == 0 for a in spec.replicated)


def spec_of(p: torch.Tensor) -> ShardSpec:
    spec = getattr(p, ATTR, None)
    if spec is None:
        raise KeyError("parameter has no shard spec (was attach_specs called?)")
    return spec


def set_spec(p: torch.Tensor, spec: ShardSpec) -> None:
    setattr(p, ATTR, spec)


def update_spec(p: torch.Tensor, **changes: object) -> ShardSpec:
    spec = replace(spec_of(p), **changes)
    set_spec(p, spec)
    return spec


def attach_specs(model: nn.Module, mesh: Mesh) -> None:
    """Give every parameter the spec of a whole tensor, replicated on dp, cp and tp.

    Names are the one-process model's; a tied parameter gets one spec (its first name).
    Gradients are averaged over dp, or over dp x cp together (``dp_cp``) when cp > 1: each cp
    rank's gradient is that of its share of the tokens.
    """
    replicated = tuple(a for a in AXES if a != "pp" and mesh.size(a) > 1)
    reduce_axis = "dp_cp" if mesh.size("cp") > 1 else "dp"
    for name, p in model.named_parameters():
        if getattr(p, ATTR, None) is None:
            shape = tuple(p.shape)
            set_spec(p, ShardSpec(name, shape, shape, (0,) * len(shape), replicated=replicated,
                                  reduce_axis=reduce_axis))


def norm_axes(specs: list[ShardSpec], mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes over which the squared-gradient sums of a global norm must be added.

    Every axis of size > 1 except those on which every parameter is replicated (dp under DDP,
    cp): there each rank already holds the whole sum. Mesh order, so every rank agrees; dp and
    cp together become their joint axis ``dp_cp`` (one all-reduce instead of two).
    """
    axes = tuple(a for a in AXES if mesh.size(a) > 1
                 and not all(a in s.replicated for s in specs))
    if "dp" in axes and "cp" in axes:
        axes = tuple("dp_cp" if a == "dp" else a for a in axes if a != "cp")
    return axes


@dataclass
class ParamGroup:
    """Parameters whose gradients an engine averages over one mesh axis."""

    axis: str
    named: list[tuple[str, nn.Parameter]] = field(default_factory=list)


def reduction_groups(named: list[tuple[str, nn.Parameter]]) -> list[ParamGroup]:
    """Parameters split by their spec's ``reduce_axis`` (first-seen order of axes kept)."""
    groups: dict[str, ParamGroup] = {}
    for name, p in named:
        axis = spec_of(p).reduce_axis
        groups.setdefault(axis, ParamGroup(axis)).named.append((name, p))
    return list(groups.values())
