"""Multi-token prediction as the planner sees it (torch-free; the modules are ``models/mtp.py``).

DeepSeek-V3's multi-token prediction (DeepSeek-AI 2024, sec. 2.2): ``model.mtp_depth`` = D
modules after the main model, on the last pipeline stage. Module k takes the main model's (or
module k - 1's) hidden state and the embedding of the token k + 1 ahead, normalises both
(``enorm``, ``hnorm``), projects their concatenation (``proj``: 2 h -> h), runs one decoder
block (layer id ``n_layers + k``, MoE when the model is) and predicts through its ``norm`` and
the shared LM head. What it adds to the last stage, per micro-batch of ``T`` tokens on a rank:

- **blocks** (:meth:`MTPCost.blocks`): D more decoder blocks, costed as the stage's own layers
  (parameters, saved activations, GEMMs, attention, their collectives under tp / cp / ep);
- **head passes** (:meth:`MTPCost.head_passes`): the LM head and the loss run ``1 + D``
  times: each pass's GEMM, loss and kept logits (the loss's backward transient stays one
  pass's: they run one after the other);
- **its own layers** (:meth:`MTPCost.linears`, :meth:`MTPCost.params`): ``proj`` per depth
  (column parallel over tp: ``2 h^2 / t`` on a rank) and three norms; under pipelining
  the embedding of the tokens ahead is a copy on the last stage (``V h / t``, as a tied head
  is), whose gradient is summed with the first stage's once per step (not counted);
- **saved** (:meth:`MTPCost.saved`): per depth the two input norms' tensors -- meshlm:
  ``enorm``'s fp32 input, normalised copy and 1/rms, ``hnorm``'s normalised copy and 1/rms
  (its input is the hidden state the previous head pass's norm keeps already),
  ``(3 h + 2) 4`` bytes; ``megatron``: ``enorm``'s 16-bit input -- and ``proj``'s input
  (``2 h`` in the compute dtype). Measured with saved-tensor hooks on meshlm's model (CPU,
  fp32): within 0.5 % of the whole model's activations with and without MTP.

Communication: the blocks' own (as any layer's); under tensor parallelism, per depth and
micro-batch, what ``parallel/tensor_cost.py`` composes from this description as
``parallel/tensor.py`` applies it: the vocab-parallel lookup of the tokens ahead
(:meth:`MTPCost.lookups`), ``proj``'s input made whole and its column shards gathered
(:meth:`MTPCost.linears`), one more head input and vocab-parallel loss
(:meth:`MTPCost.head_passes`) and, with sequence parallelism, the gradients of its three norms
(:meth:`MTPCost.norms`). Not counted: under document masking the all-reduce over dp of the
counted predictions (``D`` float64 per step), under cp the all-gather of the step's targets
(``parallel/loss.py``), the cross-entropy's per-depth target shift.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class MTPCost:
    """Multi-token prediction's cost, as the planner reads it (module docstring); every
    method returns nothing (0, ``()``, 1 head pass) for a model without it."""

    name: str = "mtp"

    def blocks(self, c: ModelConfig) -> tuple[bool, ...]:
        """Whether each module's block is MoE (the last stage holds them after its layers)."""
        return tuple(c.is_moe_layer(c.n_layers + k) for k in range(c.mtp_depth))

    def head_passes(self, c: ModelConfig) -> int:
        """LM head and loss passes per micro-batch: the main model's and one per depth."""
        return 1 + c.mtp_depth

    def lookups(self, c: ModelConfig) -> int:
        """Embedding lookups per micro-batch (the tokens ahead, one per depth)."""
        return c.mtp_depth

    def norms(self, c: ModelConfig) -> int:
        """Norm weights outside the blocks (``enorm``, ``hnorm``, ``norm`` per depth)."""
        return 3 * c.mtp_depth

    def linears(self, c: ModelConfig, t: int) -> list[tuple[float, float]]:
        """``(in, out)`` of each ``proj`` on a rank (column parallel over tp)."""
        return [(2 * c.dim, c.dim / t)] * c.mtp_depth

    def params(self, c: ModelConfig, t: int, embedding_copy: bool) -> float:
        """Parameters on a rank besides the blocks: ``proj`` and the three norms per depth,
        plus the embedding's copy (``V / t`` rows, vocab padded to tp) when the embedding
        lives on another pipeline stage."""
        if not c.mtp_depth:
            return 0.0
        own = c.mtp_depth * (2 * c.dim * c.dim / t + 3 * c.dim)
        return own + (-(-c.vocab_size // t) * c.dim if embedding_copy else 0.0)

    def saved(self, c: ModelConfig, a: float, profile: str, out_t: int) -> float:
        """Bytes per token kept for backward beyond the blocks and the head passes (``out_t``:
        how many ways tensors outside tp regions are split, sequence parallelism's)."""
        if profile == "megatron":
            norms = c.dim * 2.0
        else:
            norms = (3 * c.dim + 2) * 4.0
        return c.mtp_depth * (norms / out_t + 2 * c.dim * a)


MTP = MTPCost()

__all__ = ["MTP", "MTPCost"]
