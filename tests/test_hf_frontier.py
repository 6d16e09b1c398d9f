"""Hugging Face both ways for DeepSeek-V3, Qwen3-MoE and Qwen3 (``models/hf_config.py``,
``checkpoint/hf.py``, ``checkpoint/hf_names.py``).

Tiny random models built with ``transformers`` (nothing is downloaded), fp32, every weight
random (norm weights around 1, DeepSeek's ``e_score_correction_bias`` too) so no copy slip
hides behind a default value:

- DeepSeek-V3 with a query latent and YaRN (every knob away from its default), group-limited
  routing (n_group 2, topk_group 1), a dense first layer and a shared expert; without a query
  latent, plain RoPE; Qwen3-MoE (a dense first layer, ``norm_topk_prob`` false); Qwen3 (tied
  head, ``head_dim`` not ``hidden / heads``).
- ``load_model(folder)`` gives HF's logits. Error model: both sides run the same fp32 matmuls
  in other orders (~1e-6 relative on O(1) logits through 2-3 layers) and HF forms YaRN's angles
  in fp32, meshlm in float64 (~1e-5 relative on rotated features, see tests/test_mla.py): the
  logits agree to 1e-4 absolute.
- Weights round trip bit-exactly both ways: meshlm -> ``write_hf`` -> meshlm, and the HF folder
  -> meshlm -> ``write_hf`` holds the same keys and values as the HF folder (and transformers
  loads it with no missing or unexpected key, giving the very same logits).
- DeepSeek-V3's multi-token prediction layer as its checkpoints store it (decoder layer
  ``n_layers``, written into the safetensors here): its weights land in ``mtp.0`` (the copies
  of the embedding and head checked and dropped), its prediction equals HF's decoder layer run
  by hand on ``eh_proj([enorm(emb(t+1)); hnorm(h)])``, and it is written back as it was read;
  a folder whose copies differ, or that declares more layers than it holds, is refused.
- FP8 block-quantised weights (DeepSeek-V3 as published, blocks 8 x 8 here so that blocks cut
  the shapes) read as their dequantised values, box by box.
- The box reads a rank makes (rows of per-head weights with reordered rotary rows, some
  experts) equal the slices of the whole tensor; ``init_from`` a DeepSeek-V3 folder with
  multi-token prediction and selection biases in a spawned world of 2 (tp 2, then dp 2 + ep 2)
  gives the one-process run's losses, and ``meshlm convert`` writes the trained model (its
  moved biases included) as a folder transformers loads to the same logits.
- Every way a YaRN ``rope_parameters`` can give its scales reads as HF applies them (tables
  and DeepSeek's softmax factor), and back; what meshlm cannot express is refused by name,
  both ways; rotate-half DeepSeek folders (``rope_interleave`` false) and transformers 5's
  fused expert layout are read too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from meshlm import load_model  # noqa: E402
from meshlm.checkpoint.hf import HFSource, write_hf  # noqa: E402
from meshlm.checkpoint.state import CheckpointError  # noqa: E402
from meshlm.models.hf_config import (  # noqa: E402
    hf_architecture,
    hf_config_from_model,
    model_config_from_hf,
)
from meshlm.models.llama import Transformer  # noqa: E402

torch.set_num_threads(1)
Box = tuple[slice, ...]
VOCAB, S = 97, 12
DS_KW: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=4, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
    qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=10, n_group=2, topk_group=1,
    num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64,
    rms_norm_eps=1e-6, attn_implementation="eager",
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 16, "beta_fast": 24.0,
                     "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.7})
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek-v3": ("DeepseekV3", DS_KW),
    "deepseek-v3-no-q-latent": ("DeepseekV3", {
        **DS_KW, "q_lora_rank": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}),
    "qwen3-moe": ("Qwen3Moe", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0],
        max_position_embeddings=64, rope_parameters={"rope_type": "default",
                                                     "rope_theta": 1e6},
        attn_implementation="eager")),
    "qwen3": ("Qwen3", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
        tie_word_embeddings=True, attn_implementation="eager")),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every weight random (norms around 1, fan-in scaled elsewhere), selection biases too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else noise * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _hf_model(kind: str, **changes: Any) -> torch.nn.Module:
    prefix, kw = CONFIGS[kind]
    config = getattr(transformers, f"{prefix}Config")(**{**kw, **changes})
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    _randomise(model, 1)
    return model


def _ids(batch: int = 2, length: int = S) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(3))


def _full(shape: tuple[int, ...]) -> Box:
    return tuple(slice(0, n) for n in shape)


class DictSource:
    """A TensorSource over the parameters of a model."""

    def __init__(self, model: Transformer) -> None:
        self.tensors = dict(model.named_parameters())

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self.tensors.get(name)
        return None if t is None else tuple(t.shape)

    def read(self, name: str, box: Box) -> torch.Tensor:
        return self.tensors[name][box].detach().float().clone()


def _biases(model: Transformer) -> list[list[float]] | None:
    table = [[0.0] * model.cfg.moe_experts for _ in range(model.cfg.n_layers + model.cfg.mtp_depth)]
    found = False
    for i, block in model.blocks().items():
        bias = getattr(block.feed_forward, "expert_bias", None)
        if bias is not None:
            table[i], found = bias.double().tolist(), True
    return table if found else None


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Each tiny HF model and the folder ``save_pretrained`` wrote it to."""
    out = {}
    for kind in CONFIGS:
        model = _hf_model(kind)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        out[kind] = (path, model)
    return out


