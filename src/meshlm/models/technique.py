"""Extra training heads as the planner composes them (torch-free): the sum of the registered
heads' costs (``models/techniques.py`` lists them).

A training head is a technique that runs after the main model on the last pipeline stage:
more decoder blocks, more passes of the LM head and the loss, lookups of the shared
embedding, linears and norms of its own. Each head describes itself with the methods below
(per model config ``c`` and tensor-parallel degree ``t``); :class:`HeadCosts` adds them up, so
``planner/memory.py``, ``planner/timing.py`` and ``parallel/tensor_cost.py`` read one object
and name no head. A model without heads gets nothing: no blocks, one head pass (the main
model's), no lookups, norms, linears, parameters, saved bytes or collectives.

Communication and memory: none of its own (each head states its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# (models/config.py's ModelConfig, which lists this module: named for the annotations only)
ModelConfig = Any


class HeadCost(Protocol):
    """One training head's cost (see the module docstring; ``params`` without the embedding's
    copy, which :class:`HeadCosts` adds once when ``lookups`` > 0)."""

    name: str

    def blocks(self, c: ModelConfig) -> tuple[bool, ...]: ...

    def head_passes(self, c: ModelConfig) -> int: ...

    def lookups(self, c: ModelConfig) -> int: ...

    def norms(self, c: ModelConfig) -> int: ...

    def linears(self, c: ModelConfig, t: int) -> list[tuple[float, float]]: ...

    def params(self, c: ModelConfig, t: int) -> float: ...

    def saved(self, c: ModelConfig, a: float, profile: str, out_t: int) -> float: ...

    def step_collectives(self, c: ModelConfig, tokens: float, doc_masking: bool
                         ) -> list[tuple[str, str, float]]: ...


@dataclass(frozen=True)
class HeadCosts:
    """The registered heads' costs, summed."""

    heads: Sequence[HeadCost]

    def blocks(self, c: ModelConfig) -> tuple[bool, ...]:
        """Whether each extra block is MoE (the last stage holds them after its layers)."""
        return tuple(b for h in self.heads for b in h.blocks(c))

    def head_passes(self, c: ModelConfig) -> int:
        """LM head and loss passes per micro-batch: the main model's and the heads' more."""
        return 1 + sum(h.head_passes(c) - 1 for h in self.heads)

    def lookups(self, c: ModelConfig) -> int:
        """Embedding lookups per micro-batch beyond the first stage's."""
        return sum(h.lookups(c) for h in self.heads)

    def norms(self, c: ModelConfig) -> int:
        """Norm weights outside the extra blocks."""
        return sum(h.norms(c) for h in self.heads)

    def linears(self, c: ModelConfig, t: int) -> list[tuple[float, float]]:
        """``(in, out)`` of each of the heads' own linears on a rank."""
        return [lin for h in self.heads for lin in h.linears(c, t)]

    def params(self, c: ModelConfig, t: int, embedding_copy: bool) -> float:
        """Parameters on a rank besides the blocks, plus the embedding's copy (``V / t`` rows,
        vocab padded to tp) when a head looks tokens up and the embedding lives on another
        pipeline stage."""
        own = sum(h.params(c, t) for h in self.heads)
        copy = -(-c.vocab_size // t) * c.dim if embedding_copy and self.lookups(c) else 0.0
        return own + copy

    def saved(self, c: ModelConfig, a: float, profile: str, out_t: int) -> float:
        """Bytes per token kept for backward beyond the blocks and the head passes."""
        return sum(h.saved(c, a, profile, out_t) for h in self.heads)

    def step_collectives(self, c: ModelConfig, tokens: float, doc_masking: bool
                         ) -> list[tuple[str, str, float]]:
        """(op, axis, comm-log bytes) of each collective the heads add once per step on the
        last stage (``tokens``: the step's whole sequences on a dp rank, every micro-batch's;
        ``doc_masking``: the batches carry document ids); the caller drops those over an axis
        of one rank."""
        return [x for h in self.heads for x in h.step_collectives(c, tokens, doc_masking)]


__all__ = ["HeadCost", "HeadCosts"]
