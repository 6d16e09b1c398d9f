"""The block maths of ring attention, now beside the kernels it serves
(:mod:`meshlm.models.attention_blocks`); kept importable here."""

from ..models.attention_blocks import block_backward, block_forward, merge

__all__ = ["block_backward", "block_forward", "merge"]