# ---------------------------------------------------------------------------------- logits


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_hf_folder_loads_with_hf_logits(kind: str, folders: dict) -> None:
    path, hf = folders[kind]
    model = load_model(path)
    cfg = model.cfg
    with torch.no_grad():
        got, want = model(_ids()), hf(_ids()).logits
    assert (got - want).abs().max().item() < 1e-4
    assert want.abs().max().item() > 1.0  # (not a vanishing signal)
    arch = {"deepseek-v3": "DeepseekV3ForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[kind.replace("-no-q-latent", "")]
    assert hf_architecture(cfg) == arch
    if kind == "deepseek-v3":
        assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                cfg.v_head_dim) == (24, 16, 10, 8, 12)
        assert (cfg.rope_factor, cfg.rope_original_max_len, cfg.rope_beta_fast,
                cfg.rope_beta_slow, cfg.rope_mscale, cfg.rope_mscale_all_dim) == \
            (4.0, 16, 24.0, 2.0, 0.8, 0.7)
        assert (cfg.moe_score, cfg.moe_n_group, cfg.moe_topk_group, cfg.moe_routed_scale,
                cfg.moe_shared_experts, cfg.moe_first_dense, cfg.moe_balance,
                cfg.mtp_depth) == ("sigmoid", 2, 1, 2.5, 1, 1, "bias", 0)
        assert any(any(row) for row in _biases(model))  # the folder's biases, not zeros
    if kind == "qwen3-moe":
        assert (cfg.qk_norm, cfg.moe_first_dense, cfg.moe_norm_topk, cfg.hd) == \
            (True, 1, False, 16)
    if kind == "qwen3":
        assert (cfg.qk_norm, cfg.tie_embeddings, cfg.hd, cfg.is_moe) == (True, True, 24, False)


