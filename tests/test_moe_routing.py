"""MoE routing as published, against Hugging Face transformers' own modules (fp32, copied
weights):

- :func:`route_topk` equals ``DeepseekV3TopkRouter`` (sigmoid scores, the selection bias,
  group-limited top-k, renormalised gates times ``routed_scaling_factor``, and without
  groups / renormalisation) and ``Qwen3MoeTopKRouter`` (softmax, ``norm_topk_prob`` true and
  false): the same experts, and gates within ``(k + 1)`` units in the last place -- the same
  operations but for the order of the k-term sum of the renormalisation;
- the whole MoE layer equals ``DeepseekV3MoE`` (routed + shared experts) and
  ``Qwen3MoeSparseMoeBlock``, output and the gradients of its input, router and experts:
  measured against a float64 run of the Hugging Face module, the layer's fp32 error is at most
  twice Hugging Face's own fp32 error (and under 1e-6 from Hugging Face's fp32 result);
- the balancing losses use the right probabilities: ``seq_aux`` with sigmoid scores is
  DeepSeek-V3's sequence-wise loss (eqs. 17-20: scores normalised per token), written out here;
  ``aux`` with softmax is Hugging Face's Qwen3-MoE ``load_balancing_loss_func`` divided by k
  (transformers counts the k choices of a token as k tokens' worth of f);
- the load metrics of each MoE layer in a tiny run's records (max and mean load, experts
  without tokens, dropped copies, the bias spread), as TensorBoard scalars, and in the report.
"""

from __future__ import annotations

import copy

import pytest
import torch

from meshlm.models.config import ModelConfig
from meshlm.models.moe import (
    MoE,
    Routing,
    load_balancing_loss,
    route_topk,
    sequence_balancing_loss,
)

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, Qwen3MoeConfig  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3MoE,
    DeepseekV3TopkRouter,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import (  # noqa: E402
    Qwen3MoeSparseMoeBlock,
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)

H, F, E, K, T = 64, 32, 16, 4, 96
U = 2.0**-24  # fp32 unit roundoff


def _deepseek_config(n_group: int, topk_group: int, norm: bool, scale: float
                     ) -> DeepseekV3Config:
    return DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K,
                            n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale,
                            norm_topk_prob=norm, moe_intermediate_size=F, n_shared_experts=1,
                            vocab_size=64, num_hidden_layers=1)


