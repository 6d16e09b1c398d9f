"""Data parallelism (DDP, ZeRO-1/2/3) against the one-process reference.

One spawned gloo world per dp size runs every (zero stage, accumulation) layout in sequence;
each layout must reproduce the reference run's first 5 losses and final weights (fp32,
relative difference < 1e-5), hold the bytes the ZeRO paper's formulas give, and send the
bytes its module docstring states.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from meshlm.config import load_config
from meshlm.testing import final_weights, max_relative_difference, run_world, train_runs
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

GLOBAL_BATCH = 8
STEPS = 5


def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
        f"--train.global_batch={GLOBAL_BATCH}", "--train.warmup_steps=2", "--train.eval_every=0",
        "--run.sample_tokens=0", "--train.peak_flops=1e10",
        # a clip threshold below the gradient norms: clipping by the global norm is exercised
        "--train.grad_clip=0.5",
        # small buckets: several buckets per model, so overlap and padding are exercised
        "--parallel.bucket_mb=0.05",
    ]


def layouts(dp: int, root: Path) -> list[list[str]]:
    out = []
    for zero in (0, 1, 2, 3):
        for accum in (1, 2):
            micro = GLOBAL_BATCH // dp // accum
            out.append([f"--parallel.dp={dp}", f"--parallel.zero={zero}",
                        f"--train.micro_batch={micro}",
                        f"--run.dir={root / f'dp{dp}-zero{zero}-accum{accum}'}"])
    return out






@pytest.fixture(scope="module")
def reference(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("dp")
    base = base_args(corpus_dir, cache_dir)
    ref = train(load_config(None, base + [f"--train.micro_batch={GLOBAL_BATCH}",
                                          f"--run.dir={root / 'reference'}"]),
                log=lambda _m: None, progress=False)
    return base, root, ref.losses, final_weights(root / "reference")


def n_params(run_dir: Path) -> int:
    return sum(t.numel() for t in final_weights(run_dir).values())


def check_layout(run_dir: Path, losses: dict[int, float], reference) -> None:  # noqa: ANN001
    _, _, ref_losses, ref_weights = reference
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in ref_losses.items():
        assert abs(losses[step] - loss) / abs(loss) < 1e-5, (run_dir.name, step, losses[step], loss)
    worst, name = max_relative_difference(final_weights(run_dir), ref_weights)
    assert worst < 1e-5, (run_dir.name, name, worst)
    ref_norms = [r["grad_norm"] for r in read_metrics(run_dir.parent / "reference" / "metrics.jsonl")]
    norms = [r["grad_norm"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert min(ref_norms) > 0.5  # every step clips
    for got, ref in zip(norms, ref_norms, strict=True):
        assert abs(got - ref) / ref < 1e-5, (run_dir.name, got, ref)


def check_memory(run_dir: Path, dp: int, zero: int) -> None:
    """Bytes held per rank vs the ZeRO paper's formulas with fp32 weights/grads, K = 8 (Adam)."""
    psi = n_params(run_dir)
    rec = read_metrics(run_dir / "metrics.jsonl")[-1]
    expected = {
        0: (4 * psi, 4 * psi, 8 * psi),
        1: (4 * psi, 4 * psi, 8 * psi / dp),
        2: (4 * psi, 4 * psi / dp, 8 * psi / dp),
        3: (4 * psi / dp, 4 * psi / dp, 8 * psi / dp),
    }[zero]
    got = (rec["params_bytes"], rec["grads_bytes"], rec["optim_bytes"])
    for what, g, e in zip(("params", "grads", "optim"), got, expected, strict=True):
        assert abs(g - e) / e < 0.05, (run_dir.name, what, g, e)
    assert abs(sum(got) - sum(expected)) / sum(expected) < 0.05


def check_comm(run_dir: Path, dp: int, zero: int, accum: int) -> None:
    """Bytes per step of each collective vs the module docstrings (padding bounded exactly)."""
    psi = n_params(run_dir)
    weights = final_weights(run_dir)
    psi_layers = sum(t.numel() for n, t in weights.items() if n.startswith("layers."))
    for rec in read_metrics(run_dir / "metrics.jsonl"):
        got = rec["comm_bytes"]
        if zero == 0:
            theory = {"all_reduce/dp": 4 * psi}
        elif zero == 1:
            theory = {"reduce_scatter/dp": 4 * psi, "all_gather/dp": 4 * psi}
        elif zero == 2:
            theory = {"reduce_scatter/dp": 4 * psi * accum, "all_gather/dp": 4 * psi}
        else:
            theory = {"reduce_scatter/dp": 4 * psi * accum,
                      "all_gather/dp": 4 * (psi + psi_layers) * accum}
        if zero:
            theory["all_reduce/dp"] = 8  # the squared gradient norm of the shards (float64)
        assert set(got) == set(theory), (run_dir.name, got)
        for op, value in theory.items():
            # each flat buffer is padded by fewer than dp elements; at most 64 buffers here
            slack = 0 if op == "all_reduce/dp" else 4 * (dp - 1) * 64 * accum * 2
            assert value <= got[op] <= value + slack, (op, got[op], value)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_layouts_match_single_process(dp: int, reference) -> None:  # noqa: ANN001
    base, root, _, _ = reference
    runs = layouts(dp, root)
    if dp == 1:
        results = train_runs(base, runs)
    else:
        results = run_world(dp, train_runs, base, runs)[0]
    for args, losses in zip(runs, results, strict=True):
        run_dir = Path(args[-1].split("=", 1)[1])
        zero = int(args[1].split("=")[1])
        accum = GLOBAL_BATCH // dp // int(args[2].split("=")[1])
        check_layout(run_dir, losses, reference)
        check_memory(run_dir, dp, zero)
        if dp > 1:
            check_comm(run_dir, dp, zero, accum)


