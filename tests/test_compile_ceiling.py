"""``benchmarks/compile_ceiling.py``: the kernel classes of a profile, and the chunked attention
lever computes what causal SDPA computes (values and gradients)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshlm.models.llama import Attention
from meshlm.models.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ceiling():  # noqa: ANN201
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("compile_ceiling")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_kernel_classes_and_shares(ceiling) -> None:  # noqa: ANN001
    rows = [("aten::mm", 6.0), ("aten::bmm", 1.0),
            ("aten::_scaled_dot_product_flash_attention_for_cpu", 1.5),
            ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", 0.5),
            ("## Call CompiledFxGraph fabc", 0.6), ("aten::add_", 0.4)]
    split = ceiling.split_by_kernel(rows)
    assert split["matmul"] == 7.0 and split["attention"] == 2.0
    assert split["other"] == pytest.approx(1.0)
    assert split["matmul_share"] == pytest.approx(0.7)
    assert split["attention_share"] == pytest.approx(0.2)
    assert ceiling.classify("aten::mul") == "other"


@pytest.mark.parametrize("heads,kv_heads,chunks", [(4, 2, 4), (4, 4, 8), (6, 2, 2)])
def test_chunked_attention_is_causal_sdpa(ceiling, heads: int, kv_heads: int,
                                          chunks: int) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    b, s, hd = 2, 32, 8
    q = torch.randn(b, heads, s, hd, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, s, hd, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, s, hd, dtype=torch.float64, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                         enable_gqa=heads != kv_heads)
    attn = Attention(PRESETS["tiny"])  # (the core reads only its inputs)
    out = ceiling.chunked_core(attn, q, k, v, chunks=chunks)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    go = torch.randn_like(ref)
    grads = torch.autograd.grad(ref, (q, k, v), go)
    chunked_grads = torch.autograd.grad(out, (q, k, v), go)
    for got, want in zip(chunked_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