def _sorted(idx: torch.Tensor, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts in increasing id order, with their gates (Hugging Face's top-k is
    unsorted)."""
    order = idx.argsort(dim=-1)
    return idx.gather(1, order), gates.gather(1, order)


def _check_router(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]
                  ) -> None:
    idx, gates = _sorted(*ours)
    ref_idx, ref_gates = _sorted(*theirs)
    assert torch.equal(idx, ref_idx)
    # the same operations but for the order of the k-term sum: (k - 1) u for the sum, u for
    # the division, u for the scale
    rel = ((gates - ref_gates).abs() / ref_gates.abs()).max().item()
    assert rel <= (K + 1) * U, rel


@pytest.mark.parametrize(("n_group", "topk_group", "norm", "scale", "bias"), [
    (4, 2, True, 2.5, True),  # DeepSeek-V3's kind: groups, bias, renormalised, scaled
    (4, 1, True, 1.0, False),
    (1, 1, False, 1.5, True),  # no groups, raw sigmoid gates
])
def test_route_topk_equals_deepseek_v3_router(n_group: int, topk_group: int, norm: bool,
                                              scale: float, bias: bool) -> None:
    g = torch.Generator().manual_seed(11)
    hf = DeepseekV3TopkRouter(_deepseek_config(n_group, topk_group, norm, scale))
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, H, generator=g) * 0.2)
        if bias:
            hf.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    x = torch.randn(T, H, generator=g)
    _, ref_gates, ref_idx = hf(x)
    routing = Routing("sigmoid", norm, n_group, topk_group, scale)
    probs, gates, idx = route_topk(x @ hf.weight.t(), K,
                                   hf.e_score_correction_bias if bias else None, routing)
    _check_router((idx, gates), (ref_idx, ref_gates.detach()))
    if n_group > 1:  # every choice inside its token's topk_group best groups
        groups = torch.zeros(T, n_group).scatter_(1, idx // (E // n_group), 1.0).sum(dim=1)
        assert groups.max() <= topk_group
    scores = (x @ hf.weight.t()).sigmoid()
    torch.testing.assert_close(probs, scores / scores.sum(-1, keepdim=True), rtol=0, atol=0)


@pytest.mark.parametrize("norm", [True, False])
def test_route_topk_equals_qwen3_router(norm: bool) -> None:
    g = torch.Generator().manual_seed(12)
    hf = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K,
                                           moe_intermediate_size=F, norm_topk_prob=norm))
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, H, generator=g) * 0.2)
    x = torch.randn(T, H, generator=g)
    _, ref_gates, ref_idx = hf(x)
    probs, gates, idx = route_topk((x @ hf.weight.t()).detach(), K,
                                   routing=Routing("softmax", norm))
    _check_router((idx, gates), (ref_idx, ref_gates.detach()))
    if not norm:  # the raw probabilities of the chosen experts, bit for bit
        assert torch.equal(gates, probs.gather(1, idx))


# ---------------------------------------------------------------------- the whole layer
def _meshlm_layer(**changes: object) -> MoE:
    cfg = ModelConfig(name="t", vocab_size=64, dim=H, n_layers=1, n_heads=4, n_kv_heads=4,
                      ffn_hidden=64, moe_experts=E, moe_topk=K, moe_ffn_hidden=F, **changes)
    return MoE(cfg)


def _copy_experts(moe: MoE, hf: torch.nn.Module) -> None:
    """Hugging Face's (E, 2F, H) ``gate_up_proj`` = [w1 | w3] per expert, ``down_proj`` = w2."""
    with torch.no_grad():
        moe.router.weight.copy_(hf.gate.weight)
        moe.experts.w1.copy_(hf.experts.gate_up_proj[:, :F])
        moe.experts.w3.copy_(hf.experts.gate_up_proj[:, F:])
        moe.experts.w2.copy_(hf.experts.down_proj)


def _randomise(module: torch.nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _grads(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, hf: bool
           ) -> dict[str, torch.Tensor]:
    """Output and gradients of x, the router and the experts, in meshlm's names."""
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(dy.to(y.dtype))
    if hf:
        up = module.experts.gate_up_proj.grad
        return {"y": y, "x": x.grad, "router": module.gate.weight.grad, "w1": up[:, :F],
                "w3": up[:, F:], "w2": module.experts.down_proj.grad}
    return {"y": y, "x": x.grad, "router": module.router.weight.grad,
            **{n: getattr(module.experts, n).grad for n in ("w1", "w3", "w2")}}


def _check_layer(ours: torch.nn.Module, hf: torch.nn.Module, x: torch.Tensor) -> None:
    """Output and gradients: ours within twice Hugging Face's own fp32 error against Hugging
    Face in float64 (its router runs in fp32 either way: the same experts are chosen)."""
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    got, ref = _grads(ours, x, dy, False), _grads(hf, x, dy, True)
    exact = _grads(copy.deepcopy(hf).double(), x.double(), dy.double(), True)
    for name, value in got.items():
        ours_err, hf_err = _relative(value, exact[name]), _relative(ref[name], exact[name])
        assert ours_err <= 2 * hf_err + U and _relative(value, ref[name]) < 1e-6, (
            name, ours_err, hf_err)


def test_moe_layer_equals_deepseek_v3_moe() -> None:
    g = torch.Generator().manual_seed(13)
    hf = DeepseekV3MoE(_deepseek_config(4, 2, True, 2.5))
    _randomise(hf, g)
    with torch.no_grad():
        hf.gate.weight.mul_(4.0)  # (peaked routing)
        hf.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    moe = _meshlm_layer(moe_shared_experts=1, moe_score="sigmoid", moe_n_group=4,
                        moe_topk_group=2, moe_routed_scale=2.5, moe_balance="bias")
    _copy_experts(moe, hf)
    with torch.no_grad():
        moe.expert_bias.copy_(hf.gate.e_score_correction_bias)
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            getattr(moe.shared, ours).weight.copy_(getattr(hf.shared_experts, theirs).weight)
    _check_layer(moe, hf, torch.randn(2, T // 2, H, generator=g))


@pytest.mark.parametrize("norm", [True, False])
def test_moe_layer_equals_qwen3_sparse_moe_block(norm: bool) -> None:
    g = torch.Generator().manual_seed(14)
    hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=H, num_experts=E,
                                               num_experts_per_tok=K, moe_intermediate_size=F,
                                               norm_topk_prob=norm))
    _randomise(hf, g)
    moe = _meshlm_layer(moe_score="softmax", moe_norm_topk=norm)
    _copy_experts(moe, hf)
    _check_layer(moe, hf, torch.randn(2, T // 2, H, generator=g))


# ---------------------------------------------------------------------- balancing losses
def test_sequence_loss_of_sigmoid_scores_is_deepseek_v3s() -> None:
    """DeepSeek-V3 eqs. 17-20 per sequence: f_i = E / (k S) * (copies to i), P_i = mean over
    the sequence of s_i,t / sum_j s_j,t; the loss is sum_i f_i P_i, averaged over sequences."""
    g = torch.Generator().manual_seed(15)
    batch, seq = 3, 16
    logits = torch.randn(batch * seq, E, generator=g)
    routing = Routing("sigmoid", True, 4, 2, 2.5)
    probs, _, idx = route_topk(logits, K, torch.randn(E, generator=g) * 0.1, routing)
    got = sequence_balancing_loss(probs, idx, E, batch)
    s = logits.double().sigmoid()
    s = s / s.sum(-1, keepdim=True)
    expected = 0.0
    for b in range(batch):
        rows = slice(b * seq, (b + 1) * seq)
        f = torch.zeros(E, dtype=torch.float64)
        for e in idx[rows].reshape(-1).tolist():
            f[e] += E / (K * seq)
        expected += float((f * s[rows].mean(0)).sum()) / batch
    assert float(got) == pytest.approx(expected, rel=1e-6)
    # the global loss takes the same normalised scores
    assert float(load_balancing_loss(probs, idx, E)) == pytest.approx(
        float(E * (torch.bincount(idx.reshape(-1), minlength=E).double() / (K * batch * seq)
                   * s.mean(0)).sum()), rel=1e-6)


def test_aux_loss_is_qwen3_moes_over_k() -> None:
    g = torch.Generator().manual_seed(16)
    logits = torch.randn(T, E, generator=g)
    probs, _, idx = route_topk(logits, K)
    ours = load_balancing_loss(probs, idx, E)
    theirs = load_balancing_loss_func((logits,), E, K)
    assert float(ours) * K == pytest.approx(float(theirs), rel=1e-6)


# ---------------------------------------------------------------------- load metrics
def test_router_records_carry_load_metrics(corpus_dir, cache_dir, tmp_path) -> None:  # noqa: ANN001
    """A tiny MoE run (bias balancing, capacity 0.5): each record's ``router`` holds per layer the max and mean load, the experts without tokens, the
    dropped copies and the bias spread; TensorBoard gets them as ``router/<layer>/<field>``;
    the report's Router table and heat map show them."""
    from meshlm.config import load_config
    from meshlm.parallel.expert import router_summary
    from meshlm.train.metrics import read_metrics, tensorboard_scalars
    from meshlm.train.report import router_series, write_report
    from meshlm.train.trainer import train

    steps, run = 3, tmp_path / "run"
    args = ["--model.preset=tiny-moe", "--model.moe_experts=8", "--model.moe_balance=bias",
            "--model.moe_bias_rate=0.01", "--model.moe_capacity=0.5",
            f"--data.path={corpus_dir}", f"--data.cache_dir={cache_dir}",
            "--data.vocab_size=509", "--data.seq_len=32", f"--train.steps={steps}",
            "--train.global_batch=4", "--train.micro_batch=2", f"--train.eval_every={steps}",
            "--train.eval_batches=1", "--run.sample_tokens=0", "--train.peak_flops=1e10",
            "--train.checkpoint_every=0", f"--run.dir={run}"]
    train(load_config(None, args), log=lambda _m: None, progress=False)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    bias_rate = 0.01
    for rec in records:
        assert set(rec["router"]) == {"0", "1"}
        for st in rec["router"].values():
            load = st["tokens_per_expert"]
            assert sum(load) == 4 * 32 * 2  # every copy of the global batch, kept or dropped
            assert st["max_load"] == max(load) and st["mean_load"] == sum(load) / 8
            assert st["max_over_mean"] == pytest.approx(max(load) / (sum(load) / 8))
            assert st["idle_experts"] == sum(1 for v in load if v == 0)
            assert st["dropped"] > 0  # (capacity 0.5: half the average load per expert)
            # each step moves every bias by at most the rate: spread <= 2 rate per step
            assert 0 < st["bias_spread"] <= 2 * bias_rate * rec["step"] + 1e-9
        scalars = tensorboard_scalars(rec)
        for field in ("max_load", "mean_load", "max_over_mean", "idle_experts", "dropped",
                      "bias_spread", "aux_loss"):
            assert f"router/0/{field}" in scalars and f"router/1/{field}" in scalars
        assert "step" not in scalars and not any("tokens_per_expert" in k for k in scalars)
    summary = router_summary(records)
    assert summary["0"]["bias_spread_last"] == records[-1]["router"]["0"]["bias_spread"]
    assert router_series(records)[1]["1"] == [r["router"]["1"]["max_over_mean"]
                                              for r in records]
    files = write_report(run, tmp_path / "report")
    assert (tmp_path / "report" / "router.png") in files
    page = (tmp_path / "report" / "index.html").read_text()
    for text in ("experts without tokens (mean, last)", "bias spread (last)", "<h2>Router</h2>"):
        assert text in page, text
