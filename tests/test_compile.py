"""``train.compile``: per-block torch.compile against eager, in one process and in parallel layouts.

Tolerance. Compiled kernels compute the same sums in another order (inductor's fused loops
reduce RMSNorm means, softmax sums and the loss in its own order), so losses agree only up to
fp32 rounding carried through training. The test measures what one eager reordering costs on
the same run -- the same global batch as one micro-batch of 8 instead of four of 2 (gradients
summed in another order) -- and allows compiled runs ``REORDERINGS`` times that over 5 steps:
inductor reorders every reduction of every layer, not one sum per parameter. A wrong kernel,
a missed gradient or a lost collective moves the loss by orders of magnitude more (the losses
fall by ~1e-2 per step here).

Layouts (one spawned world of 2 gloo ranks runs them all): dp=2 ZeRO-3, tp=2 with sequence
parallelism, pp=2 1F1B and zero-bubble (4 micro-batches), dp=2 ZeRO-3 with full recomputation
and ZeRO-1 with op-level recomputation. Every dense layout compiles without a graph break
(dynamo's counters, written to the first step's metrics record). Context parallelism (ring
attention) and MoE layers (``tiny-moe``, dp=2) compile around their eager
communication: they match eager as closely, with the graph breaks they are designed to have.

Zero-bubble with compiled blocks keeps the I/W split: every ``I`` and ``W`` pass of the world's
runs is recorded (matmul FLOPs from the profiler, which sees the kernels a compiled graph calls;
which linear weight gradients it changed). ``I`` runs only the input-gradient matmuls and
leaves every linear weight gradient as it was; ``W`` runs the weight-gradient matmuls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from meshlm.config import ConfigError, load_config
from meshlm.testing import final_weights, max_relative_difference, run_world
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

STEPS = 5
REORDERINGS = 10  # see the module docstring
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
        "--train.global_batch=8", "--train.warmup_steps=2", "--train.eval_every=0",
        "--run.sample_tokens=0", "--train.peak_flops=1e10",
    ]


# Every dense run has micro-batches of 2 (the one-process ones too): the block's graph has one
# shape wherever the layout leaves the block whole (dp, ZeRO, pp, recomputation), so inductor
# compiles it once and the layouts after the first read it from the FX graph cache.
MB2 = ["--train.micro_batch=2"]
LAYOUTS = {
    "dp2-zero3": ["--parallel.dp=2", "--parallel.zero=3", *MB2],
    "tp2-sp": ["--parallel.tp=2", "--parallel.sp=true", *MB2],
    "pp2-1f1b": ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", *MB2],
    "pp2-zb": ["--parallel.pp=2", "--parallel.pp_schedule=zb", *MB2],
    "pp2-zb-op": ["--parallel.pp=2", "--parallel.pp_schedule=zb", *MB2, "--train.recompute=op"],
    "dp2-zero3-full": ["--parallel.dp=2", "--parallel.zero=3", *MB2, "--train.recompute=full"],
    "dp2-zero1-op": ["--parallel.dp=2", "--parallel.zero=1", *MB2, "--train.recompute=op"],
}
# layouts whose blocks break the graph by design, around eager communication with
# data-dependent shapes: the context-parallel attention core, the MoE feed-forward
BREAKING = {
    "cp2-zigzag": ["--parallel.cp=2", "--parallel.cp_attention=zigzag", *MB2],
}


def _train(args: list[str]) -> dict[int, float]:
    return train(load_config(None, args), log=lambda _m: None, progress=False).losses


def _train_all(runs: list[list[str]]) -> list[tuple[dict[int, float], list[dict], dict]]:
    """Spawned body: each run's losses, its zero-bubble passes (:func:`_record_passes`) and
    this rank's compile counters."""
    from meshlm.parallel.compile import compile_stats

    out = []
    for r in runs:
        passes: list[dict] = []
        with _record_passes(passes):
            losses = _train(r)
        out.append((losses, passes, compile_stats()))
    return out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b is None or (a is not None and b is not None and torch.equal(a, b))


