"""Hybrid sharding (``parallel.dp_shard`` < dp, HSDP) against the one-process reference.

One spawned world of 4 runs dp 4 sharded 2 ways under ZeRO-1/2/3 (with gradient accumulation),
cp (dp 2, dp_shard 1: the shard group is dp_shard x cp) and experts (dp 4, dp_shard 2, ep 2);
one world of 8 composes dp 4 dp_shard 2 (shard groups of two ranks, two replicas) with tp + sp,
pp (ZeRO-1 and 3) and DiLoCo islands. Each must reproduce the reference's losses, gradient norms and final weights
(fp32, relative 1e-5, as the other parity tests); each rank must hold 1/dp_shard of the
one-process state where ZeRO shards it; the comm log must show gradient shards all-reduced
across the replicas (dp_rep) once per step and parameters gathered within the shard group
only. A checkpoint written under hybrid sharding resumes exactly under plain ZeRO-3 and on
another dp x tp layout, and one written on such a layout resumes under hybrid sharding.
Optimizer states offloaded to disk step the shards as on the device.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from meshlm.config import load_config
from meshlm.testing import final_weights, max_relative_difference, run_world, train_runs
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

STEPS, GLOBAL_BATCH = 4, 8
SGD_SYNC = ["--train.optimizer=sgd", "--train.lr=0.05", "--train.min_lr=0.005",
            "--diloco.inner_steps=1", "--diloco.outer_lr=1", "--diloco.outer_momentum=0",
            "--train.grad_clip=0"]
REFERENCES = {"dense": [], "moe": ["--model.preset=tiny-moe"], "sgd": SGD_SYNC}
HSDP = ["--parallel.dp=4", "--parallel.dp_shard=2"]
ONE = ["--parallel.dp=2", "--parallel.dp_shard=1"]  # shard groups of one rank (x cp)
# (name, reference, arguments) -- the world is 4 ranks
LAYOUTS = [
    ("zero1", "dense", [*HSDP, "--parallel.zero=1", "--train.micro_batch=2"]),
    ("zero2", "dense", [*HSDP, "--parallel.zero=2", "--train.micro_batch=1"]),
    ("zero3", "dense", [*HSDP, "--parallel.zero=3", "--train.micro_batch=1"]),
    ("zero3-plain", "dense", ["--parallel.dp=4", "--parallel.zero=3", "--train.micro_batch=1"]),
    ("cp2-zero2", "dense", [*ONE, "--parallel.cp=2", "--parallel.zero=2",
                            "--train.micro_batch=2"]),
    ("ep2-zero1", "moe", [*HSDP, "--parallel.ep=2", "--parallel.zero=1",
                          "--model.preset=tiny-moe", "--train.micro_batch=2"]),
    ("ep2-zero3", "moe", [*HSDP, "--parallel.ep=2", "--parallel.zero=3",
                          "--model.preset=tiny-moe", "--train.micro_batch=2"]),
    ("zero2-disk", "dense", [*HSDP, "--parallel.zero=2", "--parallel.offload=disk",
                             "--train.micro_batch=2"]),
]
# (name, reference, arguments) -- the world is 8 ranks: dp 4 in shard groups of 2, times 2
LAYOUTS_8 = [
    ("tp2-sp-zero3", "dense", [*HSDP, "--parallel.tp=2", "--parallel.sp=true",
                               "--parallel.zero=3", "--train.micro_batch=2"]),
    ("pp2-zero1", "dense", [*HSDP, "--parallel.pp=2", "--parallel.zero=1",
                            "--train.micro_batch=1"]),
    ("pp2-zero3", "dense", [*HSDP, "--parallel.pp=2", "--parallel.zero=3",
                            "--train.micro_batch=1"]),
    ("islands2", "sgd", ["--parallel.islands=2", *HSDP, "--parallel.zero=2",
                         "--train.micro_batch=1", *SGD_SYNC]),
]
CKPT = ["--train.steps=6", "--train.checkpoint_every=3"]
DP2_TP2 = ["--parallel.dp=2", "--parallel.tp=2"]


def base_args(corpus: Path, cache: Path) -> list[str]:
    return ["--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
            "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
            f"--train.global_batch={GLOBAL_BATCH}", "--train.warmup_steps=2",
            "--train.eval_every=0", "--run.sample_tokens=0", "--train.peak_flops=1e10",
            # a clip threshold below the gradient norms: clipping by the global norm runs
            "--train.grad_clip=0.5", "--train.eps=1e-5",
            # small buckets: several buckets per group, padding in each
            "--parallel.bucket_mb=0.05"]


@pytest.fixture(scope="module")
def world(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The layouts in a world of 4 (with the runs checkpoints are cut from) and a world of 8,
    the one-process references in this process."""
    root = tmp_path_factory.mktemp("hsdp")
    base = base_args(corpus_dir, cache_dir)
    refs = {}
    for key, extra in REFERENCES.items():
        run_dir = root / f"ref-{key}"
        train(load_config(None, base + extra + ["--train.micro_batch=8", f"--run.dir={run_dir}"]),
              log=lambda _m: None, progress=False)
        refs[key] = run_dir
    runs = [[*args, f"--run.dir={root / name}"] for name, _, args in LAYOUTS]
    saved = {"saved": [*HSDP, "--parallel.zero=3", "--train.micro_batch=2"],
             "saved-plain": [*DP2_TP2, "--parallel.zero=1", "--train.micro_batch=4"]}
    runs += [[*args, *CKPT, f"--run.dir={root / name}"] for name, args in saved.items()]
    results = run_world(4, train_runs, base, runs)[0]
    results += run_world(8, train_runs, base,
                         [[*args, f"--run.dir={root / name}"] for name, _, args in LAYOUTS_8])[0]
    names = [name for name, _, _ in LAYOUTS] + list(saved) + [name for name, _, _ in LAYOUTS_8]
    losses = dict(zip(names, results, strict=True))
    return base, root, refs, losses


