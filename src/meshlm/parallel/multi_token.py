"""Multi-token prediction (``models/mtp.py``) in every layout: its training objective and its
tensor-parallel plan.

The objective (:class:`MultiTokenLoss`, registered as "mtp": metric ``mtp_loss``,
``parallel/objective.py``) runs the model's head ``mtp`` after a training forward and the main
loss on each depth's head output, with per-position weights (the loss is then the weighted sum
``sum_i w_i CE_i``, rows of weight 0 not counting, ``parallel/loss.py``). The micro-batch's
objective adds ``model.mtp_loss_weight`` times the mean over depths of their losses, and the
MoE aux losses of the depths' blocks.

Normalisation: the main loss's, the token mean over the global batch, in every layout. Depth
k's loss is the sum over the step's counted predictions divided by their number N_k in the
global batch (``counted_predictions``); each rank's share of a micro-batch (one of
``G dp cp`` shares, G micro-batches per rank) weights its counted positions by
``G dp cp / N_k``, so that the mean over micro-batches and over the dp x cp ranks that the
runners and the engines take -- as they do of the main loss -- is that global mean. Without
document masking N_k = ``global_batch (S - k)`` is known; with it, one all-reduce over dp of D
numbers per step (each rank counts its sequences' predictions from the document ids of the
inputs and of the targets -- a prediction counts only inside its position's document,
``models/mtp.py`` -- which every cp rank holds whole; the sampler's ``target_docs``). Context
parallelism reads the tokens ahead of its positions from whole sequences: one all-gather over
cp of the step's targets (``G b s / cp`` int64 per rank). Memory: per micro-batch and depth
three (b, s / cp) tensors (ids, targets, weights).

Under tensor parallelism (:func:`tensor_parallel`, registered for the head "mtp" in
``tensor.HEAD_PLANS``): its blocks are split as the layers are; its ``proj`` (2h -> h) is
column parallel (h/t output rows per rank): the input enters through ``f`` (sp: the
all-gather along seq) and the output shards are all-gathered to (b, s, h) (sp: then this
rank's sequence chunk taken), as Megatron-Core's ``eh_proj``: forward one all-gather of
``b s h`` (sp: plus ``b s 2h`` along seq), backward one all-reduce of ``b s 2h`` (sp:
all-gather of ``b s h`` and reduce-scatter of ``b s 2h``) per depth and micro-batch; its norms
are sequence parallel under sp. Each depth's head pass adds the vocab-parallel loss's 3
all-reduces of ``b s`` values. Under pp it runs on the last stage, with a copy of the
embedding table there (``parallel/pipeline.py``, as for any training head that reads it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..distributed import traceable
from ..distributed.comm import Comm
from ..models.config import ModelConfig
from ..models.llama import Transformer
from ..models.mtp import MultiTokenPrediction, counted_predictions, depth_inputs
from .context import ContextParallel
from .objective import register_objective
from .tensor_comm import AXIS, _all_gather_seq, _conjugate
from .tensor_plan import (
    COLUMN,
    RegionInput,
    SequenceParallelRMSNorm,
    _shard,
    _take_seq_shard,
    register_head_plan,
)

# (tokens read, tokens predicted, loss weights) of each depth of one micro-batch, on this rank
Ahead = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@register_objective
class MultiTokenLoss:
    """Multi-token prediction's loss in every layout: :meth:`prepare` forms a step's targets
    and weights per micro-batch and depth (see the module docstring for the normalisation;
    collective over cp and, with document ids, over dp), :meth:`__call__` runs the model's
    MTP modules after a training forward and returns the mean over depths of their losses.
    ``weight``: ``model.mtp_loss_weight``, the factor the objective adds it with."""

    name = "mtp"
    target_docs = True  # (a prediction counts inside its position's document, t_S's included)

    @staticmethod
    def enabled(cfg: ModelConfig) -> bool:
        return cfg.mtp_depth > 0

    def __init__(self, model: Transformer, loss_fn: Callable[..., torch.Tensor], comm: Comm,
                 cp: ContextParallel | None, device: torch.device) -> None:
        self.model, self.loss_fn, self.comm, self.cp = model, loss_fn, comm, cp
        self.device = device
        self.depth, self.weight = model.cfg.mtp_depth, model.cfg.mtp_loss_weight

    def layer_ids(self) -> list[int]:
        """Layer ids of the depths' blocks this rank holds."""
        return list(self.model.mtp.blocks()) if self.model.mtp is not None else []

    def prepare(self, micro: list[tuple[torch.Tensor, ...]]) -> list[Ahead]:
        """Each micro-batch's (ids, targets, weights) per depth, (b, s) tensors on this rank's
        positions (``micro``: this rank's (inputs, targets[, document ids, the targets'
        document ids]) of the step, the document ids of whole sequences)."""
        dev = self.device
        targets = torch.stack([mb[1] for mb in micro]).to(dev)  # (G, b, s) of this rank
        docs = self._window_docs(micro)
        cp = self.cp.size if self.cp is not None else 1
        whole = self.cp.gather_shares(targets) if cp > 1 else targets  # (G, b, S)
        g, b, s = whole.shape
        pos = None if cp == 1 else self.cp.local_positions(targets.shape[-1], dev)
        dp = self.comm.size("dp")
        if docs is None:  # every sequence alike: N_k = dp G b (S - k)
            counts = torch.tensor([float(dp * counted_predictions(s, k, None, g * b))
                                   for k in range(1, self.depth + 1)], dtype=torch.float64,
                                  device=dev)
        else:
            counts = torch.stack([counted_predictions(s, k, docs, g * b)
                                  for k in range(1, self.depth + 1)]).double()
            self.comm.all_reduce(counts, "dp")
        scale = (float(g * dp * cp) / counts.clamp(min=1)).float()  # (D,) on the device
        out = []
        for i in range(g):
            per = []
            for k in range(1, self.depth + 1):
                ids, tgt, counted = depth_inputs(whole[i], k, pos,
                                                 None if docs is None else docs[i])
                per.append((ids, tgt, counted.float() * scale[k - 1]))
            out.append(per)
        return out

    def _window_docs(self, micro: list[tuple[torch.Tensor, ...]]) -> torch.Tensor | None:
        """(G, b, S + 1): the documents of the step's whole windows t_0 ... t_S (the inputs'
        and the last target's), on the device; None without document masking."""
        if len(micro[0]) <= 2:
            return None
        if len(micro[0]) < 4:
            raise ValueError("multi-token prediction under document masking needs the targets' "
                             "document ids too (the sampler's target_docs)")
        inputs = torch.stack([mb[2] for mb in micro])  # (G, b, S)
        last = torch.stack([mb[3][..., -1:] for mb in micro])  # (G, b, 1): t_S's
        return torch.cat([inputs, last], dim=-1).to(self.device)

    def __call__(self, ahead: Ahead) -> torch.Tensor:
        """Mean over depths of their losses on one micro-batch (after its training forward,
        inside the same ``packed`` block): this rank's weighted share."""
        if self.model.mtp is None:
            raise RuntimeError("predict_ahead needs a model with multi-token prediction "
                               "(model.mtp_depth > 0) after a training forward")
        outs = self.model.mtp.predict_ahead(self.model, [ids for ids, _, _ in ahead],
                                            ahead[0][0].shape[1])
        losses = [self.loss_fn(out, tgt, w) for out, (_, tgt, w) in zip(outs, ahead, strict=True)]
        return torch.stack(losses).sum() / len(losses)


