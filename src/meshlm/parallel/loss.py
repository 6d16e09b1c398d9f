"""The training loss: torch's cross-entropy on whole logits, or the chunked fused head + loss.

``train.loss = torch``: the LM head writes (B, S, V) logits and ``F.cross_entropy`` (or the
vocab-parallel loss under tp) reads them: the fp32 logits and log-probabilities of a whole
micro-batch are alive at once (4 GiB per micro-batch for a 128k vocabulary at 8k tokens).

``train.loss = chunked`` (Liger-Kernel's fused linear cross-entropy, Hsu et al. 2024): the
model stops at the head's input, and :class:`ChunkedLinearCrossEntropy` runs the head and the
loss over ``train.loss_chunk`` tokens at a time. Each chunk's logits live only while its loss
and gradients are formed: the gradient of the head input (rows of the chunk) and of the head
weight (accumulated over chunks) are computed in forward and kept; backward scales them by the
incoming gradient. Memory: one chunk's logits (``chunk x V/t`` fp32, a few copies) instead of
the micro-batch's, plus the head weight's gradient (``V/t x h`` fp32) from forward to backward.
Compute: the head's three matmuls, as torch's; no logits are materialised whole.

Under tensor parallelism the head weight is the vocabulary shard ``[start, start + valid)`` of
this tp rank: each chunk all-reduces its row maximum, target logit and sum of exponentials over
tp (3 x chunk fp32 values, as the vocab-parallel loss does per micro-batch), and the gradient
of the head input is a partial sum that the head's input operator (copy-to-tp or the
sequence-parallel all-gather) reduces in backward.

Every loss takes optional per-position ``weight`` (B, S): the loss is then the weighted sum
``sum_i w_i CE_i`` instead of the mean (rows of weight 0 do not count). Multi-token prediction
(``models/mtp.py``) uses it: :class:`MultiTokenLoss` forms each depth's targets and weights and
runs the model's MTP modules and the same loss on their head outputs.

Multi-token prediction's normalisation is the main loss's: the token mean over the global
batch, in every layout. Depth k's loss is the sum over the step's counted predictions divided
by their number N_k in the global batch (``counted_predictions``); each rank's share of a
micro-batch (one of ``G dp cp`` shares, G micro-batches per rank) weights its counted
positions by ``G dp cp / N_k``, so that the mean over micro-batches and over the dp x cp ranks
that the runners and the engines take -- as they do of the main loss -- is that global mean.
Without document masking N_k = ``global_batch (S - k)`` is known; with it, one all-reduce over
dp of D numbers per step (each rank counts its sequences' predictions from the document ids of
the inputs and of the targets -- a prediction counts only inside its position's document,
``models/mtp.py`` -- which every cp rank holds whole). Context parallelism reads the tokens
ahead of its positions from whole sequences: one all-gather over cp of the step's targets
(``G b s / cp`` int64 per rank). Memory: per micro-batch and depth three (b, s / cp) tensors
(ids, targets, weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..distributed.comm import Comm
from ..models.llama import Transformer
from ..models.mtp import counted_predictions, depth_inputs
from .context import ContextParallel
from .tensor import TensorParallel, exp_logits_

AXIS = "tp"


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token loss of (B, S, V) logits, computed in fp32 (``weight`` (B, S): the
    weighted sum instead)."""
    if weight is None:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    per = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return (per * weight.flatten()).sum()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``x @ weight.T`` over rows, ``chunk`` rows at a time (``rows``:
    per-row weights of a weighted sum instead)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # noqa: ANN001
                chunk: int, start: int, valid: int, comm: Comm | None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[0]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if (
            need_grad) else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for lo in range(0, n, chunk):
            xc, tc = x[lo:lo + chunk], targets[lo:lo + chunk]
            logits = F.linear(xc, weight).float()  # (c, V_local); autocast picks the matmul
            sum_exp, target_logit, idx, mine = exp_logits_(logits, tc, start, valid, comm)
            per = sum_exp.log() - target_logit
            wc = None if rows is None else rows[lo:lo + chunk].float()
            total += per.sum() if wc is None else (per * wc).sum()
            if need_grad:  # d loss / d logits = (softmax - one-hot) / n (or * the row weight)
                logits /= sum_exp.unsqueeze(1)
                logits.scatter_add_(1, idx, -mine.to(logits.dtype).unsqueeze(1))
                if wc is None:
                    logits /= n
                else:
                    logits *= wc.unsqueeze(1)
                grad_x[lo:lo + chunk] = logits @ weight  # (autocast: in the compute dtype)
                grad_w.addmm_(logits.t(), xc.float())  # (fp32, accumulated over chunks)
            del logits
        if need_grad:
            ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return total / n if rows is None else total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        grad_x, grad_w = ctx.saved_tensors
        return (grad_x * grad.to(grad_x.dtype), (grad_w * grad).to(ctx.weight_dtype),
                None, None, None, None, None, None)


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk: int, start: int = 0, valid: int | None = None,
                          comm: Comm | None = None, rows: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """Mean loss of (N, H) head inputs against (V_local, H) head weight rows (the global ids
    ``[start, start + valid)``; ``comm``: reduce over tp; ``rows`` (N,): the weighted sum)."""
    valid = weight.shape[0] if valid is None else valid
    return ChunkedLinearCrossEntropy.apply(x, weight, targets, chunk, start, valid, comm, rows)


