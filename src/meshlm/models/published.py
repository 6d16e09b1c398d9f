"""Shapes of published models, with their sources: what ``meshlm plan --model NAME`` knows.

Each entry is the model's shape as its paper or released config gives it, the MLP kind
(SwiGLU, or a two-matrix GELU/ReLU MLP) and whether the embeddings are tied, plus where each
number comes from. Fields a source leaves unsaid are marked in ``inferred`` and follow the
model's lineage (GPT-2's tokenizer and tied embeddings for GPT-3; 4 x hidden MLPs for
non-gated models). The planner reads these; the trainer's presets (``presets.py``) stay the
shapes meshlm trains.

``match(name)`` maps a run's free-text model name ("GPT-3 175B", "Llama-like 8B
(nanotron)") to an entry, for completing blank fields of published benchmark tables.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .config import ModelConfig
from .presets import PRESETS


@dataclass(frozen=True)
class Published:
    config: ModelConfig
    gated_mlp: bool  # SwiGLU (3 matrices) or a 2-matrix GELU/ReLU MLP
    source: str
    aliases: tuple[str, ...] = ()  # regexes (case-insensitive) over free-text model names
    inferred: tuple[str, ...] = field(default_factory=tuple)  # fields no source states
    train_batch: int = 0  # the published training global batch (sequences), 0: not stated


GPT3 = "Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1 (context 2048)"
LLAMA1 = "Touvron et al. 2023, 'LLaMA', Table 2 (context 2048, SentencePiece 32k)"
LLAMA2 = "Touvron et al. 2023, 'Llama 2', Table 1 / HF config.json (context 4096)"
NANOTRON = ("huggingface/nanotron scripts/scaling_benchmarks.py (the Ultra-Scale Playbook's "
            "benchmark configs: vocab 131072, seq 4096, kv_heads = heads, tied if ffn < 10000)")


def _gpt(name: str, layers: int, dim: int, heads: int, vocab: int = 50257,
         seq: int = 2048, head_dim: int = 0) -> ModelConfig:
    return ModelConfig(name=name, vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                       n_kv_heads=heads, ffn_hidden=4 * dim, max_seq_len=seq,
                       tie_embeddings=True, head_dim=head_dim)


def _llama(name: str, layers: int, dim: int, heads: int, kv: int, ffn: int, vocab: int,
           seq: int, tied: bool = False) -> ModelConfig:
    return ModelConfig(name=name, vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                       n_kv_heads=kv, ffn_hidden=ffn, max_seq_len=seq, tie_embeddings=tied)


_GPT3_SIZES = {  # name: (layers, d_model, heads[, d_head when heads x d_head != d_model])
    "gpt3-125m": (12, 768, 12), "gpt3-350m": (24, 1024, 16), "gpt3-760m": (24, 1536, 16),
    # the table prints 24 heads of 128 (3072 != 2048); its 1.3 B parameters are those of an
    # attention width of 2048: 16 heads of 128 here (the FLOPs are the same)
    "gpt3-1.3b": (24, 2048, 16), "gpt3-2.7b": (32, 2560, 32),
    "gpt3-6.7b": (32, 4096, 32),
    # the table prints d_model 5140; 40 heads of 128 are 5120
    "gpt3-13b": (40, 5120, 40), "gpt3-175b": (96, 12288, 96),
}

CATALOGUE: dict[str, Published] = {
    **{name: Published(_gpt(name, *dims), False, GPT3,
                       (rf"^gpt-?3[ -]{re.escape(name.split('-', 1)[1])}\b",),
                       ("vocab (GPT-2 BPE, 50257)", "tied embeddings", "ffn = 4 x hidden"))
       for name, dims in _GPT3_SIZES.items()},
    "mt-nlg-530b": Published(
        _gpt("mt-nlg-530b", 105, 20480, 128, vocab=50272), False,
        "Smith et al. 2022, 'Using DeepSpeed and Megatron to Train MT-NLG 530B', §2.4 "
        "(105 layers, hidden 20480, 128 heads, context 2048); vocabulary: GPT-2 BPE padded "
        "to 50272 as in cli99/llm-analysis' MT-NLG example",
        (r"^mt-?nlg\b",), ("tied embeddings", "ffn = 4 x hidden"),
        train_batch=1920),  # Smith et al. 2022 §3.2: batch size 1920 after the ramp-up
    "gopher-280b": Published(
        _gpt("gopher-280b", 80, 16384, 128, vocab=32000), False,
        "Rae et al. 2021, 'Scaling Language Models: Methods, Analysis & Insights from Training "
        "Gopher', Table 1 (80 layers, d_model 16384, 128 heads of 128) and §2 (SentencePiece "
        "32,000, context 2048)", (r"^gopher\b",),
        ("tied embeddings", "ffn = 4 x hidden (258 B counted vs the 280 B reported)")),
    "gpt-neox-20b": Published(
        ModelConfig(name="gpt-neox-20b", vocab_size=50432, dim=6144, n_layers=44, n_heads=64,
                    n_kv_heads=64, ffn_hidden=24576, max_seq_len=2048), False,
        "EleutherAI/gpt-neox configs/20B.yml; Black et al. 2022 (vocabulary 50257 padded to "
        "50432)", (r"^gpt-?neox-?20b",), ()),
    "bloom-176b": Published(
        _gpt("bloom-176b", 70, 14336, 112, vocab=250880), False,
        "BigScience 2022, BLOOM model card / Megatron-DeepSpeed bloom_176B config",
        (r"^bloom\b",), ("ffn = 4 x hidden",)),
    "opt-175b": Published(
        _gpt("opt-175b", 96, 12288, 96, vocab=50272), False,
        "Zhang et al. 2022, 'OPT', Table 1 (96 layers, 96 heads, d_model 12288; ReLU MLP of "
        "4 x hidden; context 2048)", (r"^opt-?175b",), ("vocabulary padding",)),
    **{f"llama1-{s}": Published(_llama(f"llama1-{s}", *d, 32000, 2048), True, LLAMA1,
                                (rf"^llama[- ]?1?[- ]{s}\b(?!.*llama ?[23])",), ())
       for s, d in {"7b": (32, 4096, 32, 32, 11008), "13b": (40, 5120, 40, 40, 13824),
                    "33b": (60, 6656, 52, 52, 17920), "65b": (80, 8192, 64, 64, 22016)}.items()},
    **{f"llama2-{s}": Published(_llama(f"llama2-{s}", *d, 32000, 4096), True, LLAMA2,
                                (rf"^llama[- ]?2[- ]{s}\b",), ())
       for s, d in {"7b": (32, 4096, 32, 32, 11008), "13b": (40, 5120, 40, 40, 13824),
                    "70b": (80, 8192, 64, 8, 28672)}.items()},
    **{name: Published(PRESETS[name], True,
                       "Meta 2024, 'The Llama 3 Herd of Models', Table 3; HF config.json "
                       "(training context 8192)", (rf"^llama[- ]?3(\.1)?[- ]{name[7:]}\b",))
       for name in ("llama3-8b", "llama3-70b", "llama3-405b")},
    "mixtral-8x7b": Published(PRESETS["mixtral-8x7b"], True,
                              "Jiang et al. 2024, 'Mixtral of Experts'; HF config.json",
                              (r"^mixtral[- ]8x7b",)),
    # frontier MoE (issue 49): the presets' shapes, sources cited beside them in presets.py
    "deepseek-v3": Published(
        PRESETS["deepseek-v3"], True,
        "DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report' (arXiv:2412.19437), sec. 2 and 4.2; "
        "HF deepseek-ai/DeepSeek-V3 config.json (MLA, 256 routed experts, MTP depth 1)",
        (r"^deepseek[- ]?v3\b",), (), train_batch=15360),  # sec. 4.2: 3072 -> 15360
    "deepseek-v2-lite": Published(
        PRESETS["deepseek-v2-lite"], True,
        "DeepSeek-AI 2024, 'DeepSeek-V2' (arXiv:2405.04434), appendix B; HF "
        "deepseek-ai/DeepSeek-V2-Lite config.json", (r"^deepseek[- ]?v2[- ]lite\b",), ()),
    **{name: Published(PRESETS[name], True,
                       "Qwen Team 2025, 'Qwen3 Technical Report' (arXiv:2505.09388), table 2; "
                       f"HF Qwen/{hf} config.json", (rf"^qwen[- ]?3[- ]{re.escape(name[6:])}\b",),
                       ())
       for name, hf in (("qwen3-30b-a3b", "Qwen3-30B-A3B"),
                        ("qwen3-235b-a22b", "Qwen3-235B-A22B"))},
    "nemotron-4-340b": Published(
        _llama("nemotron-4-340b", 96, 18432, 96, 8, 73728, 256000, 4096), False,
        "NVIDIA 2024, 'Nemotron-4 340B Technical Report'; NeMo Nemotron4Config340B "
        "(squared-ReLU MLP: two matrices)", (r"^nemotron-?4[- ]340b",), ()),
    "olmo-1b": Published(_llama("olmo-1b", 16, 2048, 16, 16, 8192, 50304, 2048, tied=True),
                         True, "allenai/OLMo configs/official/OLMo-1B.yaml (vocab 50280 padded "
                         "to 50304)", (r"^olmo[- ]1b",), ()),
    "olmo-7b": Published(_llama("olmo-7b", 32, 4096, 32, 32, 11008, 50304, 2048), True,
                         "allenai/OLMo configs/official/OLMo-7B.yaml", (r"^olmo[- ]7b",), ()),
    "mpt-7b": Published(_gpt("mpt-7b", 32, 4096, 32, vocab=50368), False,
                        "mosaicml/llm-foundry scripts/train/yamls/pretrain/mpt-7b.yaml",
                        (r"^mpt-?7b",), ()),
    "mpt-30b": Published(_gpt("mpt-30b", 48, 7168, 56, vocab=50368), False,
                         "mosaicml/llm-foundry scripts/train/yamls/pretrain/mpt-30b.yaml",
                         (r"^mpt-?30b",), ()),
    "nanotron-llama-1b": Published(
        _llama("nanotron-llama-1b", 16, 2048, 32, 32, 8192, 131072, 4096, tied=True), True,
        NANOTRON, (r"^llama-like 1b\b",), ()),
    "nanotron-llama-3b": Published(
        _llama("nanotron-llama-3b", 28, 3072, 32, 32, 8192, 131072, 4096, tied=True), True,
        NANOTRON, (r"^llama-like 3b\b",), ()),
    "nanotron-llama-8b": Published(
        _llama("nanotron-llama-8b", 32, 4096, 32, 32, 14336, 131072, 4096), True,
        NANOTRON, (r"^llama-like 8b\b",), ()),
    # the script's 70B entry: Llama-70B's shape with full multi-head attention is 80.0 B
    "nanotron-llama-80b": Published(
        _llama("nanotron-llama-80b", 80, 8192, 64, 64, 28672, 131072, 4096), True,
        NANOTRON + "; its '70B' entry with 64 KV heads counts 80.0 B: the playbook's 80B",
        (r"^llama-like 80b\b",), ("the 70B entry is the 80B model (by parameter count)",)),
}


def match(name: str) -> str | None:
    """The catalogue entry a free-text model name refers to (None when none does)."""
    text = name.strip().lower()
    for key, entry in CATALOGUE.items():
        if text == key or any(re.search(a, text) for a in entry.aliases):
            return key
    return None
