"""Multi-token prediction (DeepSeek-V3, DeepSeek-AI 2024, section 2.2): ``model.mtp_depth``
modules after the main model, depth k predicting the token k + 1 ahead.

Depth k = 1 ... D is the module ``mtp.{k-1}`` of the model (:class:`MultiTokenPrediction`,
the model's extra training head "mtp", ``models/heads.py``). It keeps the causal chain: at
position i it combines the previous depth's hidden state (depth 0: the main model's last layer
output, before the final norm) with the embedding of the token k ahead,

    h_k(i) = Block_k(proj_k([enorm_k(Emb(t_{i+k})); hnorm_k(h_{k-1}(i))]))
    logits_k(i) = Output(norm_k(h_k(i)))        -- predicting t_{i+k+1}

``Emb`` and ``Output`` are the main model's (shared weights); ``Block_k`` is a decoder block
with layer id ``n_layers + k - 1`` (a MoE block when the model is MoE), its attention causal
over the positions of the sequence and masked like the main blocks (document masking, context
parallelism). The training objective adds ``mtp_loss_weight`` times the mean over depths of
the depth losses (``parallel/multi_token.py``); evaluation and generation run the main model only.

The data of depth k is a shift of the micro-batch's targets (``targets[j] = t_{j+1}``): at
position i it reads ``targets[i + k - 1]`` and predicts ``targets[i + k]``
(:func:`depth_inputs`). The last k positions of a sequence predict nothing (the token is past
the window): their loss weight is 0 and they read token 0 where the token is past the window
too (Megatron-Core's choice); the causal mask keeps them from every counted position.

Document masking: no prediction across a document boundary. With ``doc[j]`` the document of
the window's token t_j (j = 0 ... S: the S inputs and the last target), depth k's prediction
at position i counts only when ``doc[i + k + 1] == doc[i]``: the token it predicts, and so
(documents being contiguous) every token it reads, lie in i's document. The main loss is
document masking's as it was (attention only): its prediction at a document's last token is
the next document's first token, counted; depth k never makes that prediction -- at a
document's last k + 1 positions it predicts nothing. A document of n tokens thus gives depth k
``max(n - k - 1, 0)`` counted predictions (``counted_predictions``); the window's last token
t_S needs its document too (the sampler's ``target_docs``).

Memory (one rank): per depth one decoder block's activations, the two norms and ``proj``'s
(B, S, 2 h) input, and one more LM head pass (its logits or a chunk of them); weights
``2 h^2 + 3 h`` plus the block per depth (the embedding and head are shared). Compute per
depth and token: ``proj`` (2 h x h), the block and the LM head once more. No communication
here (parallelism adds its own: ``parallel/multi_token.py``, and as for any training head
``parallel/pipeline.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .heads import register_training_head
from .layers import RMSNorm

if TYPE_CHECKING:
    from .config import ModelConfig


class MTPDepth(nn.Module):
    """One depth: ``enorm``, ``hnorm``, ``proj`` (Linear 2 dim -> dim on
    ``[enorm(embedding ahead); hnorm(previous hidden)]``, DeepSeek's ``eh_proj``), a decoder
    ``block`` and the ``norm`` before the shared LM head.

    ``proj_in`` / ``proj_out``: what ``proj``'s input and output pass (identity by default;
    tensor parallelism makes ``proj`` column parallel around them)."""

    def __init__(self, dim: int, block: nn.Module, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.enorm, self.hnorm = norm(dim), norm(dim)
        self.proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = norm(dim)
        self.proj_in: nn.Module = nn.Identity()
        self.proj_out: nn.Module = nn.Identity()

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *doc_ids: torch.Tensor) -> torch.Tensor:
        """(B, S, dim) previous hidden states and embeddings of the tokens ahead -> this
        depth's hidden states (before ``norm``); ``cos``, ``sin``, ``doc_ids`` as the main
        blocks get them."""
        x = torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)
        return self.block(self.proj_out(self.proj(self.proj_in(x))), cos, sin, *doc_ids)


class MultiTokenPrediction(nn.ModuleList):
    """The model's extra training head ``mtp`` (``models/heads.py``): depth k + 1 is
    ``mtp.{k}``, an :class:`MTPDepth` whose block has layer id ``n_layers + k``.

    ``input``: the last layer's output of the last training forward (``keep``), which
    :meth:`predict_ahead` reads and drops."""

    reads_embedding = True  # (the tokens ahead: the pipeline keeps the table on the last stage)

    def __init__(self, depths: list[MTPDepth], first_layer: int) -> None:
        super().__init__(depths)
        self.first_layer = first_layer
        self.input: torch.Tensor | None = None

    def keep(self, h: torch.Tensor) -> None:
        self.input = h

    def blocks(self) -> dict[int, nn.Module]:
        """The depths' blocks by layer id (``n_layers + k``)."""
        return {self.first_layer + k: depth.block for k, depth in enumerate(self)}

    def predict_ahead(self, model: nn.Module, ids: list[torch.Tensor], seq_len: int
                      ) -> list[torch.Tensor]:
        """The depths on the last layer's output of ``model``'s last training forward:
        ``ids[k]`` (B, s) the token each position reads at depth k + 1; returns each depth's
        head output (logits, or the head's input when ``model.emit_hidden``). ``seq_len`` as
        for ``Transformer.run_layers``; document masking as the forward's."""
        if self.input is None:
            raise RuntimeError("predict_ahead needs a model with multi-token prediction "
                               "(model.mtp_depth > 0) after a training forward")
        h, self.input = self.input, None
        cos, sin = model.rope(seq_len)
        docs = () if model.doc_ids is None else (model.doc_ids,)
        outs = []
        for depth, tokens in zip(self, ids, strict=True):
            h = depth(h, model.tok_embeddings(tokens), cos, sin, *docs)
            x = model.head_input(depth.norm(h))
            outs.append(x if model.emit_hidden else model.output(x))
        return outs


