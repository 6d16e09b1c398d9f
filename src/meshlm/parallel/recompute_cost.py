"""Activation recomputation as the planner sees it (torch-free): what a layer keeps, what is
recomputed.

The modes themselves are :mod:`.recompute` (torch); ``train.recompute`` accepts exactly the
names here, least to most recomputation. Per layer and micro-batch, of the tensors the layer
saves without recomputation (named as the planner's activation items):

- ``none`` keeps all of them;
- ``selective`` (Korthikanti et al. 2022, sec. 5) drops the attention core's: the score matrix
  (softmax, dropout) or, with flash attention, the log-sum-exp, and the mask made inside the
  core; the core's output stays (it is the output projection's input). Recomputed: one forward
  of the attention core;
- ``op`` (torchtitan's ``selective_ac_option="op"``) keeps in a dense layer the layer input,
  every other matmul output in forward order (the 1st, 3rd, ...) and the attention output with
  its log-sum-exp (counted by the planner from the model's matmuls), or ``selective``'s set if
  smaller; MoE layers are counted as ``selective``. Recomputed: the forwards of the 2nd, 4th,
  ... matmuls and of the memory-bound ops (materialised scores: their forward too);
- ``full`` (Chen et al. 2016) keeps the layer input; backward rebuilds the whole layer first
  (one layer's activations, transient) and recomputes one forward of every layer, whose
  collectives and autocast weight casts then run twice.

Communication: a recomputed forward's own (``forwards``: the forward passes per micro-batch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .cost import Registry

# the attention core's items: what selective recomputation does not keep
ATTENTION_CORE = ("scores", "attention mask")


@dataclass(frozen=True)
class RecomputeCost:
    """One recomputation mode's cost, as the planner reads it (see the module docstring)."""

    name: str
    doc: str
    drops: tuple[str, ...] = ()  # saved items recomputed instead
    matmul_outputs: bool = False  # a dense layer keeps every other matmul output (op-level)
    input_only: bool = False  # keeps only the layer input; backward rebuilds the layer

    @property
    def forwards(self) -> int:
        """Forward passes of a layer per micro-batch (communication and weight casts)."""
        return 2 if self.input_only else 1

    @property
    def whole_layer(self) -> bool:
        """Whether the layer's saved set is kept or dropped whole (a compiled block's own
        saved tensors then apply)."""
        return not self.drops

    def kept(self, items: Mapping[str, float], moe: bool, op_saved: float,
             layer_input: float) -> float:
        """Bytes one layer keeps for one micro-batch, of the saved ``items``; ``op_saved``:
        what op-level recomputation keeps of a dense layer; ``layer_input``: its input."""
        if self.input_only:
            return layer_input
        if not self.drops:
            return sum(items.values())
        selective = sum(v for k, v in items.items() if k not in self.drops)
        if self.matmul_outputs and not moe:
            return min(op_saved, selective)
        return selective

    def compute(self, gemm: float, per_linear: Sequence[float], attn_fwd: float, elem: float,
                moe: bool, flash: bool) -> float | None:
        """Seconds one layer recomputes per micro-batch (None: nothing), given its GEMMs'
        forward + backward (``gemm``, ``per_linear`` in forward order), its attention
        forward and its memory-bound forward + backward (``elem``)."""
        if self.input_only:
            return gemm / 3 + attn_fwd + elem / 3
        if self.matmul_outputs and not moe:
            return sum(per_linear[1::2]) / 3 + elem / 3 + (0 if flash else attn_fwd)
        if self.drops:
            return attn_fwd
        return None


RECOMPUTE: Registry[RecomputeCost] = Registry("recomputation mode")
RECOMPUTE.register(RecomputeCost("none", "every saved tensor kept"))
RECOMPUTE.register(RecomputeCost("selective", "the attention core recomputed",
                                 drops=ATTENTION_CORE))
RECOMPUTE.register(RecomputeCost("op", "every other matmul output kept (torchtitan)",
                                 drops=ATTENTION_CORE, matmul_outputs=True))
RECOMPUTE.register(RecomputeCost("full", "the layer input kept; the layer rebuilt in backward",
                                 input_only=True))

__all__ = ["ATTENTION_CORE", "RECOMPUTE", "RecomputeCost"]