# ---------------------------------------------------------------------- overlap and sync
def overlap_probe(delay_s: float) -> dict:
    """DDP on 2 ranks: a sleep injected at the start of the embedding's backward."""
    from meshlm.config import TrainSection
    from meshlm.distributed.comm import Comm, CommLog
    from meshlm.distributed.mesh import Mesh
    from meshlm.layout import Layout
    from meshlm.models import build_model, get_preset
    from meshlm.parallel.data import DDPEngine

    model = build_model(get_preset("tiny"), seed=0)
    log = CommLog()
    comm = Comm(Mesh(Layout(dp=2)), log)
    engine = DDPEngine(model, TrainSection(), comm, bucket_mb=0.05)

    def slow(module, args, out):  # noqa: ANN001, ANN202
        out.register_hook(lambda g: time.sleep(delay_s))  # runs before embedding backward

    model.tok_embeddings.register_forward_hook(slow)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(comm.rank("dp")))
    # accumulation micro-batch: no communication at all
    engine.set_sync(False)
    model(ids).float().pow(2).mean().backward()
    silent = len(log.records)
    engine.set_sync(True)
    t_start = time.perf_counter()
    model(ids).float().pow(2).mean().backward()
    t_end = time.perf_counter()
    engine.finish_grads()
    return {"silent": silent, "buckets": len(engine.buckets), "start": t_start, "end": t_end,
            "launches": [r.time for r in log.records if r.op == "all_reduce"]}


def test_ddp_all_reduce_overlaps_backward() -> None:
    delay = 0.5
    for res in run_world(2, overlap_probe, delay):
        assert res["silent"] == 0  # no communication before the last micro-batch
        assert res["buckets"] > 2 and len(res["launches"]) == res["buckets"]
        first = min(res["launches"])
        # the first ready bucket's all-reduce starts while backward is still running,
        # before the injected delay (which precedes the embedding's backward) is over
        assert res["start"] < first < res["end"] - 0.8 * delay


# ---------------------------------------------------------------------- resharding resume
def train_one(base: list[str], extra: list[str]) -> dict[int, float]:
    return train(load_config(None, base + extra), log=lambda _m: None, progress=False).losses


def test_checkpoints_resume_on_another_layout(reference, tmp_path: Path) -> None:  # noqa: ANN001
    """A ZeRO-3 dp=2 checkpoint resumes on one process, and a one-process one on ZeRO-1 dp=2."""
    import shutil

    base, _, _, _ = reference
    six = ["--train.steps=6", "--train.checkpoint_every=3"]
    sharded = tmp_path / "zero3"
    full = run_world(2, train_one, base, six + ["--parallel.dp=2", "--parallel.zero=3",
                                                "--train.micro_batch=4", f"--run.dir={sharded}"])[0]
    single = tmp_path / "single"
    single_losses = train_one(base, six + ["--train.micro_batch=8", f"--run.dir={single}"])
    for src, layout, losses in (
        (sharded, ["--train.micro_batch=8"], full),
        (single, ["--parallel.dp=2", "--parallel.zero=1", "--train.micro_batch=2"],
         single_losses),
    ):
        cut = tmp_path / f"{src.name}-cut"
        shutil.copytree(src, cut)
        shutil.rmtree(cut / "checkpoints" / "step_0000006")
        args = six + layout + [f"--run.dir={cut}", "--run.resume=true"]
        if "--parallel.dp=2" in layout:
            resumed = run_world(2, train_one, base, args)[0]
        else:
            resumed = train_one(base, args)
        assert sorted(resumed) == [4, 5, 6]
        for step in (4, 5, 6):
            assert abs(resumed[step] - losses[step]) / losses[step] < 1e-5, (src.name, step)
        worst, name = max_relative_difference(final_weights(cut), final_weights(src))
        assert worst < 1e-5, (src.name, name, worst)
