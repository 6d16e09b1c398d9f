"""Single-process model tests: counts, RoPE, causality, GQA, MoE routing, init determinism."""

from __future__ import annotations

import math

import pytest
import torch

from meshlm.models import PRESETS, build_model, get_preset
from meshlm.models.llama import apply_rope, rope_tables
from meshlm.models.moe import MoE, load_balancing_loss, route_topk

# Published totals (model cards / papers), in billions of parameters.
PUBLISHED = {
    "llama3-8b": 8.03,
    "llama3-70b": 70.55,
    "llama3-405b": 405.85,
    "mixtral-8x7b": 46.70,
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_count_matches_meta_model(name: str) -> None:
    cfg = PRESETS[name]
    model = build_model(cfg, device="meta")  # shapes only: nothing allocated
    assert next(model.parameters()).device.type == "meta"
    # multi-token prediction's modules are built but not in the published-style total
    assert model.num_params() == cfg.num_params() + cfg.mtp_params()


@pytest.mark.parametrize("name,billions", sorted(PUBLISHED.items()))
def test_param_count_matches_published(name: str, billions: float) -> None:
    assert round(PRESETS[name].num_params() / 1e9, 2) == pytest.approx(billions, abs=0.01)


def test_mixtral_active_params_and_flops() -> None:
    mix = PRESETS["mixtral-8x7b"]
    assert round(mix.num_params(active=True) / 1e9, 1) == 12.9  # published "12.9B active"
    dense = PRESETS["llama3-8b"]
    # 6N + 12 L n_h d_h s, with N the matmul weights including the LM head
    n = dense.num_params() - dense.embedding_params() - (2 * dense.n_layers + 1) * dense.dim
    expected = 6 * n + 12 * dense.n_layers * dense.n_heads * dense.hd * 8192
    assert dense.flops_per_token(8192) == pytest.approx(expected, rel=1e-12)


def test_rope_matches_complex_reference() -> None:
    torch.manual_seed(0)
    b, nh, s, hd, theta = 2, 3, 11, 16, 500.0
    x = torch.randn(b, nh, s, hd, dtype=torch.float64)
    cos, sin = rope_tables(hd, 32, theta)
    got = apply_rope(x.float(), cos[:s], sin[:s]).double()
    # Reference: pair i with i + hd/2 as one complex number, multiply by exp(i * pos * freq_i).
    z = torch.complex(x[..., : hd // 2], x[..., hd // 2 :])
    freqs = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rot = torch.polar(torch.ones(s, hd // 2, dtype=torch.float64),
                      torch.arange(s, dtype=torch.float64)[:, None] * freqs[None])
    zr = z * rot
    ref = torch.cat([zr.real, zr.imag], dim=-1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # A rotation keeps norms, and position 0 is unchanged.
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, :, 0], x[:, :, 0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_causality(name: str) -> None:
    cfg = get_preset(name)
    model = build_model(cfg, seed=3).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    base = model(ids)
    for t in (0, 7, 23):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t], base[:, t])  # position t itself does change


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    gqa_cfg = get_preset("tiny").with_(n_heads=4, n_kv_heads=2)
    mha_cfg = gqa_cfg.with_(n_kv_heads=4)
    gqa, mha = build_model(gqa_cfg, seed=1).eval(), build_model(mha_cfg, seed=2).eval()
    rep = gqa_cfg.n_heads // gqa_cfg.n_kv_heads
    hd = gqa_cfg.hd
    with torch.no_grad():
        for name, p in mha.named_parameters():
            src = dict(gqa.named_parameters())[name]
            if name.endswith(("wk.weight", "wv.weight")):
                # (nkv*hd, h) -> (nkv, hd, h) -> repeat each KV head for its query group
                w = src.view(gqa_cfg.n_kv_heads, hd, -1).repeat_interleave(rep, dim=0)
                p.copy_(w.reshape(p.shape))
            else:
                p.copy_(src)
    ids = torch.randint(0, gqa_cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(gqa(ids), mha(ids), rtol=1e-5, atol=1e-5)


def test_moe_routes_each_token_to_k_experts_with_unit_weights() -> None:
    cfg = get_preset("tiny-moe")
    moe = MoE(cfg)
    torch.nn.init.normal_(moe.router.weight, std=0.5)
    x = torch.randn(3, 10, cfg.dim)
    logits = moe.router(x.reshape(-1, cfg.dim))
    probs, weights, idx = route_topk(logits, cfg.moe_topk)
    assert idx.shape == (30, cfg.moe_topk)
    assert all(len(set(row.tolist())) == cfg.moe_topk for row in idx)  # k distinct experts
    torch.testing.assert_close(weights.sum(-1), torch.ones(30))
    # the chosen experts are the k most probable ones
    torch.testing.assert_close(probs.gather(1, idx).min(-1).values,
                               probs.topk(cfg.moe_topk).values.min(-1).values)


def test_moe_output_equals_per_token_loop() -> None:
    cfg = get_preset("tiny-moe").with_(moe_shared_experts=0)
    model = build_model(cfg, seed=5)
    moe = model.layers["0"].feed_forward
    assert isinstance(moe, MoE)
    x = torch.randn(2, 5, cfg.dim)
    got = moe(x)
    flat = x.reshape(-1, cfg.dim)
    _, weights, idx = route_topk(moe.router(flat), cfg.moe_topk)
    ref = torch.zeros_like(flat)
    ex = moe.experts
    for t in range(flat.shape[0]):
        for j in range(cfg.moe_topk):
            e = int(idx[t, j])
            h = torch.nn.functional.silu(ex.w1[e] @ flat[t]) * (ex.w3[e] @ flat[t])
            ref[t] += weights[t, j] * (ex.w2[e] @ h)
    torch.testing.assert_close(got.reshape(-1, cfg.dim), ref, rtol=1e-5, atol=1e-6)


def test_aux_loss_hand_made_case() -> None:
    # 4 tokens, 2 experts, top-1: three tokens go to expert 0, one to expert 1.
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    idx = torch.tensor([[0], [0], [0], [1]])
    f = torch.tensor([3 / 4, 1 / 4])
    p = torch.tensor([(0.9 + 0.8 + 0.6 + 0.3) / 4, (0.1 + 0.2 + 0.4 + 0.7) / 4])
    expected = 2 * float((f * p).sum())
    assert float(load_balancing_loss(probs, idx, 2)) == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(2 * (0.75 * 0.65 + 0.25 * 0.35))
    # Perfect balance with uniform probabilities gives exactly 1.
    uniform = torch.full((4, 2), 0.5)
    assert float(load_balancing_loss(uniform, torch.tensor([[0], [1], [0], [1]]), 2)) == 1.0


def test_moe_aux_loss_reaches_the_model() -> None:
    cfg = get_preset("tiny-moe")
    model = build_model(cfg, seed=0)
    model(torch.randint(0, cfg.vocab_size, (2, 8)))
    aux = model.aux_loss()
    assert isinstance(aux, torch.Tensor) and aux.requires_grad
    assert float(aux.detach()) == pytest.approx(cfg.n_layers * cfg.moe_aux_loss_coef, rel=0.5)


def test_init_depends_only_on_seed_and_config() -> None:
    cfg = get_preset("tiny")
    a, b, c = build_model(cfg, seed=7), build_model(cfg, seed=7), build_model(cfg, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    # A parameter's init does not depend on the other layers: a deeper model shares layer 0.
    deep = build_model(cfg.with_(n_layers=4), seed=7)
    deep_p, a_p = dict(deep.named_parameters()), dict(a.named_parameters())
    for name in ("layers.0.attention.wq.weight", "layers.1.feed_forward.w1.weight"):
        assert torch.equal(deep_p[name], a_p[name]), name
    # residual output projections are scaled by 1/sqrt(2 L), so they differ by exactly that
    wo = "layers.0.attention.wo.weight"
    torch.testing.assert_close(deep_p[wo] * math.sqrt(2 * 4), a_p[wo] * math.sqrt(2 * 2))
    std = dict(a.named_parameters())["layers.0.attention.wo.weight"].std().item()
    assert std == pytest.approx(cfg.init_std / math.sqrt(2 * cfg.n_layers), rel=0.1)


def test_tied_embeddings_share_storage() -> None:
    cfg = get_preset("tiny").with_(tie_embeddings=True)
    model = build_model(cfg, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.num_params() == cfg.num_params()
