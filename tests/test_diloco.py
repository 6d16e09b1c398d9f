"""DiLoCo islands against the one-process run and against themselves.

- K = 1 is the plain run, whatever the ``[diloco]`` keys say (losses and weights equal).
- H = 1, outer lr 1, no outer momentum, with a linear inner optimizer (SGD with momentum):
  averaging the islands' updates is one update on their averaged gradients, so the run equals
  synchronous training on the same global batch (relative < 1e-5), for islands of dp = 1 (K = 4)
  and of tp = 2, pp = 2 (1F1B, 2 micro-batches) and cp = 2 (zigzag) (K = 2). AdamW is not linear in the gradient: with it DiLoCo is a different
  algorithm at every H (the benchmark measures how close it comes).
- K = 2 islands of dp = 2 with ZeRO-1 (AdamW) resume exactly from a checkpoint taken in the
  middle of an outer round; islands of tp = 2 with 2 staggered fragments in bf16 too.
- The communication log holds cross-island traffic only on synchronisation steps, and then
  exactly the rank's owned shard x the reduce dtype's size.

One spawned world of 4 gloo ranks runs every island layout; the references run in-process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from meshlm.config import load_config
from meshlm.parallel.diloco import fragment_of, outer_update, sync_fragments
from meshlm.testing import final_weights, max_relative_difference, run_world
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

GLOBAL_BATCH = 8
STEPS = 6


def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
        f"--train.global_batch={GLOBAL_BATCH}", "--train.warmup_steps=2",
        "--train.eval_every=0", "--run.sample_tokens=0", "--train.peak_flops=1e10",
        # clipping by each island's own norm is not linear in the gradient: off
        "--train.grad_clip=0",
    ]


SGD = ["--train.optimizer=sgd", "--train.lr=0.05", "--train.min_lr=0.005"]
SYNC = ["--diloco.inner_steps=1", "--diloco.outer_lr=1", "--diloco.outer_momentum=0"]


def _dir(args: list[str]) -> Path:
    return Path(next(a for a in args if a.startswith("--run.dir=")).split("=", 1)[1])


def _train(args: list[str]) -> dict[int, float]:
    return train(load_config(None, args), log=lambda _m: None, progress=False).losses


def _train_all(runs: list[list[str]]) -> list[dict[int, float]]:
    """Body of the spawned world: each run in turn (the world of 4 re-split by each)."""
    return [_train(r) for r in runs]


@pytest.fixture(scope="module")
def world(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Every island run in one world of 4, and the one-process references."""
    root = tmp_path_factory.mktemp("diloco")
    base = base_args(corpus_dir, cache_dir)
    d = {name: f"--run.dir={root / name}" for name in (
        "ref-sgd", "ref-plain", "k1", "k4-dp1", "k2-tp2", "k2-pp2", "k2-cp2", "k2-zero1",
        "k2-tp2-fragments")}
    refs = {
        "ref-sgd": base + SGD + ["--train.micro_batch=8", d["ref-sgd"]],
        "ref-plain": base + ["--train.micro_batch=8", d["ref-plain"]],
        "k1": base + ["--train.micro_batch=8", "--parallel.islands=1",
                      "--diloco.inner_steps=2", "--diloco.outer_lr=0.5", d["k1"]],
    }
    zero1 = ["--parallel.islands=2", "--parallel.dp=2", "--parallel.zero=1",
             "--diloco.inner_steps=3", "--train.checkpoint_every=4", "--train.steps=8"]
    runs = {
        "k4-dp1": base + SGD + SYNC + ["--parallel.islands=4", "--parallel.dp=1", d["k4-dp1"]],
        "k2-tp2": base + SGD + SYNC + ["--parallel.islands=2", "--parallel.tp=2", d["k2-tp2"]],
        "k2-pp2": base + SGD + SYNC + ["--parallel.islands=2", "--parallel.pp=2",
                                       "--train.micro_batch=2", d["k2-pp2"]],
        "k2-cp2": base + SGD + SYNC + ["--parallel.islands=2", "--parallel.cp=2", d["k2-cp2"]],
        "k2-zero1": base + zero1 + [d["k2-zero1"]],
        "k2-tp2-fragments": base + ["--parallel.islands=2", "--parallel.tp=2",
                                    "--diloco.inner_steps=4", "--diloco.fragments=2",
                                    "--diloco.reduce_dtype=bf16", d["k2-tp2-fragments"]],
    }
    ref_losses = {k: _train(v) for k, v in refs.items()}
    got = dict(zip(runs, run_world(4, _train_all, list(runs.values()))[0], strict=True))
    # its checkpoint of step 4 (mid-way through the second round of 3), alone in a copy of
    # the run dir, resumed with the same command
    full, resumed = _dir(runs["k2-zero1"]), root / "k2-zero1-resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000008")
    resume = base + zero1 + [f"--run.dir={resumed}", "--run.resume=true"]
    got["k2-zero1-resumed"] = run_world(4, _train_all, [resume])[0][0]
    return root, ref_losses, got


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_one_island_is_the_plain_run(world) -> None:  # noqa: ANN001
    root, ref, _ = world
    assert ref["k1"] == ref["ref-plain"]
    worst, name = max_relative_difference(final_weights(root / "k1"),
                                          final_weights(root / "ref-plain"))
    assert worst == 0.0, (name, worst)


