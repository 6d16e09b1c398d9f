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

What the model's layers add (:class:`StageTerms`, read from their declared costs when the
planner passes the model, as ``tensor.py`` applies them):

- an attention layer with replicated projections in front of its heads
  (``models/attention_cost.py``: ``latent_entry``, a width ``L``): they take the layer input
  whole -- no ``f`` (tp), an all-gather forward only (sp) -- and their outputs enter the heads'
  region through one ``f``: per layer one all-reduce of ``A L / h`` backward instead of the
  input's all-reduce (tp) or reduce-scatter (sp) of ``A``;
- norms every rank applies to its own heads (Qwen3's ``q_norm`` / ``k_norm``): their weight
  gradients all-reduced, tp or sp, per layer and micro-batch;
- the extra training heads on the last stage (``models/technique.py``): their embedding
  lookups (as the first stage's), each column-parallel linear's input made whole (all-reduce
  backward; sp: all-gather forward, reduce-scatter backward) and its column shards gathered by
  feature (all-gather forward; sp: and backward), one more head input and loss per head pass,
  and with sp their norms' gradients; their blocks are among the ``L`` layers.

Pipeline boundaries: with sp a stage sends its sequence shard, ``A / t`` (:attr:`split_sends`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..models.attention_cost import projection_cost
from ..models.config import ModelConfig
from ..models.techniques import HEADS
from .cost import Collective, Registry


@dataclass(frozen=True)
class StageTerms:
    """What one stage's model passes through tp's collectives per micro-batch besides its
    blocks' attention and MLP regions (widths in ``h`` per token; module docstring)."""

    lookups: int = 0  # vocab-parallel embedding lookups (the embedding; the heads')
    heads: int = 0  # head passes: the head's column-parallel input and the vocab-parallel loss
    norms: int = 0  # replicated norm weights outside the regions (their gradients: sp)
    proj_in: tuple[float, ...] = ()  # column-parallel inputs made whole (the heads'), widths
    proj_out: tuple[float, ...] = ()  # column-parallel outputs gathered by feature, widths
    entry: float = 0.0  # per attention region: the features entering through f; 0: none
    head_norms: tuple[int, ...] = ()  # per attention layer: head-shared norms' values (Qwen3)


def stage_terms(c: ModelConfig | None, first: bool, last: bool) -> StageTerms:
    """The :class:`StageTerms` of a stage of model ``c`` (None: the embedding on the first
    stage, the head, its loss and the final norm on the last, nothing else)."""
    if c is None:
        return StageTerms(int(first), int(last), int(last))
    att = projection_cost(c)
    more = HEADS.head_passes(c) - 1 if last else 0  # the extra training heads' (last stage)
    proj = HEADS.linears(c, 1) if last else []
    return StageTerms(
        lookups=int(first) + (HEADS.lookups(c) if last else 0), heads=int(last) + more,
        norms=int(last) + (HEADS.norms(c) if last else 0),
        proj_in=tuple(i / c.dim for i, _ in proj), proj_out=tuple(o / c.dim for _, o in proj),
        entry=att.latent_entry(c) / c.dim, head_norms=tuple(att.head_shared_norms(c)))


def _widths(op: str, act: float, widths: list[float], calls: float, overlap: str
            ) -> list[Collective]:
    """One collective per distinct width (``act`` x width bytes), ``calls`` per occurrence."""
    return [Collective(op, act * w, n * calls, overlap)
            for w, n in sorted(Counter(widths).items())]


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
                    first: bool, last: bool, forwards: int, m: int, overlap: str,
                    model: ModelConfig | None = None, block_gather: float | None = None
                    ) -> list[Collective]:
        """One step's tp messages on a rank (``act``: bytes of one micro-batch's activation;
        ``norm_grad``: of one norm's weight gradient, ``h`` values; ``overlap``: the regions';
        ``model``: the model whose layers' terms to add, :func:`stage_terms`;
        ``block_gather``: bytes of the blocks' sequence-parallel all-gathers where they travel
        narrower than ``act``, a float8 stack's); the clipping norm's last."""
        terms = stage_terms(model, first, last)
        redo = (forwards + 1) / 2  # recomputed forwards communicate again
        latent = layers if terms.entry else 0  # attention regions entered by their latents
        # the regions' boundaries, the lookups' and the head inputs' (entries of A)
        ends = 4 * layers * redo - latent + terms.lookups + terms.heads
        out = []
        if self.name:
            if block_gather is None:
                out.append(Collective("all_gather", act, (ends + latent) * m, overlap))
            else:  # the blocks' regions in the narrow dtype, the lookups' and heads' not
                out.append(Collective("all_gather", block_gather, 4 * layers * redo * m,
                                      overlap))
                if terms.lookups + terms.heads:
                    out.append(Collective("all_gather", act, (terms.lookups + terms.heads) * m,
                                          overlap))
            out.append(Collective("reduce_scatter", act, ends * m, overlap))
            out.append(Collective("all_reduce", norm_grad, (2 * layers + terms.norms) * m,
                                  overlap))
            out += _widths("all_gather", act, [*terms.proj_in, *terms.proj_out * 2], m, overlap)
            out += _widths("reduce_scatter", act, list(terms.proj_in), m, overlap)
        else:
            out.append(Collective("all_reduce", act, ends * m, overlap))
            out += _widths("all_reduce", act, list(terms.proj_in), m, overlap)
            out += _widths("all_gather", act, list(terms.proj_out), m, overlap)
        if latent:  # the latents' f: their gradient summed over the heads' shards
            out.append(Collective("all_reduce", act * terms.entry, latent * m, overlap))
        if terms.head_norms and model is not None:  # each head-shared norm's weight gradient
            out += _widths("all_reduce", norm_grad / model.dim, list(terms.head_norms),
                           layers * m, overlap)
        if terms.heads:
            out.append(Collective("all_reduce", tokens * 4, 3 * terms.heads * m, overlap))
        out.append(Collective("all_reduce", 8, 1, "exposed"))  # clipping
        return out


TENSOR: Registry[TensorCost] = Registry("sequence parallelism")
TENSOR.register(TensorCost(False, "tensor parallelism: regions split, the rest replicated"))
TENSOR.register(TensorCost(True, "tensor + sequence parallelism: the rest split by sequence"))

__all__ = ["TENSOR", "StageTerms", "TensorCost", "stage_terms"]