def n_params(run_dir: Path) -> tuple[int, int]:
    """Parameters in all, and in the decoder layers."""
    weights = final_weights(run_dir)
    return (sum(t.numel() for t in weights.values()),
            sum(t.numel() for n, t in weights.items() if n.startswith("layers.")))


def test_layouts_match_one_process(world) -> None:  # noqa: ANN001
    _, root, refs, losses = world
    for name, key, _ in LAYOUTS + LAYOUTS_8:
        ref = {r["step"]: r for r in read_metrics(refs[key] / "metrics.jsonl")}
        records = {r["step"]: r for r in read_metrics(root / name / "metrics.jsonl")}
        got = losses[name]
        if key == "sgd":  # DiLoCo: rank 0's loss is its island's; the mean is outer_loss
            got = {s: r["outer_loss"] for s, r in records.items()}
        assert sorted(got) == sorted(ref), name
        for step, r in ref.items():
            assert abs(got[step] - r["loss"]) / r["loss"] < 1e-5, (name, step, got[step])
            if key != "sgd":
                assert min(x["grad_norm"] for x in ref.values()) > 0.5  # every step clips
                rel = abs(records[step]["grad_norm"] - r["grad_norm"]) / r["grad_norm"]
                assert rel < 1e-5, (name, step)
        worst, tensor = max_relative_difference(final_weights(root / name),
                                                final_weights(refs[key]))
        assert worst < 1e-5, (name, tensor, worst)


def test_each_rank_holds_one_shard_group_share(world) -> None:  # noqa: ANN001
    """ZeRO-1: optimizer states / dp_shard; ZeRO-2: gradients too; ZeRO-3: parameters too --
    and dp_shard = 2 of dp = 4 holds twice what dp_shard = dp = 4 holds."""
    _, root, refs, _ = world
    one = read_metrics(refs["dense"] / "metrics.jsonl")[-1]
    sharded = {1: ("optim",), 2: ("optim", "grads"), 3: ("optim", "grads", "params")}
    for zero, kinds in sharded.items():
        rec = read_metrics(root / f"zero{zero}" / "metrics.jsonl")[-1]
        for kind in ("params", "grads", "optim"):
            share = 2 if kind in kinds else 1
            got, whole = rec[f"{kind}_bytes"], one[f"{kind}_bytes"]
            assert abs(got * share - whole) / whole < 0.02, (zero, kind, got, whole)
    plain = read_metrics(root / "zero3-plain" / "metrics.jsonl")[-1]
    hybrid = read_metrics(root / "zero3" / "metrics.jsonl")[-1]
    for kind in ("params", "grads", "optim"):
        ratio = hybrid[f"{kind}_bytes"] / plain[f"{kind}_bytes"]
        assert abs(ratio - 2) < 0.04, (kind, ratio)


