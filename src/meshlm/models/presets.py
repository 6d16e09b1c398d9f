"""Named model shapes, from test size to published frontier models.

Published shapes are copied from their model cards / config.json files (each cited beside it);
``meshlm info`` prints their parameter counts, tested against the published totals (Llama 3 8B
= 8.03 B; DeepSeek-V3 671 B total / 37 B active, its multi-token prediction module apart;
Qwen3-235B-A22B 235 B / 22 B; ``tests/test_frontier_presets.py``).
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
    # DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437, sec. 2
    # and 4.2): the shape of HF deepseek-ai/DeepSeek-V3 config.json (hidden_size 7168,
    # num_hidden_layers 61, num_attention_heads 128, q_lora_rank 1536, kv_lora_rank 512,
    # qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, vocab_size 129280,
    # n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, moe_intermediate_size
    # 2048, intermediate_size 18432, first_k_dense_replace 3, n_group 8, topk_group 4,
    # scoring_func sigmoid, routed_scaling_factor 2.5, norm_topk_prob true, topk_method noaux_tc,
    # rope_theta 10000, rope_scaling yarn factor 40 / original 4096 / beta 32, 1 / mscale 1,
    # mscale_all_dim 1, max_position_embeddings 163840, rms_norm_eps 1e-6,
    # num_nextn_predict_layers 1); the same numbers in deepseek-ai/DeepSeek-V3
    # inference/configs/config_671B.json. Training choices from the report's sec. 4.2: init
    # std 0.006, auxiliary-loss-free balancing with bias speed 0.001 (its complementary
    # sequence-wise loss, alpha 0.0001, is not combined with the bias here), MTP depth 1 with
    # weight 0.3 (first 10 T tokens). Published: 671 B total, 37 B (36.7 B) active, MTP module
    # 11.5 B unique parameters beside the shared embedding and head (README_WEIGHTS.md).
    "deepseek-v3": ModelConfig(
        name="deepseek-v3", vocab_size=129280, dim=7168, n_layers=61, n_heads=128,
        n_kv_heads=128, ffn_hidden=18432, norm_eps=1e-6, rope_theta=10000.0,
        max_seq_len=163840, init_std=0.006,
        moe_experts=256, moe_topk=8, moe_ffn_hidden=2048, moe_shared_experts=1,
        moe_first_dense=3, moe_aux_loss_coef=0.0001, moe_balance="bias", moe_bias_rate=0.001,
        moe_score="sigmoid", moe_norm_topk=True, moe_n_group=8, moe_topk_group=4,
        moe_routed_scale=2.5,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_factor=40.0, rope_original_max_len=4096, rope_beta_fast=32.0,
        rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        mtp_depth=1, mtp_loss_weight=0.3,
    ),
    # DeepSeek-V2-Lite (DeepSeek-AI 2024, "DeepSeek-V2", arXiv:2405.04434, appendix B): HF
    # deepseek-ai/DeepSeek-V2-Lite config.json (hidden_size 2048, num_hidden_layers 27,
    # num_attention_heads 16, q_lora_rank null, kv_lora_rank 512, qk_nope_head_dim 128,
    # qk_rope_head_dim 64, v_head_dim 128, vocab_size 102400, n_routed_experts 64,
    # num_experts_per_tok 6, n_shared_experts 2, moe_intermediate_size 1408, intermediate_size
    # 10944, first_k_dense_replace 1, n_group 1, topk_group 1, scoring_func softmax,
    # norm_topk_prob false, routed_scaling_factor 1.0, seq_aux true, aux_loss_alpha 0.001,
    # rope_theta 10000, rope_scaling yarn factor 40 / original 4096 / beta 32, 1 / mscale 0.707,
    # mscale_all_dim 0.707, max_position_embeddings 163840, rms_norm_eps 1e-6); the same shape
    # in deepseek-ai/DeepSeek-V3 inference/configs/config_16B.json. Published: 15.7 B total,
    # 2.4 B active.
    "deepseek-v2-lite": ModelConfig(
        name="deepseek-v2-lite", vocab_size=102400, dim=2048, n_layers=27, n_heads=16,
        n_kv_heads=16, ffn_hidden=10944, norm_eps=1e-6, rope_theta=10000.0,
        max_seq_len=163840,
        moe_experts=64, moe_topk=6, moe_ffn_hidden=1408, moe_shared_experts=2,
        moe_first_dense=1, moe_aux_loss_coef=0.001, moe_balance="seq_aux",
        moe_score="softmax", moe_norm_topk=False,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_factor=40.0, rope_original_max_len=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
        rope_mscale=0.707, rope_mscale_all_dim=0.707,
    ),
    # Qwen3-30B-A3B (Qwen Team 2025, "Qwen3 Technical Report", arXiv:2505.09388, table 2): HF
    # Qwen/Qwen3-30B-A3B config.json (hidden_size 2048, num_hidden_layers 48,
    # num_attention_heads 32, num_key_value_heads 4, head_dim 128, num_experts 128,
    # num_experts_per_tok 8, moe_intermediate_size 768, intermediate_size 6144 (no dense layer:
    # decoder_sparse_step 1, mlp_only_layers []), norm_topk_prob true, router_aux_loss_coef
    # 0.001, vocab_size 151936, rope_theta 1e6, max_position_embeddings 40960, rms_norm_eps
    # 1e-6, tie_word_embeddings false); query/key RMSNorm per head. Published: 30.5 B total,
    # 3.3 B active.
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", vocab_size=151936, dim=2048, n_layers=48, n_heads=32,
        n_kv_heads=4, head_dim=128, ffn_hidden=6144, norm_eps=1e-6, rope_theta=1e6,
        max_seq_len=40960, qk_norm=True,
        moe_experts=128, moe_topk=8, moe_ffn_hidden=768, moe_aux_loss_coef=0.001,
        moe_score="softmax", moe_norm_topk=True,
    ),
    # Qwen3-235B-A22B (the same report, table 2): HF Qwen/Qwen3-235B-A22B config.json
    # (hidden_size 4096, num_hidden_layers 94, num_attention_heads 64, num_key_value_heads 4,
    # head_dim 128, num_experts 128, num_experts_per_tok 8, moe_intermediate_size 1536,
    # intermediate_size 12288 (unused: every layer MoE), norm_topk_prob true, vocab_size 151936,
    # rope_theta 1e6, max_position_embeddings 40960, rms_norm_eps 1e-6). Published: 235 B
    # total, 22 B active.
    "qwen3-235b-a22b": ModelConfig(
        name="qwen3-235b-a22b", vocab_size=151936, dim=4096, n_layers=94, n_heads=64,
        n_kv_heads=4, head_dim=128, ffn_hidden=12288, norm_eps=1e-6, rope_theta=1e6,
        max_seq_len=40960, qk_norm=True,
        moe_experts=128, moe_topk=8, moe_ffn_hidden=1536, moe_aux_loss_coef=0.001,
        moe_score="softmax", moe_norm_topk=True,
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