@register_training_head("mtp")
def build_heads(cfg: ModelConfig, block: Callable[[int], nn.Module]
                ) -> MultiTokenPrediction | None:
    """``model.mtp_depth`` depths (None without any): depth k + 1's block is
    ``block(n_layers + k)``."""
    if not cfg.mtp_depth:
        return None
    return MultiTokenPrediction(
        [MTPDepth(cfg.dim, block(cfg.n_layers + k), lambda d: RMSNorm(d, cfg.norm_eps))
         for k in range(cfg.mtp_depth)], cfg.n_layers)


def depth_inputs(targets: torch.Tensor, k: int, positions: torch.Tensor | None = None,
                 doc_ids: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depth ``k`` (1-based) of whole sequences: (tokens read, tokens predicted, counted), each
    (B, s) at ``positions`` (global positions of the tokens held, e.g. a context-parallel
    share; None: all S).

    ``targets`` (B, S): the whole sequences' targets; ``doc_ids`` (B, S + 1): the documents of
    the whole windows' tokens t_0 ... t_S (document masking: position i counts when t_{i+k+1}
    is in i's document, see the module docstring). Predicted tokens that do not count are 0.
    """
    s = targets.shape[1]
    pos = (torch.arange(s, device=targets.device) if positions is None
           else positions.to(targets.device))
    read, ahead = pos + (k - 1), pos + k
    ids = targets[:, read.clamp(max=s - 1)].masked_fill(read >= s, 0)
    counted = (ahead < s).expand(targets.shape[0], -1)
    if doc_ids is not None:
        docs = doc_ids.to(targets.device)
        if docs.shape[-1] != s + 1:
            raise ValueError(f"document ids of {docs.shape[-1]} tokens: multi-token prediction "
                             f"needs the whole windows' S + 1 = {s + 1} (the targets' too)")
        # t_{i+k+1}, the predicted token, is window token i + k + 1 (clamped: not counted)
        counted = counted & (docs[:, (ahead + 1).clamp(max=s)] == docs[:, pos])
    predicted = targets[:, ahead.clamp(max=s - 1)].masked_fill(~counted, 0)
    return ids, predicted, counted


def counted_predictions(seq_len: int, k: int, doc_ids: torch.Tensor | None, batch: int
                        ) -> torch.Tensor | int:
    """How many predictions of depth ``k`` count in ``batch`` whole sequences of ``seq_len``
    (:func:`depth_inputs`'s ``counted``, summed): an int without document ids, else a tensor
    on their device (no host read); ``doc_ids`` (..., seq_len + 1) as there."""
    if doc_ids is None:
        return batch * max(seq_len - k, 0)
    return (doc_ids[..., k + 1:] == doc_ids[..., :-(k + 1)]).sum()


__all__ = ["MTPDepth", "MultiTokenPrediction", "build_heads", "counted_predictions",
           "depth_inputs"]