# ---------------------------------------------------------------------- tensor parallelism
def _gather_features(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(b, s, h/t) on each rank -> (b, s, h): every rank's last-dim shard, in rank order."""
    t = comm.size(AXIS)
    b, s, f = x.shape
    out = traceable.all_gather(x.contiguous(), traceable.key_of(comm), AXIS)  # (t*b, s, h/t)
    return out.view(t, b, s, f).permute(1, 2, 0, 3).reshape(b, s, t * f)


def _own_features(g: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's last-dim shard of a tensor whole on every tp rank."""
    f = g.shape[-1] // comm.size(AXIS)
    r = comm.rank(AXIS)
    return g[..., r * f : (r + 1) * f].contiguous()


def _features_to_seq_shard(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _take_seq_shard(_gather_features(x, comm), comm)


def _seq_shard_to_features(g: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _own_features(_all_gather_seq(g.contiguous(), comm), comm)


# all-gather along the last dim, backward: this rank's features (the consumers' gradient is
# whole on every rank); with sp, then this rank's sequence chunk (backward: all-gather seq)
_GatherFeatures = _conjugate("_GatherFeatures", _gather_features, _own_features)
_FeaturesToSeqShard = _conjugate("_FeaturesToSeqShard", _features_to_seq_shard,
                                 _seq_shard_to_features)


class ProjOutput(nn.Module):
    """Multi-token prediction's ``proj_out`` under tp: the column shards of ``proj``'s output
    all-gathered to (b, s, h) (Megatron-Core's ``eh_proj``), with sp then this rank's chunk
    of the sequence. Backward: this rank's features of the whole, equal gradient (with sp:
    all-gathered along seq first)."""

    def __init__(self, comm: Comm, sp: bool) -> None:
        super().__init__()
        self.comm, self.sp = comm, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_FeaturesToSeqShard if self.sp else _GatherFeatures).apply(x, self.comm)

    def extra_repr(self) -> str:
        return f"all-gather features{', seq chunk' if self.sp else ''}, tp={self.comm.size(AXIS)}"


def tensor_parallel(head: nn.Module, comm: Comm, sp: bool) -> None:
    """The head ``mtp`` under tp (module docstring) besides its blocks, which
    ``parallel/tensor.py`` shards as the model's layers."""
    assert isinstance(head, MultiTokenPrediction)
    for depth in head:
        _shard(depth.proj.weight, COLUMN, comm)
        depth.proj_in, depth.proj_out = RegionInput(comm, sp), ProjOutput(comm, sp)
        if sp:
            depth.enorm = SequenceParallelRMSNorm(depth.enorm, comm)
            depth.hnorm = SequenceParallelRMSNorm(depth.hnorm, comm)
            depth.norm = SequenceParallelRMSNorm(depth.norm, comm)


register_head_plan("mtp", tensor_parallel)

__all__ = ["Ahead", "MultiTokenLoss", "ProjOutput", "tensor_parallel"]
