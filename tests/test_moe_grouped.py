"""The routed experts as one grouped GEMM, and the MoE layer's host synchronisations.

- ``torch._grouped_mm``'s support table (CPU fp32 / bf16 / fp16 with 16-byte rows; CUDA bf16
  on compute capability 9.x only, checked with a stand-in device), and the fallback where it
  has no kernel;
- the grouped experts equal the per-expert loop meshlm ran before (kept here as the
  reference), output and every gradient: bit for bit on CPU (its ``_grouped_mm`` runs the
  same ``mm`` per expert), and the padded ``bmm`` fallback within twice the loop's own fp32
  error against float64 (unaligned widths) or to float64 precision (fp64, which
  ``_grouped_mm`` does not take);
- an expert without rows gets a zero gradient, and backward writes every expert weight's
  gradient once -- the loop wrote a full-size zero gradient per expert (``w[e]``'s backward);
- GPU-only (skipped without a compute capability 9.x GPU): bf16 grouped experts against the
  fp32 loop, and a whole MoE layer's forward and backward under CUDA's sync check;
- capacity slots: the layer keeps the first C copies of each sequence per expert, in sequence
  order, and counts the dropped ones (a reference loop, float64);
- host synchronisations of one MoE layer's forward + backward (``distributed/host_sync.py``):
  none without expert parallelism, dropless or with capacity, and none under tensor
  parallelism; under ep = 2 one per layer forward (the split sizes) when dropless and none
  with capacity slots -- with outputs equal to one process's;
- ``benchmarks/moe_experts.py --tiny`` runs and agrees with the loop.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshlm.distributed.host_sync import count_host_syncs
from meshlm.models.config import ModelConfig
from meshlm.models.moe import GroupedExperts, MoE, capacity_per_sequence, grouped_mm_supported
from meshlm.testing import run_world

ROOT = Path(__file__).resolve().parents[1]
E, H, FF = 8, 64, 32
COUNTS = [5, 0, 7, 3, 0, 9, 1, 7]  # two experts without rows
U32 = 2.0**-24


def loop_experts(experts: GroupedExperts, x_sorted: torch.Tensor, counts: list[int]
                 ) -> torch.Tensor:
    """The expert loop of models/moe.py before the grouped GEMM (the reference)."""
    outs = []
    for e, chunk in enumerate(x_sorted.split(counts)):
        hidden = F.silu(chunk @ experts.w1[e].t()) * (chunk @ experts.w3[e].t())
        outs.append(hidden @ experts.w2[e].t())
    return torch.cat(outs, dim=0)


def _experts(dim: int = H, hidden: int = FF, dtype: torch.dtype = torch.float32,
             seed: int = 0) -> GroupedExperts:
    g = torch.Generator().manual_seed(seed)
    ex = GroupedExperts(E, dim, hidden).to(dtype)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.2)
    return ex


def _run(ex: GroupedExperts, fn, dim: int = H, dtype: torch.dtype = torch.float32  # noqa: ANN001
         ) -> list[torch.Tensor]:
    """[output, dx, dw1, dw3, dw2] of ``fn(experts, x)`` on fixed data (on the experts'
    device)."""
    g = torch.Generator().manual_seed(1)
    device = ex.w1.device
    x = torch.randn(sum(COUNTS), dim, generator=g, dtype=dtype).to(device).requires_grad_()
    dy = torch.randn(sum(COUNTS), dim, generator=g, dtype=dtype).to(device)
    ex.zero_grad(set_to_none=True)
    y = fn(ex, x)
    y.backward(dy)
    return [y.detach(), x.grad, ex.w1.grad, ex.w3.grad, ex.w2.grad]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------- the kernel choice
def test_grouped_mm_support_table(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = {(d, h, f): grouped_mm_supported(d, torch.empty(E, f, h, dtype=d))
           for d, h, f in [(torch.float32, 64, 32), (torch.float32, 66, 32),
                           (torch.float32, 64, 34), (torch.float64, 64, 32),
                           (torch.bfloat16, 64, 40), (torch.bfloat16, 64, 36),
                           (torch.float16, 64, 32)]}
    assert [k for k, ok in cpu.items() if ok] == [
        (torch.float32, 64, 32), (torch.bfloat16, 64, 40), (torch.float16, 64, 32)]
    # CUDA (GPU-only; the decision alone, from a stand-in weight): bf16 on 9.x
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: capability)
    weight = SimpleNamespace(device=torch.device("cuda", 0), shape=(E, 2048, 7168))
    for capability, dtype, ok in [((9, 0), torch.bfloat16, True), ((9, 0), torch.float32, False),
                                  ((8, 0), torch.bfloat16, False),
                                  ((10, 0), torch.bfloat16, False)]:
        assert grouped_mm_supported(dtype, weight) is ok, (capability, dtype)
    capability = (9, 0)
    assert not grouped_mm_supported(torch.bfloat16, SimpleNamespace(
        device=torch.device("cuda", 0), shape=(1024, 2048, 7168)))  # (CUTLASS: < 1024 groups)


# ---------------------------------------------------------------------- same as the loop
def test_grouped_experts_equal_the_loop_bit_for_bit() -> None:
    ex = _experts()
    assert grouped_mm_supported(torch.float32, ex.w1)
    ref = _run(ex, lambda m, x: loop_experts(m, x, COUNTS))
    for got in (_run(ex, lambda m, x: m(x, torch.tensor(COUNTS))),  # device counts
                _run(ex, lambda m, x: m(x, COUNTS))):  # Python ints
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    for i in (1, 4):  # experts without rows: zero gradients, not None
        assert all(float(g[i].abs().max()) == 0.0 for g in ref[2:])


def test_padded_fallback_equals_the_loop() -> None:
    # fp32 with 66-wide rows (not 16-byte multiples): no _grouped_mm, the padded bmm runs;
    # within twice the loop's own fp32 error against the loop in float64
    ex = _experts(dim=66)
    assert not grouped_mm_supported(torch.float32, ex.w1)
    exact = _run(_experts(dim=66).double(), lambda m, x: loop_experts(m, x, COUNTS), 66,
                 torch.float64)
    ref = _run(ex, lambda m, x: loop_experts(m, x, COUNTS), 66)
    got = _run(ex, lambda m, x: m(x, torch.tensor(COUNTS)), 66)
    for name, a, b, c in zip(("y", "dx", "dw1", "dw3", "dw2"), got, ref, exact, strict=True):
        assert _relative(a, c) <= 2 * _relative(b, c) + U32, name
    # fp64: _grouped_mm takes no float64; the fallback equals the loop to float64 precision
    ex64 = _experts(dtype=torch.float64)
    assert not grouped_mm_supported(torch.float64, ex64.w1)
    ref = _run(ex64, lambda m, x: loop_experts(m, x, COUNTS), dtype=torch.float64)
    got = _run(ex64, lambda m, x: m(x, torch.tensor(COUNTS)), dtype=torch.float64)
    assert max(_relative(a, b) for a, b in zip(got, ref, strict=True)) < 1e-14


class FullSizeOps(TorchDispatchMode):
    """Counts the operations (not views) that produce a tensor of ``shape``."""

    VIEWS = ("transpose", "detach", "view", "alias", "t.default", "slice", "select.int")

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.ops = shape, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if (isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape
                and not any(v in name for v in self.VIEWS)):
            self.ops[name] += 1
        return out


def test_backward_writes_each_weight_gradient_once() -> None:
    ex = _experts()
    x = torch.randn(sum(COUNTS), H, requires_grad=True)
    seen = {}
    for name, fn in (("loop", lambda: loop_experts(ex, x, COUNTS)),
                     ("grouped", lambda: ex(x, torch.tensor(COUNTS)))):
        ex.zero_grad(set_to_none=True)
        y = fn()
        with FullSizeOps((E, FF, H)) as ops:  # w1 and w3's shape
            y.backward(torch.ones_like(y))
        seen[name] = ops.ops
    # the loop: per expert a full-size zero gradient (select_backward) and an add, for w1, w3
    assert seen["loop"]["aten.select_backward.default"] == 2 * E, seen["loop"]
    # grouped: one grouped GEMM per weight writes the whole (E, F, H) gradient
    assert dict(seen["grouped"]) == {"aten._grouped_mm.default": 2}, seen["grouped"]


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not HOPPER, reason="GPU-only: CUTLASS's grouped GEMM (bf16, 9.x)")
def test_cuda_grouped_layer_without_host_syncs() -> None:
    """On a 9.x GPU in bf16: the experts equal the fp32 loop to bf16 precision, and the MoE
    layer's forward and backward make no host synchronisation (CUDA's own sync check)."""
    ex = _experts().cuda()
    ref = _run(ex, lambda m, x: loop_experts(m, x, COUNTS))
    ex16 = ex.to(torch.bfloat16)
    assert grouped_mm_supported(torch.bfloat16, ex16.w1)
    got = _run(ex16, lambda m, x: m(x.bfloat16(), torch.tensor(COUNTS).cuda()).float())
    assert max(_relative(a, b) for a, b in zip(got, ref, strict=True)) < 2e-2
    moe = _moe(moe_shared_experts=1, moe_score="sigmoid", moe_n_group=2, moe_topk_group=1,
               moe_balance="bias").cuda().to(torch.bfloat16).train()
    moe.build_buffers("cuda")
    x = torch.randn(2, 64, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = moe(x)
        y.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------- capacity slots
def _moe(**changes: object) -> MoE:
    cfg = ModelConfig(name="t", vocab_size=64, dim=H, n_layers=1, n_heads=4, n_kv_heads=4,
                      ffn_hidden=64, moe_experts=E, moe_topk=2, moe_ffn_hidden=FF, **changes)
    moe = MoE(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return moe


def test_capacity_keeps_the_first_copies_of_each_sequence() -> None:
    """float64: the layer against a loop over tokens that keeps expert e's first C copies of
    each sequence (C = ceil(c S k / E)) and drops the rest."""
    b, s, factor = 3, 8, 0.75
    moe = _moe(moe_capacity=factor).double().train()
    x = torch.randn(b, s, H, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y = moe(x)
    flat = x.reshape(-1, H)
    weights, idx = moe.route(flat, b)
    cap = capacity_per_sequence(s, moe.topk, E, factor)
    ref, dropped = torch.zeros_like(flat), 0
    ex = moe.experts
    for seq in range(b):
        taken = Counter()
        for t in range(seq * s, (seq + 1) * s):
            for j in range(moe.topk):
                e = int(idx[t, j])
                if taken[e] == cap:
                    dropped += 1
                    continue
                taken[e] += 1
                h = F.silu(ex.w1[e] @ flat[t]) * (ex.w3[e] @ flat[t])
                ref[t] += weights[t, j] * (ex.w2[e] @ h)
    assert 0 < dropped < b * s * moe.topk
    assert _relative(y.reshape(-1, H), ref) < 1e-13
    assert float(moe.stats.dropped) == dropped and int(moe.stats.load.sum()) == b * s * 2


# ---------------------------------------------------------------------- host syncs
def _layer_syncs(moe: torch.nn.Module, x: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(synchronisations of the forward, of the backward, output) of a training step's layer."""
    x = x.clone().requires_grad_()
    with count_host_syncs() as fwd:
        y = moe(x)
    with count_host_syncs() as bwd:
        (y * y).sum().backward()
    return fwd.total, bwd.total, y.detach()