@contextlib.contextmanager
def _record_passes(passes: list[dict]) -> Iterator[None]:
    """Every ``I`` / ``W`` pass of the pipeline executor appends its matmul FLOPs, how many of
    the stage's linear weight gradients it changed, and the stage's linear weights (count,
    elements) to ``passes``."""
    from torch.profiler import ProfilerActivity, profile

    from meshlm.parallel.pipeline import PipelineExecutor

    original = {op: getattr(PipelineExecutor, f"_do_{op}") for op in ("I", "W")}

    def recorded(op: str):  # noqa: ANN202
        def run(self: PipelineExecutor, a) -> None:  # noqa: ANN001
            weights = [lin.weight for mod in self.pipe.stage_modules(a.stage)
                       for lin in mod.modules() if isinstance(lin, nn.Linear)]
            before = [None if w.grad is None else w.grad.clone() for w in weights]
            with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
                original[op](self, a)
            passes.append({
                "op": op, "matmul_flops": sum(e.flops for e in prof.events() if e.name in MATMULS),
                "changed": sum(not _same(b, w.grad) for b, w in zip(before, weights, strict=True)),
                "linears": len(weights), "linear_numel": sum(w.numel() for w in weights)})
        return run

    for op in original:
        setattr(PipelineExecutor, f"_do_{op}", recorded(op))
    try:
        yield
    finally:
        for op, fn in original.items():
            setattr(PipelineExecutor, f"_do_{op}", fn)


def _rel(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in a)