@pytest.mark.parametrize("run", ["k4-dp1", "k2-tp2", "k2-pp2", "k2-cp2"])
def test_one_inner_step_is_synchronous_training(run: str, world) -> None:  # noqa: ANN001
    """Each step's mean loss over the islands (``outer_loss``) and the final weights equal the
    one-process run's on the same global batch; every step is an outer step."""
    root, ref, _ = world
    recs = read_metrics(root / run / "metrics.jsonl")
    assert [r["outer_step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert _rel(r["outer_loss"], ref["ref-sgd"][r["step"]]) < 1e-5, (run, r["step"])
    worst, name = max_relative_difference(final_weights(root / run),
                                          final_weights(root / "ref-sgd"))
    assert worst < 1e-5, (run, name, worst)
    # the islands really trained on different data: their own losses differ from the mean
    assert any(abs(r["loss"] - r["outer_loss"]) > 1e-4 for r in recs)


def test_checkpoint_mid_round_resumes_exactly(world) -> None:  # noqa: ANN001
    """K = 2 islands of dp = 2, ZeRO-1, AdamW, H = 3: resumed from its checkpoint of step 4, the
    run equals the uninterrupted one (losses, outer losses and final weights), because the
    checkpoint holds each island's own weights and moments besides the outer state."""
    root, _, got = world
    full = {r["step"]: r for r in read_metrics(root / "k2-zero1" / "metrics.jsonl")}
    again = {r["step"]: r for r in read_metrics(root / "k2-zero1-resumed" / "metrics.jsonl")}
    assert sorted(full) == sorted(again) == list(range(1, 9))
    for step in range(5, 9):
        assert again[step]["loss"] == full[step]["loss"], step
        if "outer_loss" in full[step]:  # (a mean over islands: the same sum, reassociated)
            assert _rel(again[step]["outer_loss"], full[step]["outer_loss"]) < 1e-12, step
    assert [s for s in full if "outer_step" in full[s]] == [3, 6, 8]
    assert got["k2-zero1-resumed"] == {s: full[s]["loss"] for s in range(5, 9)}
    worst, name = max_relative_difference(final_weights(root / "k2-zero1-resumed"),
                                          final_weights(root / "k2-zero1"))
    assert worst == 0.0, (name, worst)
    # the islands drift apart between synchronisations and meet at the outer step
    assert full[8]["pseudo_grad_norm"] > 0


@pytest.mark.parametrize("run,state_bytes,itemsize,syncs", [
    ("k2-zero1", 8, 4, {3: [0], 6: [0], 8: [0]}),  # ZeRO-1 shards, AdamW, H = 3, 8 steps
    ("k2-tp2", 4, 4, {t: [0] for t in range(1, STEPS + 1)}),  # tp shards, SGD, H = 1
    ("k2-tp2-fragments", 8, 2, {2: [0], 4: [1], 6: [0, 1]}),  # F = 2, H = 4, bf16
])
def test_cross_island_traffic_only_at_synchronisations(
        run: str, state_bytes: int, itemsize: int, syncs: dict[int, list[int]],
        world) -> None:  # noqa: ANN001
    """``all_reduce/island`` appears only on synchronisation steps (fragments staggered, all on
    the last step), and over a round every element the rank owns crosses exactly once: bytes
    = owned elements (its optimizer state bytes / state bytes per element: a ZeRO shard, a tp
    slice) x the reduce dtype's size. Rank 0's metrics; ``island_bytes`` sums the island."""
    root, _, _ = world
    recs = read_metrics(root / run / "metrics.jsonl")
    owned = recs[-1]["optim_bytes"] // state_bytes
    assert {r["step"]: r["outer_fragments"] for r in recs if "outer_step" in r} == syncs
    sent = 0
    for r in recs:
        comm = r["comm_bytes"]
        if "outer_step" not in r:
            assert "all_reduce/island" not in comm, (run, r["step"], comm)
            continue
        shard = comm["all_reduce/island"]
        assert shard % itemsize == 0 and r["island_bytes"] >= shard
        if len(r["outer_fragments"]) == 2:  # one whole round of every fragment
            assert shard == owned * itemsize, (shard, owned)
        sent += shard
    rounds = len(syncs) if run != "k2-tp2-fragments" else 2
    assert sent == rounds * owned * itemsize
    if run != "k2-tp2-fragments":
        assert all(r["comm_bytes"]["all_reduce/island"] == owned * itemsize
                   for r in recs if "outer_step" in r)
        # both ranks of the island own the same number of elements here
        assert all(r["island_bytes"] == 2 * owned * itemsize for r in recs if "outer_step" in r)
    else:  # streaming: no single-fragment synchronisation sends more than ~half the shard
        single = [r["comm_bytes"]["all_reduce/island"] for r in recs
                  if len(r.get("outer_fragments", [])) == 1]
        assert single and max(single) < 0.75 * owned * itemsize, (single, owned)


def test_schedule_and_outer_step_by_hand() -> None:
    """Fragments synchronise staggered and all at the end; the outer step is torch's
    Nesterov SGD on the pseudo-gradient."""
    import torch

    assert [sync_fragments(t, 4, 2, 12) for t in range(1, 13)] == [
        [], [0], [], [1], [], [0], [], [1], [], [0], [], [0, 1]]
    assert [sync_fragments(t, 3, 1, 7) for t in range(1, 8)] == [
        [], [], [0], [], [], [0], [0]]
    assert [fragment_of(n, 4, 2) for n in ("tok_embeddings.weight", "layers.0.attn.wq.weight",
                                           "layers.1.x", "layers.2.x", "layers.3.x",
                                           "norm.weight")] == [0, 0, 0, 1, 1, 1]
    ref = torch.tensor([1.0, -2.0, 0.5])
    mom = torch.zeros(3)
    theta = torch.nn.Parameter(ref.clone())
    sgd = torch.optim.SGD([theta], lr=0.7, momentum=0.9, nesterov=True)
    for delta in (torch.tensor([0.1, 0.2, -0.3]), torch.tensor([-0.05, 0.4, 0.1])):
        outer_update(ref, mom, delta.clone(), 0.7, 0.9)
        theta.grad = delta.clone()
        sgd.step()
        assert torch.allclose(ref, theta.detach(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("run", ["k2-zero1", "k2-tp2", "k4-dp1"])
def test_planner_predicts_the_cross_island_bytes(run: str, world) -> None:  # noqa: ANN001
    """The planner's ``all_reduce/island`` volume per step, times H, is what a synchronisation
    step's comm log holds (within the padding of ZeRO's flat buffers)."""
    from meshlm.models.config import ModelConfig
    from meshlm.planner import comm_volumes
    from meshlm.planner.cli import config_workload

    root, _, _ = world
    cfg = load_config(root / run / "config.toml", check_paths=False)
    recs = read_metrics(root / run / "metrics.jsonl")
    last = sorted((root / run / "checkpoints").glob("step_*"))[-1]
    vocab = ModelConfig.from_dict(json.loads((last / "trainer.json").read_text())["model"])
    work = config_workload(cfg, vocab.vocab_size)
    per_step = comm_volumes(work, cfg.layout())["all_reduce/island"]
    measured = [r["comm_bytes"]["all_reduce/island"] for r in recs if "outer_step" in r]
    assert measured
    for got in measured:
        assert got == pytest.approx(per_step * cfg.diloco.inner_steps, rel=2e-3), (run, got)