def test_shards_are_reduced_across_replicas_once_per_step(world) -> None:  # noqa: ANN001
    """Per step: reduce-scatters and gathers within the shard group (dp_shard), and one
    all-reduce across dp_rep of every gradient shard -- the gradient bytes / dp_shard."""
    _, root, _, _ = world
    psi, psi_layers = n_params(root / "zero3")
    for zero, accum in ((1, 1), (2, 2), (3, 2)):
        for rec in read_metrics(root / f"zero{zero}" / "metrics.jsonl"):
            got = rec["comm_bytes"]
            assert set(got) == {"reduce_scatter/dp_shard", "all_gather/dp_shard",
                                "all_reduce/dp_rep", "all_reduce/dp"}, (zero, got)
            scattered = got["reduce_scatter/dp_shard"]  # every micro-batch under ZeRO-2/3
            per_pass = 4 * psi if zero == 1 else 4 * psi * accum
            assert per_pass <= scattered <= per_pass + 4 * 64 * accum, (zero, scattered)
            assert got["all_reduce/dp_rep"] * 2 * (1 if zero == 1 else accum) == scattered
            gathered = 4 * psi if zero < 3 else 4 * (psi + psi_layers) * accum
            assert gathered <= got["all_gather/dp_shard"] <= gathered + 4 * 64 * 2 * accum
            assert got["all_reduce/dp"] == 8  # the squared gradient norm
    # composed with tp + sp, pp and islands: shard groups of two ranks, two replicas
    for name, _, _ in LAYOUTS_8:
        for rec in read_metrics(root / name / "metrics.jsonl"):
            got = rec["comm_bytes"]
            assert got["all_reduce/dp_rep"] * 2 == got["reduce_scatter/dp_shard"] > 0, (name, got)
            gathers = {k for k in got if k.startswith("all_gather/") and k != "all_gather/tp"}
            assert gathers == {"all_gather/dp_shard"}, (name, got)
    # with the shard group x cp, and the expert groups (edp_shard, replicas on dp_rep)
    cp = read_metrics(root / "cp2-zero2" / "metrics.jsonl")[-1]["comm_bytes"]
    assert cp["all_reduce/dp_rep"] * 2 * 2 == cp["reduce_scatter/dp_shard_cp"]
    assert "all_gather/dp_shard_cp" in cp and "all_gather/dp_cp" not in cp
    ep = read_metrics(root / "ep2-zero3" / "metrics.jsonl")[-1]["comm_bytes"]
    assert "all_gather/dp_shard" in ep and not {"all_gather/dp", "all_gather/edp"} & set(ep)


def test_checkpoints_reshard_to_and_from_hybrid_sharding(world) -> None:  # noqa: ANN001
    """Saved under dp 4 dp_shard 2 ZeRO-3 at step 3: resumed under plain ZeRO-3 dp 4 and under
    dp 2 x tp 2 with ZeRO-1; saved under dp 2 x tp 2: resumed under dp 4 dp_shard 2 ZeRO-2.
    Each continues its uncut run exactly."""
    base, root, _, losses = world
    resumes = {  # name: (saved run, layout resumed on)
        "to-zero3-dp4": ("saved", ["--parallel.dp=4", "--parallel.zero=3",
                                   "--train.micro_batch=2"]),
        "to-dp2-tp2": ("saved", [*DP2_TP2, "--parallel.zero=1", "--train.micro_batch=4"]),
        "to-hybrid": ("saved-plain", [*HSDP, "--parallel.zero=2", "--train.micro_batch=2"]),
    }
    runs = []
    for name, (src, layout) in resumes.items():
        shutil.copytree(root / src, root / name)
        shutil.rmtree(root / name / "checkpoints" / "step_0000006")
        runs.append([*layout, *CKPT, f"--run.dir={root / name}", "--run.resume=true"])
    results = run_world(4, train_runs, base, runs)[0]
    for (name, (src, _)), resumed in zip(resumes.items(), results, strict=True):
        assert sorted(resumed) == [4, 5, 6], name
        for step in (4, 5, 6):
            assert abs(resumed[step] - losses[src][step]) / losses[src][step] < 1e-5, \
                (name, step)
        worst, tensor = max_relative_difference(final_weights(root / name),
                                                final_weights(root / src))
        assert worst < 1e-5, (name, tensor, worst)