# ---------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_weights_round_trip_both_ways(kind: str, folders: dict, tmp_path: Path) -> None:
    path, hf = folders[kind]
    model = load_model(path)
    out = write_hf(tmp_path / "out", model.cfg, DictSource(model),
                   expert_biases=_biases(model))
    # HF -> meshlm -> HF: the same keys and values
    theirs, ours = _tensors(path), _tensors(out)
    assert sorted(theirs) == sorted(ours)
    for k, v in theirs.items():
        assert v.dtype == torch.float32 and torch.equal(ours[k], v), k
    # meshlm -> HF -> meshlm: the same parameters and selection biases
    back = HFSource(out)
    assert back.model_config().with_(name=model.cfg.name) == model.cfg
    for name, p in model.named_parameters():
        assert torch.equal(back.read(name, _full(tuple(p.shape))), p.detach()), name
    assert back.expert_biases() == _biases(model)
    # transformers reads the folder with no key missing or unexpected: the same logits
    cls = type(hf)
    again, info = cls.from_pretrained(out, attn_implementation="eager",
                                      output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert torch.equal(again.eval()(_ids()).logits, hf(_ids()).logits)
    theirs_cfg = json.loads((path / "config.json").read_text())
    ours_cfg = hf_config_from_model(model.cfg)
    for key in ("rope_parameters", "q_lora_rank", "n_group", "topk_group", "num_experts",
                "mlp_only_layers", "norm_topk_prob", "head_dim", "tie_word_embeddings",
                "first_k_dense_replace", "routed_scaling_factor"):
        if key in theirs_cfg and key in ours_cfg:  # (DeepSeek's head_dim: not written)
            assert ours_cfg[key] == theirs_cfg[key], key


# ---------------------------------------------------------------------------------- MTP


def _mtp_folder(path: Path, **changes: Any) -> torch.nn.Module:
    """A DeepSeek-V3 folder as its checkpoints are: ``num_hidden_layers`` decoder layers plus
    one multi-token prediction layer (index ``num_hidden_layers``) with ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head`` and a copy of the embedding. Returns the HF model of one
    layer more, whose last layer is the prediction layer's block."""
    kw = {**DS_KW, **changes}
    n = kw["num_hidden_layers"]
    deeper = _hf_model("deepseek-v3", **{**changes, "num_hidden_layers": n + 1})
    deeper.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    dim = kw["hidden_size"]
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{n}.{norm}.weight"] = 1 + 0.2 * torch.randn(dim, generator=g)
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(dim, 2 * dim, generator=g) / 8
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[f"model.layers.{n}.embed_tokens.weight"] = \
        tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    return deeper


@torch.no_grad()
def _hf_mtp_logits(deeper: torch.nn.Module, tensors: dict[str, torch.Tensor],
                   x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's logits of the main model and of DeepSeek-V3's prediction of the token 2 ahead,
    by hand: the last layer of ``deeper`` on ``eh_proj([enorm(emb(t+1)); hnorm(h)])``."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    n, s = deeper.config.num_hidden_layers - 1, x.shape[1] - 1
    inputs, ahead = x[:, :s], x[:, 1:]
    m = deeper.model
    pos = torch.arange(s)[None].expand(x.shape[0], -1)
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    h = m.embed_tokens(inputs)
    pe = m.rotary_emb(h, pos)
    for layer in m.layers[:n]:
        h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    main = deeper.lm_head(m.norm(h))

    def norm(key: str) -> DeepseekV3RMSNorm:
        out = DeepseekV3RMSNorm(h.shape[-1], eps=deeper.config.rms_norm_eps)
        out.weight.copy_(tensors[f"model.layers.{n}.{key}.weight"])
        return out

    u = torch.cat([norm("enorm")(m.embed_tokens(ahead)), norm("hnorm")(h)], dim=-1)
    u = u @ tensors[f"model.layers.{n}.eh_proj.weight"].T
    u = m.layers[n](u, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    return main, deeper.lm_head(norm("shared_head.norm")(u))


def test_deepseek_mtp_layer_both_ways(tmp_path: Path) -> None:
    path = tmp_path / "mtp"
    deeper = _mtp_folder(path)
    tensors = load_file(path / "model.safetensors")
    model = load_model(path)
    assert model.cfg.mtp_depth == 1 and model.cfg.n_layers == 2
    # the layer's own weights are mtp.0's (the block's rotary rows reordered like any layer's)
    assert torch.equal(model.mtp[0].proj.weight, tensors["model.layers.2.eh_proj.weight"])
    assert torch.equal(model.mtp[0].norm.weight, tensors["model.layers.2.shared_head.norm.weight"])
    assert torch.equal(model.mtp[0].block.feed_forward.experts.w2[3],
                       tensors["model.layers.2.mlp.experts.3.down_proj.weight"])
    assert torch.equal(model.mtp[0].block.feed_forward.expert_bias,
                       tensors["model.layers.2.mlp.gate.e_score_correction_bias"])
    # its prediction is HF's layer 2 run as DeepSeek-V3's multi-token prediction module
    x = _ids(2, S + 1)
    want_main, want_mtp = _hf_mtp_logits(deeper, tensors, x)
    with torch.no_grad():
        assert (model(x[:, :S]) - want_main).abs().max().item() < 1e-4
    model.train()  # (a training forward keeps the last layer's output for predict_ahead)
    got_main = model(x[:, :S])
    got_mtp, = model.mtp.predict_ahead(model, [x[:, 1:]], S)
    assert (got_main - want_main).abs().max().item() < 1e-4
    assert (got_mtp - want_mtp).abs().max().item() < 1e-4
    # written back as it was read, copies included
    out = write_hf(tmp_path / "out", model.cfg, DictSource(model), expert_biases=_biases(model))
    back = _tensors(out)
    assert sorted(back) == sorted(tensors)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # a model without multi-token prediction reads the folder and leaves the layer out
    src = HFSource(path, model.cfg.with_(mtp_depth=0))
    assert not any(n.startswith("mtp.") for n in src.names())
    assert HFSource(path).for_model(model.cfg.with_(mtp_depth=0)).cfg.mtp_depth == 0


def test_deepseek_mtp_refusals(tmp_path: Path) -> None:
    path = tmp_path / "mtp"
    _mtp_folder(path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.2.shared_head.head.weight"][3, 5] += 1.0
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.shared_head\.head\.weight"):
        load_model(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 2}))
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers=2"):
        load_model(path)


# ---------------------------------------------------------------------------------- boxes, FP8


def _assert_boxes_are_slices(src: HFSource, names: list[str]) -> None:
    """Boxes a rank may read (blocks of rows, of columns, strided, some experts) equal the
    slices of the whole tensor."""
    g = torch.Generator().manual_seed(11)
    for name in names:
        shape = src.shape(name)
        assert shape is not None, name
        whole = src.read(name, _full(shape))
        for _ in range(6):
            box = []
            for n in shape:
                lo = int(torch.randint(0, n, (1,), generator=g))
                hi = int(torch.randint(lo + 1, n + 1, (1,), generator=g))
                box.append(slice(lo, hi, int(torch.randint(1, 3, (1,), generator=g))))
            assert torch.equal(src.read(name, tuple(box)), whole[tuple(box)]), (name, box)


BOX_NAMES = ["layers.0.attention.wq_b.weight", "layers.1.attention.wkv_a.weight",
             "layers.1.attention.wkv_b.weight", "layers.1.feed_forward.experts.w1",
             "layers.1.feed_forward.experts.w3", "layers.1.feed_forward.experts.w2",
             "layers.1.feed_forward.shared.w2.weight", "tok_embeddings.weight"]


def test_box_reads_are_slices(folders: dict) -> None:
    _assert_boxes_are_slices(HFSource(folders["deepseek-v3"][0]), BOX_NAMES)
    _assert_boxes_are_slices(HFSource(folders["deepseek-v3-no-q-latent"][0]),
                             ["layers.1.attention.wq.weight"])


def test_fp8_block_quantised_folder(folders: dict, tmp_path: Path) -> None:
    """DeepSeek-V3 as published: e4m3 weights with one fp32 ``weight_scale_inv`` per block
    (8 x 8 here: blocks cut every shape), read as their dequantised values."""
    path = folders["deepseek-v3"][0]
    fp8, plain = tmp_path / "fp8", tmp_path / "plain"
    fp8.mkdir()
    plain.mkdir()
    quantised, dequantised = {}, {}
    for key, w in _tensors(path).items():
        if w.dim() != 2 or not key.endswith("proj.weight"):
            quantised[key] = dequantised[key] = w
            continue
        blocks = w.reshape(-1).new_zeros(-(-w.shape[0] // 8), -(-w.shape[1] // 8))
        for i in range(blocks.shape[0]):
            for j in range(blocks.shape[1]):
                blocks[i, j] = w[8 * i:8 * i + 8, 8 * j:8 * j + 8].abs().max() / 448
        scale = blocks.repeat_interleave(8, 0)[:w.shape[0]].repeat_interleave(8, 1)[:, :w.shape[1]]
        q = (w / scale).to(torch.float8_e4m3fn)
        quantised[key], quantised[key + "_scale_inv"] = q, blocks
        dequantised[key] = q.float() * scale
    config = json.loads((path / "config.json").read_text())
    save_file(dequantised, plain / "model.safetensors", metadata={"format": "pt"})
    (plain / "config.json").write_text(json.dumps(config))
    save_file(quantised, fp8 / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic", "weight_block_size": [8, 8]}
    (fp8 / "config.json").write_text(json.dumps(config))
    a, b = load_model(fp8), load_model(plain)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(b.layers["1"].attention.wq_b.weight,
                           load_model(path).layers["1"].attention.wq_b.weight)  # (it rounded)
    _assert_boxes_are_slices(HFSource(fp8), BOX_NAMES)
    config["quantization_config"]["quant_method"] = "gptq"
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantization_config"):
        HFSource(fp8)


# ---------------------------------------------------------------------------------- configs


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}


@pytest.mark.parametrize("kind", ["deepseek-v3", "qwen3"])
@pytest.mark.parametrize("scales", [
    {"mscale": 0.8, "mscale_all_dim": 0.7},
    {"mscale": 0.8},  # (HF: the table by mscale(f, 1), mscale ignored)
    {"mscale_all_dim": 0.7},  # (HF: the table by mscale(f, 1), the scores by mscale_all_dim)
    {"attention_factor": 1.3, "mscale_all_dim": 0.7},
    {"attention_factor": 1.3, "mscale": 0.8, "mscale_all_dim": 0.7},
], ids=["both", "mscale", "mscale_all_dim", "factor", "factor-both"])
def test_yarn_scales_as_hugging_face_reads_them(kind: str, scales: dict[str, float]) -> None:
    """Each way a YaRN config.json can give its scales reads as HF applies them: the tables
    (to 1e-5: HF's angles are fp32) and latent attention's softmax factor; and the config
    meshlm writes for the shape reads back to the same tables and factor."""
    from meshlm.models.rope import model_rope_tables, score_scale

    prefix, kw = CONFIGS[kind]
    hf_cfg = getattr(transformers, f"{prefix}Config")(
        **{**kw, "rope_parameters": {**YARN, **scales}})
    module = getattr(transformers.models, prefix.lower().replace("v3", "_v3"))
    modeling = getattr(module, f"modeling_{prefix.lower().replace('v3', '_v3')}")
    rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(hf_cfg)
    x = torch.zeros(1, 32, 64)
    hf_cos, hf_sin = rotary(x, torch.arange(32)[None])
    d = hf_cfg.to_dict() | {"architectures": [f"{prefix}ForCausalLM"]}
    cfg = model_config_from_hf(d)
    for c in (cfg, model_config_from_hf(hf_config_from_model(cfg))):
        cos, sin = model_rope_tables(c)
        torch.testing.assert_close(cos[:32], hf_cos[0], rtol=0, atol=1e-5)
        half = cos.shape[1] // 2
        torch.testing.assert_close(sin[:32, half:], hf_sin[0, :, half:], rtol=0, atol=1e-5)
        if kind == "deepseek-v3":
            attention = modeling.DeepseekV3Attention(hf_cfg, 0)
            assert abs(attention.scaling * 18 ** 0.5 - score_scale(c)) < 1e-12


def _hf_dict(kind: str, **changes: Any) -> dict[str, Any]:
    prefix, kw = CONFIGS[kind]
    d = getattr(transformers, f"{prefix}Config")(**kw).to_dict()
    return d | {"architectures": [f"{prefix}ForCausalLM"]} | changes


@pytest.mark.parametrize("kind, change, field", [
    ("qwen3-moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen3-moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8,
               "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("deepseek-v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek-v3", {"topk_method": "greedy"}, "topk_method"),
    ("deepseek-v3", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("deepseek-v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek-v3", {"attention_bias": True}, "attention_bias"),
    ("deepseek-v3", {"rope_parameters": {**YARN, "truncate": False}}, "truncate"),
    ("deepseek-v3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                         "rope_theta": 1e4}}, "rope_parameters"),
])
def test_refused_hf_configs(kind: str, change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        model_config_from_hf(_hf_dict(kind, **change))


def test_config_mapping_details() -> None:
    qwen = model_config_from_hf(_hf_dict("qwen3-moe", mlp_only_layers=[0, 1]))
    assert (qwen.moe_first_dense, qwen.n_moe_layers) == (2, 1)
    assert model_config_from_hf(_hf_dict("qwen3-moe", decoder_sparse_step=3)).moe_first_dense == 2
    window = model_config_from_hf(_hf_dict("qwen3", use_sliding_window=True, sliding_window=8,
                                           max_window_layers=0, layer_types=None))
    assert window.sliding_window == 8
    assert hf_config_from_model(window)["layer_types"] == ["sliding_attention"] * 2
    assert model_config_from_hf(hf_config_from_model(window)).with_(name="x") == \
        window.with_(name="x")
    dense = model_config_from_hf(_hf_dict("deepseek-v3", first_k_dense_replace=2))
    assert not dense.is_moe and dense.is_mla
    assert model_config_from_hf(hf_config_from_model(dense)).with_(name="x") == \
        dense.with_(name="x")
    # an old-style file: rope_scaling with rope_theta beside it, DeepSeek's own keys
    old = {k: v for k, v in _hf_dict("deepseek-v3").items() if k != "rope_parameters"}
    old |= {"rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 16, "beta_fast": 24, "beta_slow": 2,
            "mscale": 0.8, "mscale_all_dim": 0.7}, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "num_nextn_predict_layers": 1, "aux_loss_alpha": 0.001}
    cfg = model_config_from_hf(old)
    assert (cfg.rope_factor, cfg.rope_mscale, cfg.mtp_depth, cfg.moe_aux_loss_coef) == \
        (4.0, 0.8, 1, 0.001)


@pytest.mark.parametrize("changes, field", [
    (dict(moe_score="sigmoid"), "kv_lora_rank"),
    (dict(qk_norm=True, moe_shared_experts=1), "moe_shared_experts"),
    (dict(qk_norm=True, moe_n_group=2, moe_topk_group=1), "moe_n_group"),
    (dict(moe_norm_topk=False), "moe_norm_topk"),
    (dict(moe_routed_scale=2.0), "moe_routed_scale"),
])
def test_refused_exports(changes: dict[str, Any], field: str) -> None:
    from meshlm.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=96, moe_experts=4, moe_topk=2, **changes)
    with pytest.raises(ValueError, match=field):
        hf_config_from_model(cfg)
    mla = model_config_from_hf(_hf_dict("deepseek-v3"))
    with pytest.raises(ValueError, match="qk_norm"):
        hf_config_from_model(mla.with_(qk_norm=True))


# ---------------------------------------------------------------------------------- trainer, CLI


def _train_losses(args: list[str]) -> dict[int, float]:
    from meshlm.config import load_config
    from meshlm.train.trainer import train

    return train(load_config(None, args), log=lambda _m: None, progress=False).losses


def test_init_from_deepseek_folder_in_a_world_and_convert(tiny_args: list[str],
                                                          tmp_path: Path) -> None:
    """``model.init_from`` a DeepSeek-V3 folder with multi-token prediction and non-zero
    selection biases: tp 2 (per-head boxes of reordered rotary rows) and dp 2 + ep 2 (some
    experts per rank) give the one-process run's losses (fp32, relative 1e-5 as every parity
    test), the biases moving at each step; ``meshlm convert`` then writes the trained model
    (its moved biases as ``e_score_correction_bias``) as a folder transformers loads."""
    from meshlm.testing import run_cli, run_world

    folder = tmp_path / "hf"
    _mtp_folder(folder, vocab_size=512)
    base = tiny_args + [f"--model.init_from={folder}", "--train.steps=2",
                        "--train.global_batch=4", "--train.micro_batch=2",
                        "--train.eval_every=0"]
    ref = _train_losses(base)
    runs = [["--parallel.tp=2", f"--run.dir={tmp_path / 'tp'}"],
            ["--parallel.dp=2", "--parallel.ep=2", f"--run.dir={tmp_path / 'ep'}"]]
    from meshlm.testing import train_runs

    for got in run_world(2, train_runs, base, runs)[0]:
        for step, loss in ref.items():
            assert abs(got[step] - loss) / loss < 1e-5, (step, got, ref)
    trained = load_model(tmp_path / "run")
    assert trained.cfg.mtp_depth == 1 and trained.cfg.moe_balance == "bias"
    out = tmp_path / "out"
    res = run_cli(["convert", str(tmp_path / "run"), "--to-hf", str(out)])
    assert res.returncode == 0, res.stderr
    assert "DeepseekV3ForCausalLM" in res.stdout
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager")
    # the folder's biases, moved by at most bias_rate per step (sign updates): loaded, trained
    # (fp32 biases of ~0.1: each step's sum rounds by at most ulp(0.25) / 2 = 1.5e-8)
    moved, start = torch.tensor(_biases(trained)), torch.tensor(_biases(load_model(folder)))
    assert 0 < (moved - start).abs().max() <= 2 * trained.cfg.moe_bias_rate + 1e-7
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf.eval()(x).logits - trained(x)).abs().max().item() < 1e-4
        assert torch.equal(load_model(out)(x), trained(x))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "model.layers.2.eh_proj.weight" in f.keys()


def test_other_layouts_of_the_same_models(tmp_path: Path) -> None:
    """A DeepSeek-V3 folder with rotate-half rotary rows (``rope_interleave`` false: read as
    they are) and a Qwen3-MoE folder in transformers 5's fused expert layout
    (``save_original_format=False``) give HF's logits; the export of the first is DeepSeek's
    usual interleaved layout, which transformers reads to the same logits."""
    hf = _hf_model("deepseek-v3", rope_interleave=False)
    hf.save_pretrained(tmp_path / "half")
    model = load_model(tmp_path / "half")
    qwen = _hf_model("qwen3-moe")
    qwen.save_pretrained(tmp_path / "fused", save_original_format=False)
    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in f.keys()
    out = write_hf(tmp_path / "out", model.cfg, DictSource(model), expert_biases=_biases(model))
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert again.config.rope_interleave
    with torch.no_grad():
        want = hf(_ids()).logits
        assert (model(_ids()) - want).abs().max().item() < 1e-4
        assert (again.eval()(_ids()).logits - want).abs().max().item() < 1e-4
        assert (load_model(tmp_path / "fused")(_ids()) - qwen(_ids()).logits).abs().max() < 1e-4
