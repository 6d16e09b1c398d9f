"""Flat buffers of parameters: the layout shared by DDP buckets and ZeRO shards.

A :class:`FlatGroup` lays a list of parameters end to end in one 1-D buffer, padded to a
multiple of the shard group's size ``n`` (the data-parallel size, or ``dp_shard`` under hybrid
sharding) so it splits into ``n`` equal shards; rank r owns
elements ``[r S, (r + 1) S)`` with ``S = padded / n``. A shard generally cuts through
parameters, so the optimizer sees it as *pieces*: one tensor per (parameter, shard) overlap,
each a view of the shard, tagged with the parameter's weight-decay group. AdamW is element-wise,
so stepping the pieces is exactly stepping the parameters.

Memory: the padding is at most ``n - 1`` elements per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..distributed.mesh import without_sharded
from ..distributed.spec import spec_of, update_spec


@dataclass
class Piece:
    """The part ``[lo, hi)`` (flat-buffer coordinates) of parameter ``index`` in one shard."""

    index: int  # position of the parameter in FlatGroup.params
    lo: int
    hi: int


@dataclass
class FlatGroup:
    """Parameters laid out in a flat, padded buffer, sharded ``n`` ways."""

    params: list[nn.Parameter]
    names: list[str]
    n_shards: int
    axis: str = "dp"  # the mesh axis the shards are spread over (dp, dp_cp, dp_shard, ...)
    offsets: list[int] = field(init=False)
    shapes: list[torch.Size] = field(init=False)  # recorded now: ZeRO-3 later frees the data
    numel: int = field(init=False)  # unpadded
    padded: int = field(init=False)

    def __post_init__(self) -> None:
        self.offsets, self.shapes, total = [], [], 0
        for p in self.params:
            self.offsets.append(total)
            self.shapes.append(p.shape)
            total += p.numel()
        self.numel = total
        self.padded = -(-total // self.n_shards) * self.n_shards

    @property
    def shard_size(self) -> int:
        return self.padded // self.n_shards

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def span(self, i: int) -> tuple[int, int]:
        return self.offsets[i], self.offsets[i] + self.shapes[i].numel()

    def pieces(self, rank: int) -> list[Piece]:
        """Overlaps of rank's shard with each parameter, in buffer order."""
        lo, hi = self.shard_range(rank)
        out = []
        for i in range(len(self.params)):
            a, b = self.span(i)
            if a < hi and b > lo:
                out.append(Piece(i, max(a, lo), min(b, hi)))
        return out

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """One padded flat buffer holding ``tensors`` (one per parameter) end to end."""
        if not tensors:
            return torch.zeros(self.padded, dtype=dtype or torch.float32)
        ref = tensors[0]
        out = torch.zeros(self.padded, dtype=dtype or ref.dtype, device=ref.device)
        for i, t in enumerate(tensors):
            a, b = self.span(i)
            out[a:b].copy_(t.reshape(-1))
        return out

    def own(self, rank: int) -> None:
        """Record in each parameter's shard spec the flat range rank's shard owns of it."""
        lo, hi = self.shard_range(rank)
        for i, p in enumerate(self.params):
            a, b = self.span(i)
            mine = (min(max(lo - a, 0), b - a), min(max(hi - a, 0), b - a))
            # (sharded over dp_shard under hybrid sharding, the copies left are on dp_rep)
            update_spec(p, flat=mine, replicated=without_sharded(spec_of(p).replicated,
                                                                 self.axis))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (original shapes) into a flat buffer of this layout."""
        return [flat[self.span(i)[0] : self.span(i)[1]].view(shape)
                for i, shape in enumerate(self.shapes)]


def unique_trainable(named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """Parameters that need gradients, each once (a tied weight keeps its first name)."""
    seen: set[int] = set()
    out = []
    for name, p in named:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def split_by_size(named: list[tuple[str, nn.Parameter]], cap_bytes: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive groups of parameters of at most ``cap_bytes`` each (a bigger one alone)."""
    groups: list[list[tuple[str, nn.Parameter]]] = [[]]
    size = 0
    for name, p in named:
        nbytes = p.numel() * p.element_size()
        if groups[-1] and size + nbytes > cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += nbytes
    return [g for g in groups if g]
