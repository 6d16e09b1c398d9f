"""``train.compile``: per-block torch.compile against eager, in one process and in parallel layouts.

Tolerance. Compiled kernels compute the same sums in another order (inductor's fused loops
reduce RMSNorm means, softmax sums and the loss in its own order), so losses agree only up to
fp32 rounding carried through training. The test measures what one eager reordering costs on
the same run -- the same global batch as two micro-batches of 4 instead of one of 8 (gradients
summed in another order) -- and allows compiled runs ``REORDERINGS`` times that over 5 steps:
inductor reorders every reduction of every layer, not one sum per parameter. A wrong kernel,
a missed gradient or a lost collective moves the loss by orders of magnitude more (the losses
fall by ~1e-2 per step here).

Layouts (one spawned world of 2 gloo ranks runs them all): dp=2 ZeRO-3, tp=2 with sequence
parallelism, pp=2 1F1B and zero-bubble (4 micro-batches), dp=2 ZeRO-3 with full recomputation
and ZeRO-1 with op-level recomputation. Every dense layout compiles without a graph break
(dynamo's counters, written to the first step's metrics record). Context parallelism (ring
attention) and MoE layers (``tiny-moe``, one process and dp=2) compile around their eager
communication: they match eager as closely, with the graph breaks they are designed to have.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlm.config import ConfigError, load_config
from meshlm.testing import final_weights, max_relative_difference, run_world
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

STEPS = 5
REORDERINGS = 10  # see the module docstring


def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
        "--train.global_batch=8", "--train.warmup_steps=2", "--train.eval_every=0",
        "--run.sample_tokens=0", "--train.peak_flops=1e10",
    ]


LAYOUTS = {
    "dp2-zero3": ["--parallel.dp=2", "--parallel.zero=3"],
    "tp2-sp": ["--parallel.tp=2", "--parallel.sp=true"],
    "pp2-1f1b": ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--train.micro_batch=2"],
    "pp2-zb": ["--parallel.pp=2", "--parallel.pp_schedule=zb", "--train.micro_batch=2"],
    "dp2-zero3-full": ["--parallel.dp=2", "--parallel.zero=3", "--train.recompute=full"],
    "dp2-zero1-op": ["--parallel.dp=2", "--parallel.zero=1", "--train.recompute=op"],
}
# layouts whose blocks break the graph by design, around eager communication with
# data-dependent shapes: the context-parallel attention core, the MoE feed-forward
BREAKING = {
    "cp2-zigzag": ["--parallel.cp=2", "--parallel.cp_attention=zigzag"],
}


def _train(args: list[str]) -> dict[int, float]:
    return train(load_config(None, args), log=lambda _m: None, progress=False).losses


def _train_all(runs: list[list[str]]) -> list[dict[int, float]]:
    return [_train(r) for r in runs]


def _rel(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in a)


@pytest.fixture(scope="module")
def world(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("compile")
    base = base_args(corpus_dir, cache_dir)
    runs = {
        "eager": base + ["--train.micro_batch=8"],
        "eager-reordered": base + ["--train.micro_batch=4"],
        "compiled": base + ["--train.micro_batch=8", "--train.compile=true"],
        "compiled-again": base + ["--train.micro_batch=8", "--train.compile=true"],
        "compiled-selective": base + ["--train.micro_batch=8", "--train.compile=true",
                                      "--train.recompute=selective"],
    }
    moe = ["--model.preset=tiny-moe", "--train.micro_batch=8"]
    runs.update({"moe-eager": base + moe, "moe-compiled": base + moe + ["--train.compile=true"]})
    losses = {k: _train(v + [f"--run.dir={root / k}"]) for k, v in runs.items()}
    par = {**LAYOUTS, **BREAKING, "moe-dp2": ["--model.preset=tiny-moe", "--parallel.dp=2"]}
    argv = [base + v + ["--train.compile=true", f"--run.dir={root / k}"] for k, v in par.items()]
    losses.update(zip(par, run_world(2, _train_all, argv)[0], strict=True))
    return root, losses


def _compile_record(root: Path, run: str) -> dict:
    return read_metrics(root / run / "metrics.jsonl")[0]["compile"]


def _tolerance(losses: dict) -> float:
    reorder = _rel(losses["eager-reordered"], losses["eager"])
    assert reorder > 0.0  # (a reordering that changes nothing would justify no tolerance)
    return REORDERINGS * reorder


def test_compiled_one_process_matches_eager(world) -> None:  # noqa: ANN001
    root, losses = world
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
    root, losses = world
    first, again = _compile_record(root, "compiled"), _compile_record(root, "compiled-again")
    assert again["cache_hits"] > 0 and again["cache_misses"] == 0, (first, again)
    assert first["cache_hits"] + first["cache_misses"] == again["cache_hits"], (first, again)
    assert losses["compiled-again"] == losses["compiled"]  # (the cached kernels are the same)


def test_selective_recompute_traces_into_the_block(world) -> None:  # noqa: ANN001
    root, losses = world
    assert _rel(losses["compiled-selective"], losses["eager"]) < _tolerance(losses)
    rec = _compile_record(root, "compiled-selective")
    assert rec["graph_breaks"] == 0, rec


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layout_matches_eager(layout: str, world) -> None:  # noqa: ANN001
    root, losses = world
    assert _rel(losses[layout], losses["eager"]) < _tolerance(losses), layout
    rec = _compile_record(root, layout)
    assert rec["graph_breaks"] == 0, (layout, rec)
    assert rec["graphs"] >= 1, (layout, rec)  # (rank 0 of a pipeline: blocks only)


def test_context_parallel_compiles_around_the_ring(world) -> None:  # noqa: ANN001
    root, losses = world
    assert _rel(losses["cp2-zigzag"], losses["eager"]) < _tolerance(losses)
    rec = _compile_record(root, "cp2-zigzag")
    # each block: before the core, after it (the ring runs eagerly between them)
    assert rec["graph_breaks"] > 0 and rec["graphs"] >= 3, rec


@pytest.mark.parametrize("run", ["moe-compiled", "moe-dp2"])
def test_moe_compiles_around_the_experts(run: str, world) -> None:  # noqa: ANN001
    root, losses = world
    assert _rel(losses[run], losses["moe-eager"]) < _tolerance(losses), run
    assert _compile_record(root, run)["graph_breaks"] > 0


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
