"""Whole-vocabulary logits of a parallelised model, for sampling at the end of training.

Every rank calls :func:`full_logits` with the same ids and gets the same (B, S, V) logits: the
last pipeline stage broadcasts its output over pp, and vocabulary shards are all-gathered over
tp. Under sequence parallelism the context is cropped and right-padded to a multiple of tp
(padding after the last position does not change causal logits). Communication per call:
B S V / tp values broadcast over pp, B S V gathered over tp. Memory: the full logits of one
context on every rank (sampling only; training never gathers them).
"""

from __future__ import annotations

import torch

from ..models.llama import Transformer
from ..parallel.tensor import TensorParallel
from .pipelined import PipelineRunner


def full_logits(model: Transformer, tp: TensorParallel | None, pipeline: PipelineRunner | None,
                ids: torch.Tensor) -> torch.Tensor:
    """(B, S, V) logits of the whole vocabulary, whatever the layout (collective)."""
    if tp is None and pipeline is None:
        return model(ids)
    cfg = model.cfg
    sp = tp is not None and tp.sp
    if sp:  # sequence shards need s % tp == 0 within the rotary table
        ids = ids[:, -(cfg.max_seq_len - cfg.max_seq_len % tp.size):]
    s = ids.shape[1]
    pad = (-s) % tp.size if sp else 0
    if pad:
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], pad)], dim=1)
    if pipeline is None:
        logits = model(ids)
    else:
        v_local = cfg.vocab_size if tp is None else -(-cfg.vocab_size // tp.size)
        logits = pipeline.logits(ids, v_local)
    if tp is not None:
        logits = tp.full_logits(logits)
    return logits[:, :s]
