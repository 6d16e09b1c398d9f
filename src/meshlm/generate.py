"""Autoregressive sampling from a trained model (temperature + top-k), one process.

No KV cache: each new token re-runs the (short) context, cropped to ``max_seq_len``. Cost per
token is one forward over the context, fine for the small models meshlm trains on a laptop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


@torch.no_grad()
def sample_tokens(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    stop_id: int | None = None,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """Prompt followed by up to ``max_new_tokens`` sampled ids (stops early at ``stop_id``).

    ``forward`` maps (1, S) ids to (1, S, V) logits; default ``model`` itself (a parallel
    model passes a function that gathers its logit shards).
    """
    forward = forward or model
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    max_len = model.cfg.max_seq_len
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-max_len:]], device=device)
        logits = forward(context)[0, -1].float().cpu()  # (V,)
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = logits.topk(top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=g))
        if stop_id is not None and nxt == stop_id:
            break
        ids.append(nxt)
    model.train(was_training)
    return ids


def generate_text(model: nn.Module, tokenizer, prompt: str, max_new_tokens: int = 120,  # noqa: ANN001
                  temperature: float = 0.8, top_k: int = 50, seed: int = 0,
                  forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> str:
    """Decode prompt + sampled continuation."""
    ids = tokenizer.encode(prompt)
    out = sample_tokens(model, ids, max_new_tokens, temperature, top_k, seed, tokenizer.eot_id,
                        forward)
    return tokenizer.decode(out)
