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
``sum_i w_i CE_i`` instead of the mean (rows of weight 0 do not count); an extra training
objective (``parallel/objective.py``) runs the same loss on its head's outputs with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..distributed.comm import Comm
from ..models.llama import Transformer
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
