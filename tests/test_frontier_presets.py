"""Frontier MoE presets and their counts (issue 49): DeepSeek-V3, DeepSeek-V2-Lite, Qwen3-MoE.

Every count of ``models/config.py`` against the model itself: ``sum(p.numel())`` of a model
built on the meta device (multi-head latent attention, Qwen3's query/key norms, multi-token
prediction, dense and MoE blocks), the training FLOPs against torch's FLOP counter on a real
forward + backward, and the presets' totals against the published figures. ``meshlm info``
prints total, active and multi-token prediction's parameters.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from meshlm.cli import main
from meshlm.models import PRESETS, build_model
from meshlm.models.config import ModelConfig

FRONTIER = ("deepseek-v3", "deepseek-v2-lite", "qwen3-30b-a3b", "qwen3-235b-a22b")
# tiny shapes of every feature the counts know (dim 64, 2 layers)
_MLA = dict(n_heads=4, n_kv_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=16)
_MOE = dict(moe_experts=4, moe_topk=2, moe_ffn_hidden=32, moe_shared_experts=1,
            moe_first_dense=1)
TINY = PRESETS["tiny"].with_(n_layers=2, max_seq_len=128)
SHAPES = {
    "mla": TINY.with_(**_MLA),
    "mla-no-query-latent": TINY.with_(**{**_MLA, "q_lora_rank": 0}),
    "mla-wide-values": TINY.with_(**{**_MLA, "v_head_dim": 24}),
    "qk-norm": TINY.with_(qk_norm=True, head_dim=16),
    "mla-moe-mtp2": TINY.with_(**_MLA, **_MOE, mtp_depth=2),
    "gqa-mtp1": TINY.with_(mtp_depth=1),
    "moe-mtp1-all-moe": TINY.with_(**{**_MOE, "moe_first_dense": 0}, mtp_depth=1),
}


def _attention_numel(block: torch.nn.Module) -> int:
    return sum(p.numel() for p in block.attention.parameters())


@pytest.mark.parametrize("name", [*FRONTIER, *SHAPES])
def test_counts_match_a_model_built_on_the_meta_device(name: str) -> None:
    """Totals, one layer's attention and the multi-token prediction modules, exactly."""
    cfg = PRESETS[name] if name in PRESETS else SHAPES[name]
    model = build_model(cfg, device="meta")
    assert model.num_params() == cfg.num_params() + cfg.mtp_params()
    for i, block in model.blocks().items():
        assert _attention_numel(block) == cfg.attention_params(), (name, i)
        assert sum(p.numel() for p in block.parameters()) == cfg.layer_params(i), (name, i)
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    assert mtp == cfg.mtp_params()
    for k in range(cfg.mtp_depth):
        assert sum(p.numel() for p in model.mtp[k].parameters()) == cfg.mtp_depth_params(k)
    norms = sum(p.numel() for n, p in model.named_parameters()
                if n.startswith("layers.0.attention.") and "norm" in n)
    assert norms == cfg.attention_norm_params()


def test_mla_attention_count_by_hand() -> None:
    """DeepSeek-V3's attention per layer, term by term (module docstring of models/config.py)."""
    c = PRESETS["deepseek-v3"]
    q = 7168 * 1536 + 1536 + 1536 * 128 * (128 + 64)
    kv = 7168 * (512 + 64) + 512 + 512 * 128 * (128 + 128)
    o = 128 * 128 * 7168
    assert c.attention_params() == q + kv + o == 187_107_328
    assert c.attention_norm_params() == 1536 + 512
    lite = PRESETS["deepseek-v2-lite"]  # no query latent: wq straight from the hidden state
    assert lite.attention_params() == (2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256
                                       + 16 * 128 * 2048)
    qwen = PRESETS["qwen3-30b-a3b"]  # q/k norms: 2 head_dim weights per layer
    assert qwen.attention_params() == 2048 * 4096 * 2 + 2 * 2048 * 512 + 2 * 128


# Published totals (billions), the unit of their last digit, and whether the publisher's
# "activated" count includes the input embedding. A published figure P with unit u stands for
# a count in [P - u/2, P + u): rounded or truncated -- both occur (Qwen3-30B-A3B's 3.35 B is
# "3.3B"; DeepSeek-V2-Lite's 2.45 B is "2.4B"). DeepSeek counts activated parameters without
# the embedding table (a lookup; V2-Lite: 2.66 B with it, 2.45 B without), Qwen with it (its
# model cards list "non-embedding" totals apart, without the embedding and the head).
PUBLISHED = {  # name: (total, active, unit, active includes the embedding)
    "deepseek-v3": (671.0, 37.0, 1.0, False),  # README: 671B / 37B activated
    "deepseek-v2-lite": (15.7, 2.4, 0.1, False),  # DeepSeek-V2 paper, appendix B
    "qwen3-30b-a3b": (30.5, 3.3, 0.1, True),  # model card: 30.5B / 3.3B, non-embedding 29.9B
    "qwen3-235b-a22b": (235.0, 22.0, 1.0, True),  # model card: 235B / 22B, non-embedding 234B
}
NON_EMBEDDING = {"qwen3-30b-a3b": (29.9, 0.1), "qwen3-235b-a22b": (234.0, 1.0)}


def _within(count: float, published: float, unit: float) -> bool:
    return published - unit / 2 <= count < published + unit


