"""Hugging Face interop: HF folders -> meshlm and meshlm -> HF folders give equal logits.

Models are built locally from tiny configs (hidden 64, 2 layers); nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

from meshlm.checkpoint.hf import (  # noqa: E402
    HFSource,
    hf_config_from_model,
    hf_name,
    is_hf_folder,
    iter_meshlm_names,
    meshlm_name,
    model_config_from_hf,
    write_hf,
)
from meshlm.checkpoint.state import CheckpointError  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.llama import Transformer, build_model  # noqa: E402

torch.set_num_threads(1)
Box = tuple[slice, ...]

LLAMA_KW = dict(vocab_size=1001, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False)
MIXTRAL_KW = dict(vocab_size=257, hidden_size=64, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=64, rope_theta=10000.0)
MESHLM_CFG = ModelConfig(vocab_size=333, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                         ffn_hidden=96, max_seq_len=64, rope_theta=500000.0, norm_eps=1e-6)


def full(shape: tuple[int, ...]) -> Box:
    return tuple(slice(0, n) for n in shape)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(7))


def hf_save(model_cls: type, config: object, path: Path, **save_kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(path, safe_serialization=True, **save_kw)
    return model


def meshlm_from(src: HFSource) -> Transformer:
    model = build_model(src.model_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(src.read(name, full(tuple(p.shape))))
    return model.eval()


@torch.no_grad()
def assert_same_logits(meshlm: Transformer, hf: torch.nn.Module, vocab: int) -> None:
    x = ids(vocab)
    assert rel_err(meshlm(x), hf(x).logits) < 1e-5


class DictSource:
    """A TensorSource over a dict of global tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self.tensors.get(name)
        return None if t is None else tuple(t.shape)

    def read(self, name: str, box: Box) -> torch.Tensor:
        return self.tensors[name][box].detach().float().clone()


def own_source(model: Transformer) -> DictSource:
    return DictSource(dict(model.named_parameters()))


# ---------------------------------------------------------------------------------- import


def test_llama_import_unusual_shape(tmp_path: Path) -> None:
    config = LlamaConfig(**LLAMA_KW, head_dim=32, attn_implementation="eager")
    hf = hf_save(LlamaForCausalLM, config, tmp_path)
    assert is_hf_folder(tmp_path) and not is_hf_folder(tmp_path / "nope")
    src = HFSource(tmp_path)
    cfg = src.model_config()
    assert (cfg.vocab_size, cfg.n_kv_heads, cfg.hd, cfg.rope_theta, cfg.tie_embeddings) == (
        1001, 2, 32, 500000.0, False)
    assert src.names() == [n for n, _ in iter_meshlm_names(cfg)]
    assert_same_logits(meshlm_from(src), hf, 1001)


def test_llama_import_tied_and_untied_target(tmp_path: Path) -> None:
    config = LlamaConfig(**{**LLAMA_KW, "tie_word_embeddings": True}, attn_implementation="eager")
    hf = hf_save(LlamaForCausalLM, config, tmp_path)
    src = HFSource(tmp_path)
    assert src.model_config().tie_embeddings and src.shape("output.weight") is None
    assert_same_logits(meshlm_from(src), hf, 1001)
    # An untied meshlm model reads the tied head from the embedding.
    untied = HFSource(tmp_path, src.model_config().with_(tie_embeddings=False))
    emb = untied.read("tok_embeddings.weight", full((1001, 64)))
    assert torch.equal(untied.read("output.weight", full((1001, 64))), emb)


