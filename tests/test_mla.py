"""Multi-head latent attention (``models/mla.py``), YaRN (``models/rope.py``) and Qwen3's
query/key norm (``model.qk_norm``).

Against Hugging Face, fp32, weights copied (the rotary rows of ``wq`` / ``wq_b`` / ``wkv_a``
reordered from DeepSeek's interleaved pairs by :func:`~meshlm.models.mla.interleaved_to_half`):

- ``DeepseekV3Attention``, with and without the query latent, plain RoPE and YaRN (mscale and
  mscale_all_dim both set and different, so the table scale and the softmax scale both count);
- ``Qwen3Attention`` (grouped-query, ``q_norm`` / ``k_norm``), plain RoPE and YaRN;
- the YaRN tables themselves against ``DeepseekV3RotaryEmbedding``.

Error model of those comparisons: Hugging Face forms each rotary angle ``pos * inv_freq`` in
fp32 (ours in float64, rounded once): at positions below 32 the angle is off by at most
~2 ulp(32) = 8e-6 rad, so rotated components carry relative errors up to ~1e-5 (the tables:
atol 1e-5); every other step is a fp32 sum of at most 64 products (~1e-6 relative). The
attention outputs are compared by the relative norm of their difference, bound 1e-5.

The value head narrower than the query head reaches every kernel path: the fused CPU kernel
(ring blocks, padded), the math blocks, flex, and ring attention's dK/dV accumulator.

Layouts, fp32, one spawned world of 2 against one process (losses at each of 4 steps and final
weights, relative 1e-5 as in every parity test), a tiny MLA model (dim 64, 2 layers, 4 heads,
q_lora 32, kv_lora 16, nope 16, rope 8, v 16) with YaRN on (factor 4 over 32 positions of 64):
dp 2 + ZeRO-3, tp 2, tp 2 + sp, cp 2 ring / zigzag / Ulysses, pp 2 (1F1B, zero-bubble),
recomputation selective, op-level and full, the flex kernel under cp 2 zigzag, the chunked loss under tp 2 + sp; document
masking under cp 2 zigzag; the one-process flex and eager kernels and compiled blocks give the
sdpa run; the query without its latent (``wq``) under tp 2 + sp; a dense Qwen3-style model
(``qk_norm``) under tp 2 + sp and cp 2 Ulysses. With torchao, float8 linears (every MLA
projection converted) under dp 2, tp 2 + sp and cp 2 against one process in float8 (bounds
and why at ``FP8_REORDERED``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from meshlm.config import load_config
from meshlm.models import build_model, get_preset
from meshlm.models.config import ModelConfig
from meshlm.models.llama import Attention
from meshlm.models.mla import (
    MultiHeadLatentAttention,
    half_to_interleaved,
    interleaved_to_half,
)
from meshlm.models.rope import model_rope_tables, rope_tables
from meshlm.testing import (
    final_weights,
    max_relative_difference,
    relative_difference,
    run_world,
    train_runs,
)
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

transformers = pytest.importorskip("transformers")

H, NH, S = 64, 4, 20
MLA = dict(n_heads=NH, n_kv_heads=NH, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16)
# YaRN with every knob away from its default: factor 4 over an original context of 16
YARN = dict(rope_factor=4.0, rope_original_max_len=16, rope_beta_fast=24.0, rope_beta_slow=2.0,
            rope_mscale=0.8, rope_mscale_all_dim=0.7)


def _cfg(**changes: object) -> ModelConfig:
    return ModelConfig(name="t", vocab_size=64, dim=H, n_layers=1, max_seq_len=64,
                       norm_eps=1e-6, **changes)


def _rope_parameters(cfg: ModelConfig) -> dict:
    if cfg.rope_factor == 1:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
            "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
            "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim}


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Every weight of ``module`` random (norm weights around 1), so no copy slip hides."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else noise * p.shape[-1] ** -0.5)


def _causal(s: int) -> torch.Tensor:
    return torch.full((s, s), float("-inf")).triu(1)[None, None]


def _ours(att: torch.nn.Module, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    cos, sin = model_rope_tables(cfg)
    return att(x, cos[: x.shape[1]], sin[: x.shape[1]])


def _hf_rotary(module_cls: type, hf_cfg: object, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    return module_cls(hf_cfg)(x, pos)


def _deepseek(cfg: ModelConfig) -> tuple[torch.nn.Module, object]:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf_cfg = DeepseekV3Config(
        hidden_size=H, num_attention_heads=NH, num_key_value_heads=NH,
        q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, max_position_embeddings=cfg.max_seq_len, vocab_size=64,
        rope_parameters=_rope_parameters(cfg), attn_implementation="eager")
    att = DeepseekV3Attention(hf_cfg, 0)
    _randomise(att, 1)
    return att, hf_cfg


def _copy_deepseek(hf: torch.nn.Module, ours: MultiHeadLatentAttention, cfg: ModelConfig) -> None:
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    q = "q_b_proj" if cfg.q_lora_rank else "q_proj"
    sd[f"{q}.weight"] = interleaved_to_half(sd[f"{q}.weight"], NH, nope, rope)
    sd["kv_a_proj_with_mqa.weight"] = interleaved_to_half(sd["kv_a_proj_with_mqa.weight"], 1,
                                                          cfg.kv_lora_rank, rope)
    names = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_a_norm", "q_b_proj": "wq_b",
             "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "wkv_b",
             "o_proj": "wo"}
    renamed = {names[k.split(".")[0]] + ".weight": v for k, v in sd.items()}
    ours.load_state_dict(renamed, strict=True)


@pytest.mark.parametrize("q_lora", [32, 0], ids=["q-latent", "wq"])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_mla_matches_hugging_face_deepseek_v3(q_lora: int, yarn: bool) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    cfg = _cfg(**{**MLA, "q_lora_rank": q_lora, **(YARN if yarn else {})})
    hf, hf_cfg = _deepseek(cfg)
    ours = MultiHeadLatentAttention(cfg)
    _copy_deepseek(hf, ours, cfg)
    x = torch.randn(2, S, H, generator=torch.Generator().manual_seed(2))
    want = hf(x, _hf_rotary(DeepseekV3RotaryEmbedding, hf_cfg, x), _causal(S))[0]
    got = _ours(ours, cfg, x)
    assert relative_difference(got, want) < 1e-5
    # the scales are not no-ops here: YaRN's softmax factor, the table factor
    if yarn:
        assert ours.score_scale != 1.0 and abs(hf.scaling * 24**0.5 - ours.score_scale) < 1e-12


@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_qk_norm_attention_matches_hugging_face_qwen3(yarn: bool) -> None:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    # (HF's Qwen YaRN scales the tables by 0.1 ln f + 1: ours with mscale 1, mscale_all_dim 0)
    yarn_args = {**YARN, "rope_mscale": 1.0, "rope_mscale_all_dim": 0.0} if yarn else {}
    cfg = _cfg(n_heads=8, n_kv_heads=4, head_dim=16, qk_norm=True, **yarn_args)
    rp = _rope_parameters(cfg)
    hf_cfg = Qwen3Config(hidden_size=H, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
                         vocab_size=64, rope_parameters=rp, attn_implementation="eager")
    hf = Qwen3Attention(hf_cfg, 0)
    _randomise(hf, 3)
    ours = Attention(cfg)
    names = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "q_norm": "q_norm",
             "k_norm": "k_norm"}
    ours.load_state_dict({names[k.split(".")[0]] + ".weight": v
                          for k, v in hf.state_dict().items()}, strict=True)
    x = torch.randn(2, S, H, generator=torch.Generator().manual_seed(4))
    want = hf(x, _hf_rotary(Qwen3RotaryEmbedding, hf_cfg, x), _causal(S))[0]
    assert relative_difference(_ours(ours, cfg, x), want) < 1e-5


def test_yarn_tables_match_hugging_face() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    cfg = _cfg(**MLA, **YARN)
    hf_cfg = DeepseekV3Config(hidden_size=H, num_attention_heads=NH, qk_rope_head_dim=8,
                              max_position_embeddings=64, rope_parameters=_rope_parameters(cfg))
    x = torch.zeros(1, 32, H)
    hf_cos, hf_sin = _hf_rotary(DeepseekV3RotaryEmbedding, hf_cfg, x)
    cos, sin = model_rope_tables(cfg)
    torch.testing.assert_close(cos[:32], hf_cos[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(sin[:32, 4:], hf_sin[0, :, 4:], rtol=0, atol=1e-5)
    torch.testing.assert_close(sin[:32, :4], -hf_sin[0, :, :4], rtol=0, atol=1e-5)
    # YaRN changes the frequencies here (not only the scale) and leaves plain RoPE alone
    plain_cos, _ = rope_tables(8, 64, cfg.rope_theta)
    assert (cos[:32] / cos[:32, :1] - plain_cos[:32]).abs().max() > 0.1
    assert torch.equal(model_rope_tables(replace(cfg, rope_factor=1.0))[0], plain_cos)


def test_interleaved_rows_round_trip_and_bad_shapes() -> None:
    w = torch.arange(3 * 10 * 2, dtype=torch.float32).reshape(30, 2)
    half = interleaved_to_half(w, 3, 4, 6)
    assert torch.equal(half_to_interleaved(half, 3, 4, 6), w)
    assert half[4:10, 0].tolist() == [8.0, 12.0, 16.0, 10.0, 14.0, 18.0]  # head 0: even first
    assert torch.equal(half[:4], w[:4])  # plain rows stay
    with pytest.raises(ValueError, match="not 3 heads of 4 \\+ 5"):
        interleaved_to_half(torch.zeros(27, 2), 3, 4, 5)
    # the HF conversion's row permutation (models/mla_hf.py) is the same order
    from meshlm.models.mla_hf import interleaved_rows

    assert torch.equal(w[list(interleaved_rows(3, 4, 6))], half)
    assert torch.equal(w[:8][list(interleaved_rows(1, 0, 8))], interleaved_to_half(w[:8], 1, 0, 8))


def test_value_heads_narrower_than_query_heads_in_every_kernel_path() -> None:
    """sdpa's fused CPU block kernel (padded values), the math blocks, eager and flex: the
    output and gradients of (B, nh, S, 24) queries/keys on (B, nh, S, 16) values."""
    from meshlm.models.attention import Mask, build_kernel
    from meshlm.models.attention_blocks import block_backward, block_forward

    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 32, 24, generator=g), torch.randn(2, 4, 32, 24, generator=g)
    v, dy = torch.randn(2, 4, 32, 16, generator=g), torch.randn(2, 4, 32, 16, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = leaves[0] @ leaves[1].transpose(-1, -2) / 24**0.5
    want = s.masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), float("-inf"))
    want = want.softmax(-1) @ leaves[2]
    want.backward(dy)
    for path in ("flash", "math"):
        out, lse = block_forward(q, k, v, True, path)
        torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-5)
        grads = block_backward(dy, q, k, v, out, lse, True, path)
        for got, leaf in zip(grads, leaves, strict=True):
            torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-5)
    for name in ("sdpa", "eager", "flex"):
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        out = build_kernel(name)(*mine)
        out.backward(dy)
        torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-5)
        for got, leaf in zip(mine, leaves, strict=True):
            torch.testing.assert_close(got.grad, leaf.grad, rtol=1e-5, atol=1e-5)
    assert Mask.whole(32).plain_causal


def test_model_shapes_and_names() -> None:
    model = build_model(replace(get_preset("tiny"), **MLA))
    names = {n.split("attention.")[1] for n, _ in model.named_parameters() if ".0.attention." in n}
    assert names == {"wq_a.weight", "q_a_norm.weight", "wq_b.weight", "wkv_a.weight",
                     "kv_a_norm.weight", "wkv_b.weight", "wo.weight"}
    assert model.rope_cos.shape == (512, 8)
    direct = build_model(replace(get_preset("tiny"), **{**MLA, "q_lora_rank": 0}))
    assert "layers.0.attention.wq.weight" in dict(direct.named_parameters())
    qwen = build_model(replace(get_preset("tiny"), qk_norm=True))
    assert dict(qwen.named_parameters())["layers.1.attention.k_norm.weight"].shape == (8,)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_fp8_converts_every_mla_linear() -> None:
    from meshlm.parallel.float8 import Float8Converter, Float8Linear

    model = build_model(replace(get_preset("tiny"), **MLA))
    Float8Converter("tensorwise").convert(model)
    att = model.layers["1"].attention
    assert all(isinstance(getattr(att, n), Float8Linear)
               for n in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"))
    assert "layers.1.attention.wkv_b.weight" in dict(model.named_parameters())  # names kept


def test_layout_rules_know_mla() -> None:
    """MLA has one key/value head per query head: n_kv_heads plays no part in tp / Ulysses."""
    base = ["--model.preset=tiny", *[f"--model.{k}={v}" for k, v in MLA.items()],
            "--model.n_kv_heads=1", "--data.seq_len=64"]
    load_config(None, [*base, "--parallel.tp=2", "--parallel.cp=2",
                       "--parallel.cp_attention=ulysses", "--parallel.dp=1"])
    with pytest.raises(ValueError, match="does not divide the 1 query heads"):
        load_config(None, [*base, "--parallel.tp=4", "--parallel.cp=2",
                           "--parallel.cp_attention=ulysses"])


# ---------------------------------------------------------------------- layouts
STEPS = 4
MLA_ARGS = [f"--model.{k}={v}" for k, v in MLA.items()] + [
    "--model.rope_factor=4", "--model.rope_original_max_len=32", "--model.rope_mscale=0.8",
    "--model.rope_mscale_all_dim=0.7"]
QWEN = ["--model.qk_norm=true"]
TP_SP = ["--parallel.tp=2", "--parallel.sp=true"]
FP8 = ["--precision.dtype=fp8", "--precision.fp8_rest=fp32"]
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
EXACT = (1e-5, 1e-5)  # fp32: (relative loss difference at each step, final weights)
# float8 (tests/test_fp8.py, LAYOUTS): where the layout sums in another order (tp's partial
# sums, ring blocks) the next cast's inputs differ by fp32 rounding and an element at a float8
# rounding boundary flips by a whole float8 step; Adam's normalised update then moves that
# weight by up to lr per step, so how far the weights drift depends on how many elements sit
# at a boundary (here 4e-4 to 2e-2 by run, for grouped-query attention as for MLA): held to
# the losses, as test_fp8 holds ep. dp sums in the one-process order: fp32 rounding.
FP8_REORDERED: tuple[float, float | None] = (1e-4, None)
LAYOUTS = [  # (name, reference, arguments, bounds); MLA unless the name starts with qwen
    ("zero3", "mla", ["--parallel.dp=2", "--parallel.zero=3"], EXACT),
    ("tp2", "mla", ["--parallel.tp=2"], EXACT),
    ("tp2-sp", "mla", TP_SP, EXACT),
    ("cp2-ring", "mla", ["--parallel.cp=2", "--parallel.cp_attention=ring"], EXACT),
    ("cp2-zigzag", "mla", ["--parallel.cp=2", "--parallel.cp_attention=zigzag"], EXACT),
    ("cp2-ulysses", "mla", ["--parallel.cp=2", "--parallel.cp_attention=ulysses"], EXACT),
    ("pp2", "mla", ["--parallel.pp=2", "--train.micro_batch=2",
                    "--parallel.pp_schedule=1f1b"], EXACT),
    ("pp2-zb", "mla", ["--parallel.pp=2", "--train.micro_batch=2", "--parallel.pp_schedule=zb"],
     EXACT),
    ("dp2-selective", "mla", ["--parallel.dp=2", "--train.recompute=selective"], EXACT),
    ("dp2-op", "mla", ["--parallel.dp=2", "--train.recompute=op"], EXACT),
    ("dp2-full", "mla", ["--parallel.dp=2", "--train.recompute=full"], EXACT),
    ("cp2-zigzag-flex", "mla", ["--parallel.cp=2", "--model.attention=flex"], EXACT),
    ("tp2-sp-chunked", "mla", [*TP_SP, "--train.loss=chunked", "--train.loss_chunk=96"],
     EXACT),
    ("cp2-zigzag-docs", "mla-docs", ["--parallel.cp=2", "--data.doc_mask=true"], EXACT),
    ("tp2-sp-wq", "mla-wq", [*TP_SP, "--model.q_lora_rank=0"], EXACT),
    ("qwen-tp2-sp", "qwen", [*QWEN, *TP_SP], EXACT),
    ("qwen-cp2-ulysses", "qwen", [*QWEN, "--parallel.cp=2", "--parallel.cp_attention=ulysses"],
     EXACT),
    *([("fp8-dp2", "mla-fp8", [*FP8, "--parallel.dp=2"], (1e-6, 1e-6)),
       ("fp8-tp2-sp", "mla-fp8", [*FP8, *TP_SP], FP8_REORDERED),
       ("fp8-cp2-zigzag", "mla-fp8", [*FP8, "--parallel.cp=2"], FP8_REORDERED)]
      if HAS_TORCHAO else []),
]
REFERENCES = {  # one process: (arguments, bounds against the sdpa run or None: a reference)
    "mla": ([*MLA_ARGS], None),
    "mla-docs": ([*MLA_ARGS, "--data.doc_mask=true"], None),
    "mla-wq": ([*MLA_ARGS, "--model.q_lora_rank=0"], None),
    "qwen": (QWEN, None),
    **({"mla-fp8": ([*MLA_ARGS, *FP8], None)} if HAS_TORCHAO else {}),
    "mla-flex": ([*MLA_ARGS, "--model.attention=flex"], EXACT),
    "mla-eager": ([*MLA_ARGS, "--model.attention=eager"], EXACT),
    # inductor's fused loops sum in their own order: fp32 rounding, as flex's compiled run
    "mla-compiled": ([*MLA_ARGS, "--train.compile=true"], EXACT),
}


@pytest.fixture(scope="module")
def world(short_docs: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mla")
    base = ["--model.preset=tiny", f"--data.path={short_docs}", f"--data.cache_dir={cache_dir}",
            "--data.vocab_size=512", "--data.seq_len=64", f"--train.steps={STEPS}",
            "--train.global_batch=8", "--train.micro_batch=4", "--train.warmup_steps=2",
            "--train.eval_every=0", "--run.sample_tokens=0", "--train.peak_flops=1e10",
            "--train.eps=1e-5"]
    for name, (extra, _) in REFERENCES.items():
        train(load_config(None, [*base, *extra, f"--run.dir={root / name}"]),
              log=lambda _m: None, progress=False)
    runs = [[*(MLA_ARGS if not name.startswith("qwen") else []), *args,
             f"--run.dir={root / name}"] for name, _, args, _ in LAYOUTS]
    run_world(2, train_runs, base, runs)
    return root


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}


def _check(root: Path, name: str, ref: str, bounds: tuple[float, float | None]) -> None:
    want, got = _losses(root / ref), _losses(root / name)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), name
    worst = max(abs(got[s] - want[s]) / want[s] for s in want)
    weights, tensor = max_relative_difference(final_weights(root / name),
                                              final_weights(root / ref))
    print(f"{name}: loss {worst:.1e}, weights {weights:.1e} ({tensor})")
    assert worst < bounds[0], (name, worst)
    assert bounds[1] is None or weights < bounds[1], (name, tensor, weights)


@pytest.mark.parametrize("name", [n for n, (_, bounds) in REFERENCES.items() if bounds])
def test_one_process_kernels_and_compile_match_sdpa(name: str, world: Path) -> None:
    _check(world, name, "mla", REFERENCES[name][1])


@pytest.mark.parametrize("name", [name for name, *_ in LAYOUTS])
def test_layout_matches_one_process(name: str, world: Path) -> None:
    _, ref, _, bounds = next(row for row in LAYOUTS if row[0] == name)
    _check(world, name, ref, bounds)
