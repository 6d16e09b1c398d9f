"""Named model shapes, from test size to published frontier models.

Published shapes are copied from their model cards / config.json files; ``meshlm info`` prints
their parameter counts (tested against the published totals, e.g. Llama 3 8B = 8.03 B).
"""

from __future__ import annotations

from .config import ModelConfig

_LLAMA3 = dict(vocab_size=128256, n_kv_heads=8, rope_theta=500000.0, max_seq_len=8192)

PRESETS: dict[str, ModelConfig] = {
    # Test sizes: hidden 64, 2 layers, grouped-query attention (8 query heads share 4 KV heads,
    # so tensor parallelism up to 4 splits both).
    "tiny": ModelConfig(
        name="tiny", vocab_size=512, dim=64, n_layers=2, n_heads=8, n_kv_heads=4,
        ffn_hidden=176, max_seq_len=512,
    ),
    "tiny-moe": ModelConfig(
        name="tiny-moe", vocab_size=512, dim=64, n_layers=2, n_heads=8, n_kv_heads=4,
        ffn_hidden=176, max_seq_len=512, moe_experts=4, moe_topk=2, moe_ffn_hidden=64,
        moe_shared_experts=1,
    ),
    # The default run: a few minutes on a 2-core CPU.
    "small": ModelConfig(
        name="small", vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
        ffn_hidden=688, max_seq_len=1024, tie_embeddings=True,
    ),
    # Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, table 3; HF config.json).
    "llama3-8b": ModelConfig(
        name="llama3-8b", dim=4096, n_layers=32, n_heads=32, ffn_hidden=14336, **_LLAMA3
    ),
    "llama3-70b": ModelConfig(
        name="llama3-70b", dim=8192, n_layers=80, n_heads=64, ffn_hidden=28672, **_LLAMA3
    ),
    "llama3-405b": ModelConfig(
        name="llama3-405b", dim=16384, n_layers=126, n_heads=128, ffn_hidden=53248, **_LLAMA3
    ),
    # Mixtral 8x7B (Jiang et al. 2024; HF config.json): 46.7 B total, 12.9 B active.
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        ffn_hidden=14336, rope_theta=1e6, max_seq_len=32768, moe_experts=8, moe_topk=2,
    ),
    # DeepSeek-V3-like (DeepSeek-AI 2024): 61 layers, first 3 dense, 256 routed experts of
    # width 2048 with top-8 routing and 1 shared expert. Attention is grouped-query here (128
    # heads of 128, 8 KV heads) instead of multi-head latent attention, and there is no
    # multi-token-prediction module, so totals differ slightly from the published 671 B.
    "deepseek-v3-like": ModelConfig(
        name="deepseek-v3-like", vocab_size=129280, dim=7168, n_layers=61, n_heads=128,
        n_kv_heads=8, head_dim=128, ffn_hidden=18432, rope_theta=10000.0, max_seq_len=4096,
        moe_experts=256, moe_topk=8, moe_ffn_hidden=2048, moe_shared_experts=1,
        moe_first_dense=3, moe_aux_loss_coef=0.001,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``; a ValueError lists the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"model.preset={name!r} is not a preset (valid: {', '.join(PRESETS)})"
        ) from None
