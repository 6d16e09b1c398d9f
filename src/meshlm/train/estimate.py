"""Memory estimate printed by ``meshlm train --dry-run`` (one rank, before anything runs).

States: fp32 weights 4Ψ + fp32 gradients 4Ψ + Adam moments 8Ψ bytes (Ψ = parameters).
Activations per layer and micro-batch (Korthikanti et al. 2022, eq. 1, no recomputation):
``s b h (34 + 5 a s / h)`` bytes at 2-byte precision; the 5as/h attention-score term is dropped
because SDPA does not store the score matrix, and the total is doubled for fp32. Logits add
``b s V`` values (fp32) for the loss.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config


def _vocab(cfg: Config) -> int:
    if cfg.data.tokenizer and Path(cfg.data.tokenizer).is_file():
        from ..data.tokenizer import Tokenizer

        return Tokenizer.load(cfg.data.tokenizer).vocab_size
    return cfg.data.vocab_size


def memory_estimate(cfg: Config) -> list[str]:
    mc = cfg.model_config(vocab_size=_vocab(cfg))
    n = mc.num_params()
    b, s, h = cfg.train.micro_batch, cfg.data.seq_len, mc.dim
    scale = 2.0 if cfg.precision.dtype == "fp32" else 1.0
    act_layer = s * b * h * 34 * scale
    acts = mc.n_layers * act_layer + 4 * b * s * mc.vocab_size * 2  # logits + their gradient
    states = 16 * n
    gib = 2**30
    return [
        f"# memory estimate per rank: model {mc.name}, {n / 1e6:.2f} M parameters",
        f"#   weights + grads + Adam: {states / gib:.3f} GiB (16 bytes/parameter)",
        f"#   activations (micro-batch {b} x {s}): {acts / gib:.3f} GiB",
        f"#   total: {(states + acts) / gib:.3f} GiB",
    ]
