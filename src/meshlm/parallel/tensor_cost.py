"""Tensor and sequence parallelism as the planner sees them (torch-free): splits and messages.

The technique itself is :mod:`.tensor` (torch), over the mesh's ``tp`` axis; ``parallel.sp``
picks the description (``False``: tensor parallelism alone, ``True``: with sequence
parallelism, Korthikanti et al. 2022). Over ``t`` ranks, with ``A`` bytes of one micro-batch's
activation (``b s h`` elements), ``L`` layers on the rank and ``F`` forward passes per
micro-batch (2 under full recomputation):

**Memory**: the attention and MLP regions' interior splits over t; what lies outside them (the
norms' inputs, the residual stream, the layer input) only with sp (:meth:`TensorCost.outside`).

**Communication** per micro-batch (``tensor.py``), on the critical path (exposed), or with
``tp_overlap`` (async TP, Wang et al. 2022; published runs only) beside the GEMMs:

- tp alone: each region all-reduces its output forward and its input's gradient backward:
  ``4 L (F + 1) / 2`` all-reduces of A, plus one for the embedding's partial lookups (first
  stage) and one for the head's input gradient (last stage);
- with sp: each all-reduce becomes an all-gather and a reduce-scatter of the same volume, the
  embedding's a reduce-scatter and the head's input an all-gather (``4 L (F + 1) / 2`` + the
  ends of each), and the replicated norm weights' gradients are all-reduced (``2 L`` + the
  final norm, ``h`` fp32 values);
- the vocab-parallel loss: 3 all-reduces of ``b s`` fp32 values (max, target logit, sum) on
  the last stage; once per step the clipping norm (8 bytes).

Pipeline boundaries: with sp a stage sends its sequence shard, ``A / t`` (:attr:`split_sends`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Collective, Registry


@dataclass(frozen=True)
class TensorCost:
    """Tensor parallelism's cost with or without sequence parallelism (module docstring)."""

    name: bool  # parallel.sp
    doc: str

    @property
    def split_sends(self) -> bool:
        """Whether pipeline sends carry 1 / t of the activation (the rank's sequence shard)."""
        return self.name

    def outside(self, t: int) -> int:
        """How many ways the tensors outside the tp regions are split over ``t`` ranks."""
        return t if self.name else 1

    def collectives(self, act: float, norm_grad: float, tokens: float, layers: int,
                    first: bool, last: bool, forwards: int, m: int, overlap: str
                    ) -> list[Collective]:
        """One step's tp messages on a rank (``act``: bytes of one micro-batch's activation;
        ``norm_grad``: of one norm's weight gradient; ``overlap``: the regions'); the clipping
        norm's last."""
        redo = (forwards + 1) / 2  # recomputed forwards communicate again
        out = []
        if self.name:
            ends = 4 * layers * redo + (1 if last else 0) + (1 if first else 0)
            out.append(Collective("all_gather", act, ends * m, overlap))
            out.append(Collective("reduce_scatter", act, ends * m, overlap))
            out.append(Collective("all_reduce", norm_grad, (2 * layers + (1 if last else 0)) * m,
                                  overlap))
        else:
            out.append(Collective("all_reduce", act,
                                  (4 * layers * redo + (1 if first else 0) + (1 if last else 0))
                                  * m, overlap))
        if last:
            out.append(Collective("all_reduce", tokens * 4, 3 * m, overlap))  # the loss
        out.append(Collective("all_reduce", 8, 1, "exposed"))  # clipping
        return out


TENSOR: Registry[TensorCost] = Registry("sequence parallelism")
TENSOR.register(TensorCost(False, "tensor parallelism: regions split, the rest replicated"))
TENSOR.register(TensorCost(True, "tensor + sequence parallelism: the rest split by sequence"))

__all__ = ["TENSOR", "TensorCost"]
