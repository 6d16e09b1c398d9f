"""FlexAttention as the planner sees it (torch-free; the kernel is :mod:`.flex_attention`).

A block mask instead of a boolean one: for each (query tile, key tile) of ``BLOCK x BLOCK``
two int32 tables say whether the tile is empty (skipped), full or partial -- ``B (S/BLOCK)^2``
entries per table, against the ``B S^2`` bytes of the boolean mask ``sdpa`` builds for a
sliding window or documents. Only tiles holding a visible pair are computed, so a window or
short documents cut the attention FLOPs (the tile-rounded band of
:func:`~.attention_spec.visible_tile_fraction`); plain causal attention computes the diagonal
tiles whole, as a causal flash kernel does. Fused only when compiled (on CUDA).

Communication: none. Memory: the block mask; no scores held between forward and backward.
"""

from __future__ import annotations

from .attention_spec import AttentionSpec, register_spec

BLOCK = 128  # flex_attention's default tile (torch.nn.attention.flex_attention)

FLEX = register_spec(AttentionSpec(
    "flex", "torch's FlexAttention with a block mask: fully masked tiles skipped, no "
    "(B, S, S) mask (CPU: torch's eager path forward, meshlm's tiled backward)",
    block=BLOCK, compiled_only_fast=True, mask_per_layer=False))