class ChunkedLoss:
    """``loss(hidden, targets)`` for a model whose head stops at its input (``emit_hidden``)."""

    def __init__(self, model: Transformer, tp: TensorParallel | None, chunk: int) -> None:
        self.model, self.tp, self.chunk = model, tp, chunk

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor,
                 weight: torch.Tensor | None = None) -> torch.Tensor:
        x, t = hidden.flatten(0, 1), targets.flatten()
        w = self.model.output.weight
        rows = None if weight is None else weight.flatten()
        if self.tp is None:
            return chunked_cross_entropy(x, w, t, self.chunk, rows=rows)
        return chunked_cross_entropy(x, w, t, self.chunk, self.tp.vocab_start,
                                     self.tp.vocab_valid, self.tp.comm, rows)


def build_loss(model: Transformer, tp: TensorParallel | None, kind: str, chunk: int
               ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of ``train.loss``; ``chunked`` also makes the model return the head's input."""
    if kind == "chunked":
        model.emit_hidden = True
        return ChunkedLoss(model, tp, chunk)
    return tp.loss if tp is not None else cross_entropy


# (tokens read, tokens predicted, loss weights) of each depth of one micro-batch, on this rank
Ahead = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class MultiTokenLoss:
    """Multi-token prediction's loss (``models/mtp.py``) in every layout: :meth:`prepare` forms
    a step's targets and weights per micro-batch and depth (see the module docstring for the
    normalisation; collective over cp and, with document ids, over dp), :meth:`__call__` runs
    the model's MTP modules after a training forward and returns the mean over depths of their
    losses. ``weight``: ``model.mtp_loss_weight``, the factor the objective adds it with."""

    def __init__(self, model: Transformer, loss_fn: Callable[..., torch.Tensor], comm: Comm,
                 cp: ContextParallel | None, device: torch.device) -> None:
        self.model, self.loss_fn, self.comm, self.cp = model, loss_fn, comm, cp
        self.device = device
        self.depth, self.weight = model.cfg.mtp_depth, model.cfg.mtp_loss_weight

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
        outs = self.model.predict_ahead([ids for ids, _, _ in ahead], ahead[0][0].shape[1])
        losses = [self.loss_fn(out, tgt, w) for out, (_, tgt, w) in zip(outs, ahead, strict=True)]
        return torch.stack(losses).sum() / len(losses)