def test_sharded_import_and_box_reads(tmp_path: Path) -> None:
    config = LlamaConfig(**LLAMA_KW, attn_implementation="eager")
    hf = hf_save(LlamaForCausalLM, config, tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    src = HFSource(tmp_path)
    assert_same_logits(meshlm_from(src), hf, 1001)
    name = "layers.1.attention.wk.weight"
    whole = src.read(name, full(src.shape(name)))
    box = (slice(8, 24), slice(3, 50, 2))
    assert torch.equal(src.read(name, box), whole[box])
    assert src.read(name, (slice(4, 4),)).shape == (0, 64)


@pytest.mark.parametrize("fused", [False, True])
def test_mixtral_import(tmp_path: Path, fused: bool) -> None:
    config = MixtralConfig(**MIXTRAL_KW, attn_implementation="eager")
    hf = hf_save(MixtralForCausalLM, config, tmp_path, save_original_format=not fused)
    keys = load_file(tmp_path / "model.safetensors").keys()
    per_expert = "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    assert (per_expert not in keys) == fused
    assert ("model.layers.0.mlp.experts.gate_up_proj" in keys) == fused
    src = HFSource(tmp_path)
    cfg = src.model_config()
    assert (cfg.moe_experts, cfg.moe_topk, cfg.expert_hidden) == (4, 2, 40)
    assert_same_logits(meshlm_from(src), hf, 257)

    # Stacked experts: a box reads only the experts (and rows) inside it.
    for proj in ("w1", "w3", "w2"):
        name = f"layers.1.feed_forward.experts.{proj}"
        whole = src.read(name, full(src.shape(name)))
        box = (slice(1, 3), slice(5, 17), slice(2, 30))
        assert torch.equal(src.read(name, box), whole[box])
    if not fused:
        seen: list[str] = []
        real = src._slice
        src._slice = lambda key, b: seen.append(key) or real(key, b)  # type: ignore[method-assign]
        src.read("layers.0.feed_forward.experts.w2", (slice(1, 3),))
        assert seen == [f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight" for e in (1, 2)]


# ---------------------------------------------------------------------------------- export


@pytest.mark.parametrize("tie", [False, True])
def test_llama_export(tmp_path: Path, tie: bool) -> None:
    cfg = MESHLM_CFG.with_(tie_embeddings=tie)
    model = build_model(cfg, seed=3).eval()
    shard = 60_000 if not tie else 5 * 2**30
    out = write_hf(tmp_path / "out", cfg, own_source(model), max_shard_bytes=shard)
    assert is_hf_folder(out)
    assert (out / "model.safetensors.index.json").is_file() != tie
    assert not [p for p in tmp_path.iterdir() if p.name != "out"]  # no temp dir left
    hf, info = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_same_logits(model, hf.eval(), cfg.vocab_size)
    # Round trip: reading the folder back gives the very tensors written.
    back = HFSource(out)
    assert back.model_config().with_(name=cfg.name) == cfg
    for name, p in model.named_parameters():
        assert torch.equal(back.read(name, full(tuple(p.shape))), p.detach())
    with pytest.raises(ValueError, match="not empty"):
        write_hf(out, cfg, own_source(model))


def test_mixtral_export(tmp_path: Path) -> None:
    cfg = MESHLM_CFG.with_(moe_experts=4, moe_topk=2, moe_ffn_hidden=48, moe_aux_loss_coef=0.02)
    model = build_model(cfg, seed=5).eval()
    out = write_hf(tmp_path / "out", cfg, own_source(model))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    hf, info = MixtralForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_same_logits(model, hf.eval(), cfg.vocab_size)
    back = model_config_from_hf(out)
    assert (back.moe_experts, back.moe_topk, back.expert_hidden) == (4, 2, 48)


def test_name_mapping_round_trip() -> None:
    cfg = MESHLM_CFG.with_(moe_experts=3)
    for name, shape in iter_meshlm_names(cfg):
        experts = range(shape[0]) if name.endswith(("experts.w1", "experts.w2", "experts.w3")) \
            else [None]
        for e in experts:
            assert meshlm_name(hf_name(name, e)) == (name, e)
    assert hf_name("layers.1.feed_forward.router.weight") == \
        "model.layers.1.block_sparse_moe.gate.weight"
    assert meshlm_name("model.layers.1.mlp.gate.weight")[0] == "layers.1.feed_forward.router.weight"


# ---------------------------------------------------------------------------------- refusals


def base_llama_dict() -> dict[str, object]:
    return LlamaConfig(**LLAMA_KW).to_dict() | {"architectures": ["LlamaForCausalLM"]}


@pytest.mark.parametrize("change, field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "rope_parameters"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"architectures": ["Qwen2ForCausalLM"]}, "architectures"),
])
def test_refused_hf_configs(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        model_config_from_hf(base_llama_dict() | change)


@pytest.mark.parametrize("kernel", ["sdpa", "eager", "flex"])
def test_mixtral_sliding_window_both_ways(tmp_path: Path, kernel: str) -> None:
    """Mixtral's ``sliding_window`` is ``model.sliding_window``: a window of 4 on 11 tokens
    gives HF's logits with every attention kernel, and exports as it came."""
    config = MixtralConfig(**MIXTRAL_KW, sliding_window=4, attn_implementation="eager")
    hf = hf_save(MixtralForCausalLM, config, tmp_path / "hf")
    src = HFSource(tmp_path / "hf")
    cfg = src.model_config()
    assert cfg.sliding_window == 4
    model = meshlm_from(src)
    windowless = build_model(cfg.with_(sliding_window=0))
    windowless.load_state_dict(model.state_dict())
    with torch.no_grad():  # (the window cuts here: not the windowless logits)
        assert rel_err(windowless.eval()(ids(257)), hf(ids(257)).logits) > 1e-3
    model = build_model(cfg.with_(attention=kernel))
    model.load_state_dict(meshlm_from(src).state_dict())
    assert_same_logits(model.eval(), hf, 257)
    assert hf_config_from_model(cfg)["sliding_window"] == 4
    with pytest.raises(ValueError, match="sliding_window=4: LlamaForCausalLM"):
        hf_config_from_model(MESHLM_CFG.with_(sliding_window=4))


def test_refused_mixtral_exports() -> None:
    d = MixtralConfig(**MIXTRAL_KW).to_dict() | {"architectures": ["MixtralForCausalLM"]}
    assert model_config_from_hf(d).moe_experts == 4
    assert model_config_from_hf(d | {"sliding_window": 64}).sliding_window == 0  # >= context
    moe = MESHLM_CFG.with_(moe_experts=4)
    with pytest.raises(ValueError, match="moe_shared_experts"):
        hf_config_from_model(moe.with_(moe_shared_experts=1))
    with pytest.raises(ValueError, match="moe_first_dense"):
        hf_config_from_model(moe.with_(moe_first_dense=1))


def test_missing_tensor_and_file(tmp_path: Path) -> None:
    config = LlamaConfig(**LLAMA_KW)
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    hf_save(LlamaForCausalLM, config, one)
    weights = load_file(one / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, one / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        HFSource(one)

    hf_save(LlamaForCausalLM, config, sharded, max_shard_size="100KB")
    victim = sorted(sharded.glob("model-*-of-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        HFSource(sharded)
    with pytest.raises(CheckpointError, match="config.json"):
        HFSource(tmp_path)
