"""FlexAttention (``model.attention=flex``) and the sliding window (``model.sliding_window``).

- every registered kernel (``sdpa``, ``eager``, ``flex``) gives the output and gradients of a
  dense masked reference written here, for causal attention, a sliding window, documents and
  both, with grouped-query heads (fp32: sums of 16-64 products, so 1e-5 leaves two orders of
  magnitude over fp32's rounding on any CPU);
- flex's ring blocks -- rows at zigzag positions against key blocks from other ranks, some with
  no visible key for a row -- merge to the dense reference, output, log-sum-exp and gradients;
- flex holds a block mask, not a (B, S, S) boolean one: the mask it keeps is
  ``B (S / 128)^2`` entries per table, and its backward builds masks of one query tile only;
- ``print(model)`` shows the kernel and its window; the planner's description counts flex's
  skipped tiles and its block mask;
- one process with flex gives the one-process run with ``sdpa`` under the same masks, and in one
  spawned world of 2 every layout with flex gives it too (losses at each of 4 steps and final
  weights, 1e-5 as every parity test): dp 2, ZeRO 1 / 2 / 3, HSDP (dp 2, dp_shard 1), tp 2 +
  sp, cp 2 ring / zigzag / Ulysses, pp 2 AFAB / 1F1B / interleaved / zero-bubble, selective
  and full recomputation, ep 2 (MoE, against one process with flex: routing is discrete, and
  flex's rounding differs from sdpa's in the last bits) -- with a window of 24 and documents on 64-token
  sequences, so that both cut; compiled blocks (flex kept eager inside them) in one process.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from meshlm.config import load_config
from meshlm.models import build_model, get_preset
from meshlm.models.attention import ATTENTION, Mask, build_kernel
from meshlm.models.attention_blocks import merge
from meshlm.models.attention_spec import spec, visible_fraction
from meshlm.models.flex_attention import BLOCK_MASKS, FlexAttention
from meshlm.testing import final_weights, max_relative_difference, run_world, train_runs
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

B, NH, NKV, HD = 2, 4, 2, 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int],
              k_pos: list[int], window: int, q_ids: torch.Tensor | None,
              k_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention with the mask built element by element: (output, log-sum-exp)."""
    allowed = torch.zeros(B, len(q_pos), len(k_pos), dtype=torch.bool)
    for b in range(B):
        for i, qp in enumerate(q_pos):
            for j, kp in enumerate(k_pos):
                ok = kp <= qp and (window == 0 or qp - kp < window)
                if q_ids is not None:
                    ok = ok and bool(q_ids[b, i] == k_ids[b, j])
                allowed[b, i, j] = ok
    kk = k.repeat_interleave(NH // NKV, dim=1)
    vv = v.repeat_interleave(NH // NKV, dim=1)
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(HD)
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return p @ vv, lse


def _inputs(s: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NH, s, HD, generator=g)
    k = torch.randn(B, NKV, s, HD, generator=g)
    v = torch.randn(B, NKV, s, HD, generator=g)
    ids = torch.tensor([[0] * (s // 3) + [1] * (s // 3) + [2] * (s - 2 * (s // 3)),
                        [0] * (s // 2) + [1] * (s - s // 2)])
    return q, k, v, ids


MASKS = [(0, False), (7, False), (0, True), (7, True)]  # (window, documents)


@pytest.mark.parametrize("window, docs", MASKS, ids=["causal", "window", "docs", "window-docs"])
@pytest.mark.parametrize("name", ["sdpa", "eager", "flex"])
def test_kernel_matches_the_dense_masked_reference(name: str, window: int, docs: bool) -> None:
    s = 40
    q, k, v, ids = _inputs(s)
    dy = torch.randn(B, NH, s, HD, generator=torch.Generator().manual_seed(1))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference(*leaves, list(range(s)), list(range(s)), window,
                     ids if docs else None, ids if docs else None)[0]
    want.backward(dy)
    got_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kernel = build_kernel(name, window)
    got = kernel(*got_leaves, *((ids,) if docs else ()))
    got.backward(dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_leaves, leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_flex_ring_blocks_merge_to_the_reference() -> None:
    """Zigzag rows of rank 0 of cp 2 (chunks 0 and 3 of 4) against every rank's key blocks."""
    s, c = 64, 16
    q, k, v, ids = _inputs(s, seed=2)
    window = 20
    rows = np.concatenate([np.arange(0, c), np.arange(3 * c, 4 * c)])
    shares = [rows, np.concatenate([np.arange(c, 2 * c), np.arange(2 * c, 3 * c)])]
    kernel = FlexAttention(window)
    qr = q[:, :, rows]
    out = torch.zeros(qr.shape)
    lse = torch.full(qr.shape[:3], float("-inf"))
    masks = []
    for share in shares:
        mask = Mask(rows, share, window, ids[:, rows], ids[:, share])
        masks.append((share, mask))
        if mask.empty():
            continue
        o, lb = kernel.block(qr, k[:, :, share], v[:, :, share], mask)
        merge(out, lse, o, lb)
    leaves = [t.clone().requires_grad_() for t in (qr, k, v)]
    want, want_lse = reference(*leaves, rows.tolist(), list(range(s)), window,
                               ids[:, rows], ids)
    torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse.detach(), rtol=1e-5, atol=1e-5)
    dy = torch.randn(qr.shape, generator=torch.Generator().manual_seed(3))
    want.backward(dy)
    dq, dk, dv = torch.zeros(qr.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    for share, mask in masks:
        if mask.empty():
            continue
        gq, gk, gv = kernel.block_backward(dy, qr, k[:, :, share], v[:, :, share], out, lse,
                                           mask)
        dq += gq
        dk[:, :, share] += gk
        dv[:, :, share] += gv
    for got, leaf in zip((dq, dk, dv), leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-5)


def test_flex_keeps_a_block_mask_and_masks_one_tile_at_a_time(monkeypatch) -> None:  # noqa: ANN001
    s = 512
    q, k, v, _ = _inputs(s, seed=4)
    ids = torch.arange(s).div(100, rounding_mode="floor").expand(B, s).contiguous()
    sizes: list[tuple[int, ...]] = []
    dense = Mask.dense

    def counting(self: Mask, device: torch.device) -> torch.Tensor:
        out = dense(self, device)
        sizes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(Mask, "dense", counting)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    FlexAttention(64)(*leaves, ids).sum().backward()
    assert sizes and max(n * m for _, n, m in sizes) <= 128 * (128 + 64)  # one tile's keys
    kept = [m for key, _, m in BLOCK_MASKS.items if key[2] == 64]
    assert kept and tuple(kept[0].kv_num_blocks.shape) == (B, 1, s // 128)
    # the other kernels: the whole (B, S, S) mask
    sizes.clear()
    build_kernel("sdpa", 64)(q, k, v, ids)
    assert max(sizes) == (B, s, s)


def test_print_model_shows_the_kernel_and_its_window() -> None:
    from dataclasses import replace

    model = build_model(replace(get_preset("tiny"), attention="flex", sliding_window=24))
    text = repr(model)
    assert text.count("(kernel): FlexAttention(window=24)") == model.cfg.n_layers
    assert "flex" in ATTENTION and spec("flex").block == 128


def test_planner_description_of_flex() -> None:
    flex, sdpa = spec("flex"), spec("sdpa")
    # plain causal: the diagonal tiles whole; a window of 4 tiles in 32: about 4/32 of s^2
    assert flex.score_fraction(4096) == pytest.approx((32 * 33 / 2) / 32**2)
    assert flex.score_fraction(4096, window=512) < 0.2 < sdpa.score_fraction(4096, window=512)
    assert flex.score_fraction(4096, window=512) >= visible_fraction(4096, window=512)
    # mask memory: tiles of int32 against bytes of a boolean per pair
    assert flex.mask_bytes(8, 4096, masked=True, documents=True) == 8 * 32 * 32 * 4 * 2
    assert sdpa.mask_bytes(8, 4096, masked=True, documents=True) == 8 * 4096 * 4096
    assert sdpa.mask_bytes(8, 4096, masked=False) == flex.mask_bytes(8, 4096, False) == 0


def test_planner_composes_the_kernels_description(tmp_path: Path) -> None:
    """The planner reads the kernel's description, whatever the kernel: a model TOML naming
    flex and a window plans with skipped tiles and no per-layer mask; sdpa under the same mask
    keeps a (b, s, s) boolean per layer and computes every score."""
    from meshlm.planner import CATALOGUE, Workload, memory, parse_layout, step_time
    from meshlm.planner.workload import load_model_spec

    h100 = CATALOGUE["h100-sxm"]
    lo = parse_layout("tp=1,pp=1,dp=8,zero=1,mbs=2,recompute=none")
    plans = {}
    for name, window in (("sdpa", 0), ("sdpa", 1024), ("flex", 1024), ("flex", 0)):
        path = tmp_path / f"{name}-{window}.toml"
        path.write_text(f'[model]\npreset = "llama3-8b"\nattention = "{name}"\n'
                        f"sliding_window = {window}\n")
        work = Workload(load_model_spec(str(path)), 8192, 64, doc_len=2048.0)
        plans[name, window] = (memory(work, lo, h100), step_time(work, lo, h100))
    mem, t = plans["sdpa", 1024]
    layers = 32
    assert mem.items["activations"] >= layers * 2 * 8192 * 8192  # a bool per pair, per layer
    flex_mem, flex_t = plans["flex", 1024]
    assert mem.items["activations"] - flex_mem.items["activations"] == pytest.approx(
        layers * 2 * 8192 * 8192, rel=1e-9)
    assert flex_t.items["compute: attention"] < t.items["compute: attention"] / 4  # 2 of 64 tile columns
    # documents of 2048 alone: still fewer tiles than the boolean-masked sdpa
    assert (plans["flex", 0][1].items["compute: attention"]
            < plans["sdpa", 0][1].items["compute: attention"])


# ---------------------------------------------------------------------- layouts
STEPS = 4
MASKED = ["--model.n_layers=4", "--model.sliding_window=24", "--data.doc_mask=true"]
FLEX = ["--model.attention=flex"]
PP2 = ["--parallel.pp=2", "--train.micro_batch=2"]
# (the per-sequence balancing loss: the same for any split of the batch; test_expert_parallel)
MOE = ["--model.preset=tiny-moe", "--model.moe_balance=seq_aux"]
LAYOUTS = [  # (name, reference, arguments)
    ("dp2", "ref", ["--parallel.dp=2"]),
    ("zero1", "ref", ["--parallel.dp=2", "--parallel.zero=1"]),
    ("zero2", "ref", ["--parallel.dp=2", "--parallel.zero=2"]),
    ("zero3", "ref", ["--parallel.dp=2", "--parallel.zero=3"]),
    ("hsdp", "ref", ["--parallel.dp=2", "--parallel.dp_shard=1", "--parallel.zero=3"]),
    ("tp2-sp", "ref", ["--parallel.tp=2", "--parallel.sp=true"]),
    ("cp2-ring", "ref", ["--parallel.cp=2", "--parallel.cp_attention=ring"]),
    ("cp2-zigzag", "ref", ["--parallel.cp=2", "--parallel.cp_attention=zigzag"]),
    ("cp2-ulysses", "ref", ["--parallel.cp=2", "--parallel.cp_attention=ulysses"]),
    ("pp2-afab", "ref", [*PP2, "--parallel.pp_schedule=afab"]),
    ("pp2-1f1b-full", "ref", [*PP2, "--parallel.pp_schedule=1f1b", "--train.recompute=full"]),
    ("pp2-interleaved", "ref", [*PP2, "--parallel.pp_schedule=interleaved",
                                "--parallel.pp_virtual=2"]),
    ("pp2-zb", "ref", [*PP2, "--parallel.pp_schedule=zb"]),
    ("dp2-selective", "ref", ["--parallel.dp=2", "--train.recompute=selective"]),
    # top-k routing is discrete: flex's fp32 rounding (not sdpa's) may flip a near tie, so
    # ep is held to the one-process flex run of the same MoE model
    ("ep2", "moe-flex", [*MOE, "--parallel.dp=2", "--parallel.ep=2"]),
]
REFERENCES = {"ref": [], "moe-flex": [*FLEX, *MOE]}  # one process


@pytest.fixture(scope="module")
def world(short_docs: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("flex")
    base = ["--model.preset=tiny", f"--data.path={short_docs}",
            f"--data.cache_dir={cache_dir}", "--data.vocab_size=512", "--data.seq_len=64",
            f"--train.steps={STEPS}", "--train.global_batch=8", "--train.micro_batch=4",
            "--train.warmup_steps=2", "--train.eval_every=0", "--run.sample_tokens=0",
            "--train.peak_flops=1e10", "--train.eps=1e-5", *MASKED]
    for name, extra in {**REFERENCES, "flex": FLEX,
                        "flex-compiled": [*FLEX, "--train.compile=true"],
                        "unwindowed": ["--model.sliding_window=0"]}.items():
        train(load_config(None, [*base, *extra, f"--run.dir={root / name}"]),
              log=lambda _m: None, progress=False)
    runs = [[*FLEX, *args, f"--run.dir={root / name}"] for name, _, args in LAYOUTS]
    run_world(2, train_runs, base, runs)
    return root


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}


def _check(root: Path, name: str, ref: str) -> None:
    want, got = _losses(root / ref), _losses(root / name)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), name
    worst = max(abs(got[s] - want[s]) / want[s] for s in want)
    weights, tensor = max_relative_difference(final_weights(root / name),
                                              final_weights(root / ref))
    print(f"{name}: loss {worst:.1e}, weights {weights:.1e} ({tensor})")
    assert worst < 1e-5, (name, worst)
    assert weights < 1e-5, (name, tensor, weights)


def test_the_window_cuts_this_run(world) -> None:  # noqa: ANN001
    """Sequences of 64 with a window of 24: the window is not a no-op here."""
    ref, plain = _losses(world / "ref"), _losses(world / "unwindowed")
    assert abs(ref[STEPS] - plain[STEPS]) / ref[STEPS] > 1e-4, (ref, plain)


@pytest.mark.parametrize("name", ["flex", "flex-compiled"])
def test_one_process_flex_matches_sdpa(name: str, world) -> None:  # noqa: ANN001
    _check(world, name, "ref")


@pytest.mark.parametrize("name", [name for name, *_ in LAYOUTS])
def test_layout_with_flex_matches_one_process(name: str, world) -> None:  # noqa: ANN001
    _check(world, name, next(ref for n, ref, _ in LAYOUTS if n == name))