@pytest.mark.parametrize("capacity", [0.0, 1.0])
@pytest.mark.parametrize("balance", ["aux", "seq_aux", "bias"])
def test_no_host_syncs_without_expert_parallelism(capacity: float, balance: str) -> None:
    moe = _moe(moe_capacity=capacity, moe_balance=balance, moe_shared_experts=1,
               moe_score="sigmoid", moe_n_group=2, moe_topk_group=1).train()
    moe.build_buffers("cpu")
    x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(4))
    assert _layer_syncs(moe, x)[:2] == (0, 0)


def parallel_syncs(world: int) -> dict:
    """World body: per case, the layer's (forward, backward) host synchronisations under ep =
    world (dropless, capacity) and tp = world, and its output's relative difference to the
    one-process layer on the same tokens."""
    import torch.distributed as dist

    from meshlm.distributed.comm import Comm
    from meshlm.distributed.mesh import Mesh
    from meshlm.distributed.spec import attach_specs
    from meshlm.layout import Layout
    from meshlm.models.llama import build_model
    from meshlm.parallel.expert import apply_expert_parallel
    from meshlm.parallel.tensor import apply_tensor_parallel

    rank = dist.get_rank()
    out = {}
    for case, layout, capacity in (("ep dropless", Layout(dp=world, ep=world), 0.0),
                                   ("ep capacity", Layout(dp=world, ep=world), 1.0),
                                   ("tp dropless", Layout(tp=world), 0.0)):
        cfg = ModelConfig(name="t", vocab_size=64, dim=H, n_layers=1, n_heads=4, n_kv_heads=4,
                          ffn_hidden=64, moe_experts=E, moe_topk=2, moe_ffn_hidden=FF,
                          moe_capacity=capacity, moe_shared_experts=1)
        x = torch.randn(world, 2, 8, H, generator=torch.Generator().manual_seed(5))
        mine = x[rank] if case.startswith("ep") else x[0]
        alone = build_model(cfg, seed=3).layers["0"].feed_forward.train()
        ref = alone(mine).detach()
        model = build_model(cfg, seed=3)
        comm = Comm(Mesh(layout))
        attach_specs(model, comm.mesh)
        if case.startswith("ep"):
            apply_expert_parallel(model, comm)
        else:
            apply_tensor_parallel(model, comm, sp=False)
        fwd, bwd, y = _layer_syncs(model.layers["0"].feed_forward.train(), mine)
        out[case] = (fwd, bwd, _relative(y, ref))
    return out


def test_host_syncs_under_expert_and_tensor_parallelism() -> None:
    for res in run_world(2, parallel_syncs, 2):
        assert {k: v[:2] for k, v in res.items()} == {
            "ep dropless": (1, 0), "ep capacity": (0, 0), "tp dropless": (0, 0)}, res
        assert all(v[2] < 1e-6 for v in res.values()), res


# ---------------------------------------------------------------------- the benchmark
def test_benchmark_tiny(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_experts
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = moe_experts.main(["--tiny", "--json", str(tmp_path / "tiny.json")])
    assert json.loads((tmp_path / "tiny.json").read_text())["rows"] == out["rows"]
    rows = {r["impl"]: r for r in out["rows"]}
    assert set(rows) == {"loop", "padded", "grouped"}
    assert rows["grouped"]["max_rel_diff_vs_loop"] == 0.0
    assert rows["padded"]["max_rel_diff_vs_loop"] < 1e-5