@pytest.mark.parametrize("name", FRONTIER)
def test_presets_count_the_published_totals(name: str) -> None:
    c = PRESETS[name]
    total, active, unit, with_embedding = PUBLISHED[name]
    assert _within(c.num_params() / 1e9, total, unit), c.num_params()
    counted = c.num_params(active=True) - (0 if with_embedding else c.embedding_params())
    assert _within(counted / 1e9, active, unit), counted
    if name in NON_EMBEDDING:
        published, u = NON_EMBEDDING[name]
        assert _within((c.num_params() - c.embedding_params() - c.head_params()) / 1e9,
                       published, u)


def test_deepseek_v3_multi_token_prediction_apart_from_the_total() -> None:
    """DeepSeek-V3's README_WEIGHTS.md: the main model 671 B (36.7 B activated, counted there
    without the embedding: meshlm 36.6 B); the MTP module 11.5 B unique parameters besides the
    shared embedding and head, 2.4 B activated with them. Both MTP figures are those of its
    decoder block alone: meshlm's ``mtp_params`` adds ``eh_proj`` (2 h^2 = 0.10 B) and the
    three norms (11.61 B)."""
    c = PRESETS["deepseek-v3"]
    assert c.mtp_depth == 1 and c.num_params() == 671_026_404_352
    assert abs((c.num_params(active=True) - c.embedding_params()) / 1e9 - 36.7) < 0.1
    own = 2 * c.dim * c.dim + 3 * c.dim  # proj + enorm, hnorm, norm
    assert _within((c.mtp_params() - own) / 1e9, 11.5, 0.1)
    shared = c.embedding_params() + c.head_params()
    assert _within((c.mtp_params(active=True) - own + shared) / 1e9, 2.4, 0.1)
    assert c.mtp_params() == c.layer_params(c.n_layers) + own  # one MoE block (layer id 61)
    assert c.is_moe_layer(c.n_layers)


def _grouped_mm_flops(a: tuple[int, ...], b: tuple[int, ...], *args: object,
                      out_shape: tuple[int, ...] | None = None, **kwargs: object) -> int:
    """``torch._grouped_mm``'s FLOPs (torch's counter has no formula for it): the experts'
    rows by their weights (2D x 3D), the weight gradients (2D x 2D, grouped along the rows:
    (K, M) x (M, N) -> (G, K, N)), or a batch (3D x 3D)."""
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 2:
        return 2 * a[0] * a[1] * b[-1]
    return 2 * a[0] * a[1] * a[2] * b[-1]


@pytest.mark.parametrize("name", list(SHAPES))
def test_flops_per_token_match_torch_flop_counter(name: str) -> None:
    """``flops_per_token`` (PaLM: 6 N_matmul + scores and values, MTP's proj, block and head
    pass included) equals what torch's FLOP counter sees on a training forward + backward, with
    the eager kernel (scores written out, as the convention counts them: no causal discount)
    and the grouped expert GEMMs counted as their rows times their expert's weights."""
    from torch.utils.flop_counter import FlopCounterMode

    grouped = getattr(torch.ops.aten, "_grouped_mm", None)
    mapping = {grouped: _grouped_mm_flops} if grouped is not None else {}
    cfg = SHAPES[name].with_(attention="eager")
    torch.manual_seed(0)
    model = build_model(cfg, 0)
    model.train()
    b, s = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (b, s + 1 + cfg.mtp_depth))
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        loss = model(ids[:, :s]).float().sum()
        if cfg.mtp_depth:
            ahead = [ids[:, k + 1:s + k + 1] for k in range(cfg.mtp_depth)]
            loss = loss + sum(o.float().sum() for o in model.mtp.predict_ahead(model, ahead, s))
        loss.backward()
    assert counter.get_total_flops() == cfg.flops_per_token(s) * b * s


def test_mla_flops_attention_term() -> None:
    """MLA's attention term runs over qk = nope + rope for the scores and v for the values."""
    c = PRESETS["deepseek-v3"]
    assert c.attention_flops(4096) == 6 * 128 * (192 + 128) * 4096
    dense = PRESETS["llama3-8b"]
    assert dense.attention_flops(8192) == 12 * 32 * 128 * 8192
    no_mtp = c.with_(mtp_depth=0)
    extra = (2 * c.dim * c.dim + c.layer_matmul_params(c.n_layers) + c.vocab_size * c.dim)
    assert c.flops_per_token(4096) - no_mtp.flops_per_token(4096) == 6 * extra + (
        c.attention_flops(4096))


def _info(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info", *args]) == 0
    return out.getvalue()


def test_info_prints_total_active_and_mtp_apart() -> None:
    rows = {r["preset"]: r for r in json.loads(_info("--json", "--seq-len", "4096"))}
    v3 = rows["deepseek-v3"]
    c = PRESETS["deepseek-v3"]
    assert (v3["params"], v3["active_params"]) == (c.num_params(), c.num_params(active=True))
    assert (v3["mtp_params"], v3["mtp_active_params"]) == (c.mtp_params(),
                                                           c.mtp_params(active=True))
    assert v3["mtp_depth"] == 1 and v3["attention"] == "MLA"
    assert v3["flops_per_token"] == c.flops_per_token(4096)
    assert rows["qwen3-235b-a22b"]["mtp_params"] == 0
    assert rows["qwen3-235b-a22b"]["attention"] == "GQA"
    assert "deepseek-v3-like" not in rows  # replaced by the published shape
    table = _info("--seq-len", "4096")
    assert "671.03 B" in table and "37.55 B" in table and "11.61 B" in table
    assert "MTP" in table and "MLA" in table


def test_presets_validate() -> None:
    for name in FRONTIER:
        c = PRESETS[name]
        assert not c.problems()
        assert ModelConfig.from_dict(c.to_dict()) == c
