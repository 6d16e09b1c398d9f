"""Attention kernels as the planner sees them: torch-free descriptions, one per kernel.

The kernels themselves (:mod:`.attention`, torch) and these descriptions share names: a
kernel is registered in both places, and ``model.attention`` accepts exactly the names here, so
``meshlm plan`` and config validation never import torch.

What a description states, for one layer and micro-batch of ``b`` sequences of ``s`` tokens:

- ``mask_bytes(b, s, masked)``: the transient mask the kernel materialises when the attention is
  not plain causal (a sliding window or documents, ``masked``): ``sdpa`` and ``eager`` build a
  (b, s, s) boolean mask (b = 1 without documents), FlexAttention a block mask of
  ``b (s / block)^2`` int32 entries;
- ``score_fraction(s, window, doc_len, masked)``: the share of the full ``s x s`` score matrix
  the kernel computes -- the causal triangle (one half) for a fused causal kernel, every score
  for one given a boolean mask (``sdpa`` with a window or documents leaves the flash path: the
  masked kernels skip nothing), only the tiles the window and documents leave for a
  block-sparse kernel (FlexAttention skips fully masked ``block x block`` tiles);
- ``mask_per_layer``: each layer keeps its own mask for backward (``sdpa`` / ``eager``: the
  boolean mask is an input of the layer's attention) or one is shared by all (a cached block
  mask);
- ``materialises_scores``: the (b, nh, s, s) scores are held for backward (``eager``).

Communication: none. Memory: as stated per kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AttentionSpec:
    """One attention kernel's cost, as the planner reads it (see the module docstring)."""

    name: str
    doc: str
    materialises_scores: bool = False
    block: int = 0  # > 0: fully masked (block x block) tiles are skipped
    mask_entry_bytes: float = 1.0  # bytes per mask entry (bool: 1; a block mask: int32 per tile)
    compiled_only_fast: bool = False  # fused only under compilation (flex on CUDA)
    mask_per_layer: bool = True  # each layer saves its mask for backward
    notes: tuple[str, ...] = field(default_factory=tuple)

    def mask_bytes(self, b: int, s: int, masked: bool, documents: bool = False) -> float:
        """Bytes of the mask this kernel builds for a (b x s) micro-batch (0 when plain causal)."""
        if not masked:
            return 0.0
        rows = b if documents else 1
        if self.block:
            tiles = math.ceil(s / self.block)
            return rows * tiles * tiles * 4.0 * 2  # partial and full tile tables, int32
        return rows * s * s * self.mask_entry_bytes

    def score_fraction(self, s: int, window: int = 0, doc_len: float = 0.0,
                       masked: bool = False) -> float:
        """Share of the s x s scores computed (forward; backward in proportion)."""
        if not self.block:
            return 1.0 if masked else 0.5  # a boolean mask: every score; causal: the triangle
        return visible_tile_fraction(s, window, doc_len, self.block)


def visible_fraction(s: int, window: int = 0, doc_len: float = 0.0) -> float:
    """Share of the s x s (query, key) pairs a query may see: causal, within ``window`` (0:
    no window) and inside documents of ``doc_len`` tokens (0: one document)."""
    reach = float(s)
    if window:
        reach = min(reach, window)
    if doc_len:
        reach = min(reach, doc_len)
    # causal pairs within distance < reach: sum over rows of min(i + 1, reach)
    pairs = reach * (reach + 1) / 2 + max(0.0, s - reach) * reach
    return pairs / (s * s)


def visible_tile_fraction(s: int, window: int, doc_len: float, block: int) -> float:
    """Share of the s x s scores in tiles of ``block`` that hold at least one visible pair:
    a tile on the diagonal band of width ``reach`` is computed whole."""
    reach = float(s)
    if window:
        reach = min(reach, window)
    if doc_len:
        reach = min(reach, doc_len)
    tiles = math.ceil(s / block)
    band = min(tiles, math.ceil((reach - 1) / block) + 1)  # diagonal tiles per row of tiles
    computed = sum(min(i + 1, band) for i in range(tiles))
    return computed * block * block / (tiles * block) ** 2


SPECS: dict[str, AttentionSpec] = {}


def register_spec(spec: AttentionSpec) -> AttentionSpec:
    if spec.name in SPECS:
        raise ValueError(f"attention kernel {spec.name!r} is described twice")
    SPECS[spec.name] = spec
    return spec


def spec(name: str) -> AttentionSpec:
    if name not in SPECS:
        raise ValueError(f"attention kernel {name!r} is not one of {', '.join(SPECS)}")
    return SPECS[name]


register_spec(AttentionSpec(
    "sdpa", "torch's scaled_dot_product_attention: fused (flash) when plain causal; a "
    "(B, 1, S, S) boolean mask with a sliding window or documents"))
register_spec(AttentionSpec(
    "eager", "softmax(q k^T) v written out: (B, nh, S, S) scores materialised (a reference)",
    materialises_scores=True))

# Further kernels describe themselves in modules of their own, registered when
# ``models/config.py`` (which every models module loads first) imports them.

__all__ = ["SPECS", "AttentionSpec", "register_spec", "spec", "visible_fraction",
           "visible_tile_fraction"]