@pytest.fixture(scope="module")
def world(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("compile")
    base = base_args(corpus_dir, cache_dir)
    runs = {
        "eager": base + MB2,
        "eager-reordered": base + ["--train.micro_batch=8"],
        "compiled": base + [*MB2, "--train.compile=true"],
        "compiled-again": base + [*MB2, "--train.compile=true"],
        "compiled-selective": base + [*MB2, "--train.compile=true",
                                      "--train.recompute=selective"],
    }
    # MoE: the eager reference for the compiled dp=2 run (micro-batches of 8 sequences, 4 per
    # rank: the aux loss's statistics are over the global micro-batch, so its size is part of
    # the model's loss, not an ordering)
    runs["moe-eager"] = base + ["--model.preset=tiny-moe", "--train.micro_batch=8"]
    losses = {k: _train(v + [f"--run.dir={root / k}"]) for k, v in runs.items()}
    par = {**LAYOUTS, **BREAKING, "moe-dp2": ["--model.preset=tiny-moe", "--parallel.dp=2"]}
    argv = [base + v + ["--train.compile=true", f"--run.dir={root / k}"] for k, v in par.items()]
    ranks = run_world(2, _train_all, argv)
    losses.update((k, r[0]) for k, r in zip(par, ranks[0], strict=True))
    # per layout, per rank: (zero-bubble passes, compile counters)
    probes = {k: [(rank[i][1], rank[i][2]) for rank in ranks] for i, k in enumerate(par)}
    return root, losses, probes


def _compile_record(root: Path, run: str) -> dict:
    return read_metrics(root / run / "metrics.jsonl")[0]["compile"]


def _tolerance(losses: dict) -> float:
    reorder = _rel(losses["eager-reordered"], losses["eager"])
    assert reorder > 0.0  # (a reordering that changes nothing would justify no tolerance)
    return REORDERINGS * reorder


def test_compiled_one_process_matches_eager(world) -> None:  # noqa: ANN001
    root, losses, _ = world
    tol = _tolerance(losses)
    assert losses["compiled"] != losses["eager"]  # (really compiled: other kernels)
    assert _rel(losses["compiled"], losses["eager"]) < tol
    worst, name = max_relative_difference(final_weights(root / "compiled"),
                                          final_weights(root / "eager"))
    assert worst < 1e-3, (name, worst)
    rec = _compile_record(root, "compiled")
    # identical blocks share one graph: block, final norm + head, loss
    assert rec["graphs"] == 3 and rec["graph_breaks"] == 0, rec
    assert rec["compile_s"] > 0


def test_second_run_hits_the_graph_cache(world) -> None:  # noqa: ANN001
    root, losses, _ = world
    first, again = _compile_record(root, "compiled"), _compile_record(root, "compiled-again")
    assert again["cache_hits"] > 0 and again["cache_misses"] == 0, (first, again)
    assert first["cache_hits"] + first["cache_misses"] == again["cache_hits"], (first, again)
    assert losses["compiled-again"] == losses["compiled"]  # (the cached kernels are the same)


def test_selective_recompute_traces_into_the_block(world) -> None:  # noqa: ANN001
    root, losses, _ = world
    assert _rel(losses["compiled-selective"], losses["eager"]) < _tolerance(losses)
    rec = _compile_record(root, "compiled-selective")
    assert rec["graph_breaks"] == 0, rec


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layout_matches_eager(layout: str, world) -> None:  # noqa: ANN001
    root, losses, _ = world
    assert _rel(losses[layout], losses["eager"]) < _tolerance(losses), layout
    rec = _compile_record(root, layout)
    assert rec["graph_breaks"] == 0, (layout, rec)
    assert rec["graphs"] >= 1, (layout, rec)  # (rank 0 of a pipeline: blocks only)


@pytest.mark.parametrize("layout", ["pp2-zb", "pp2-zb-op"])
def test_compiled_zero_bubble_matches_1f1b_and_eager(layout: str, world) -> None:  # noqa: ANN001
    """Compiled ZB's weights (weight gradients formed by W) agree with compiled 1F1B's and
    with eager's within the one-process test's bound."""
    root, _, _ = world
    zb = final_weights(root / layout)
    for ref in ("pp2-1f1b", "eager"):
        worst, name = max_relative_difference(zb, final_weights(root / ref))
        assert worst < 1e-3, (ref, name, worst)


@pytest.mark.parametrize("layout", ["pp2-zb", "pp2-zb-op"])
def test_compiled_zero_bubble_keeps_the_split(layout: str, world) -> None:  # noqa: ANN001
    """``I`` runs only the input-gradient matmuls (``dy W``: 2 T n FLOPs for n linear weight
    elements and T tokens) and changes no linear weight gradient; ``W`` runs ``dy^T x`` (the
    same 2 T n) and sets every one. Before the split, compiled ``I`` ran both: 4 T n. Each
    rank's blocks are one graph (rank 1: block, head, loss), without a break. With op-level
    recomputation ``I`` also re-runs forward matmuls: its FLOPs are not checked there."""
    _, _, probes = world
    tokens = 2 * 32  # micro-batch x sequence
    for rank, (passes, stats) in enumerate(probes[layout]):
        assert [p["op"] for p in passes].count("I") == STEPS * 4, rank  # (4 micro-batches)
        assert [p["op"] for p in passes].count("W") == STEPS * 4, rank
        for p in passes:
            if p["op"] == "W" or layout == "pp2-zb":
                assert p["matmul_flops"] == 2 * tokens * p["linear_numel"], (rank, p)
            assert p["changed"] == (0 if p["op"] == "I" else p["linears"]), (rank, p)
        assert stats["graph_breaks"] == 0 and stats["graphs"] == (1, 3)[rank], (rank, stats)
    assert probes["pp2-1f1b"][0][0] == []  # (1F1B runs B, not I and W)


def test_context_parallel_compiles_around_the_ring(world) -> None:  # noqa: ANN001
    root, losses, _ = world
    assert _rel(losses["cp2-zigzag"], losses["eager"]) < _tolerance(losses)
    rec = _compile_record(root, "cp2-zigzag")
    # each block: before the core, after it (the ring runs eagerly between them)
    assert rec["graph_breaks"] > 0 and rec["graphs"] >= 3, rec


def test_moe_compiles_around_the_experts(world) -> None:  # noqa: ANN001
    root, losses, _ = world
    assert _rel(losses["moe-dp2"], losses["moe-eager"]) < _tolerance(losses)
    assert _compile_record(root, "moe-dp2")["graph_breaks"] > 0


def test_bf16_autocast_compiles(corpus_dir: Path, cache_dir: Path, tmp_path: Path) -> None:
    """Under bf16 autocast the compiled run stays within REORDERINGS of a bf16 reordering."""
    base = base_args(corpus_dir, cache_dir) + ["--precision.dtype=bf16", "--train.steps=3"]
    got = {name: train(load_config(None, base + extra + [f"--run.dir={tmp_path / name}"]),
                       log=lambda _m: None, progress=False).losses
           for name, extra in (("eager", ["--train.micro_batch=8"]),
                               ("eager-reordered", ["--train.micro_batch=4"]),
                               ("compiled", ["--train.micro_batch=8", "--train.compile=true"]))}

    def rel(a: dict[int, float], b: dict[int, float]) -> float:
        return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)

    reorder = rel(got["eager-reordered"], got["eager"])
    assert reorder > 0.0
    assert got["compiled"] != got["eager"]
    assert rel(got["compiled"], got["eager"]) < REORDERINGS * reorder


def test_missing_compiler_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(ConfigError, match="train.compile=true needs a C\\+\\+ compiler"):
        load_config(None, ["--train.compile=true"])
    monkeypatch.delenv("CXX")
    load_config(None, ["--train.compile=true"])  # (g++ is on these machines)
