"""Pipeline parallelism against the one-process reference, for every schedule.

Global batch 8; m micro-batches of 8 / m sequences. Layer counts: 5 (not divisible by 2 or 4)
for AFAB / 1F1B / ZB, 8 for interleaved with 2 virtual stages per rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlm.config import load_config
from meshlm.testing import final_weights, max_relative_difference, run_world, train_runs
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

GLOBAL_BATCH, STEPS = 8, 5


def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
        f"--train.global_batch={GLOBAL_BATCH}", "--train.warmup_steps=2", "--train.eval_every=5",
        "--run.sample_tokens=0", "--train.peak_flops=1e10", "--train.grad_clip=0.5",
        # AdamW moves an element by ~lr * g / (|g| + eps): for a token seen once in these 5 steps,
        # gradient elements near eps = 1e-8 turn last-bit differences of any reordered sum into
        # O(lr) steps of that one embedding row. eps = 1e-6 keeps the comparison about the
        # parallel math (measured: 5e-5 -> below 1e-5 for tp x pp on this corpus).
        "--train.eps=1e-6",
    ]


@pytest.fixture(scope="module")
def references(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("pp")
    base = base_args(corpus_dir, cache_dir)
    refs = {}
    for layers in (5, 8):
        run_dir = root / f"reference-{layers}"
        res = train(load_config(None, base + [f"--model.n_layers={layers}", "--train.micro_batch=8",
                                              f"--run.dir={run_dir}"]),
                    log=lambda _m: None, progress=False)
        refs[layers] = (res.losses, final_weights(run_dir), res.val_losses)
    return base, root, refs


def layouts(pp: int, root: Path, extra: list[str] | None = None, schedules=None) -> list[list[str]]:  # noqa: ANN001
    runs = []
    for schedule in schedules or ("afab", "1f1b", "interleaved", "zb"):
        for m in (pp, 2 * pp):
            layers, v = (8, 2) if schedule == "interleaved" else (5, 1)
            name = f"pp{pp}-{schedule}-m{m}" + "".join(x.split(".")[-1] for x in extra or [])
            runs.append([f"--model.n_layers={layers}", f"--parallel.pp={pp}",
                         f"--parallel.pp_schedule={schedule}", f"--parallel.pp_virtual={v}",
                         f"--train.micro_batch={GLOBAL_BATCH // m // _dp(extra)}",
                         *(extra or []), f"--run.dir={root / name}"])
    return runs


def _dp(extra: list[str] | None) -> int:
    return 2 if extra and "--parallel.dp=2" in extra else 1


def check(runs: list[list[str]], results: list[dict[int, float]], refs) -> None:  # noqa: ANN001
    for args, losses in zip(runs, results, strict=True):
        layers = int(args[0].split("=")[1])
        ref_losses, ref_weights, ref_val = refs[layers]
        run_dir = Path(args[-1].split("=", 1)[1])
        for step, loss in ref_losses.items():
            assert abs(losses[step] - loss) / loss < 1e-5, (run_dir.name, step)
        worst, name = max_relative_difference(final_weights(run_dir), ref_weights)
        assert worst < 1e-5, (run_dir.name, name, worst)
        records = read_metrics(run_dir / "metrics.jsonl")
        assert abs(records[-1]["val_loss"] - ref_val[STEPS]) / ref_val[STEPS] < 1e-5
        schedule = args[2].split("=")[1]
        pp = int(args[1].split("=")[1])
        m = GLOBAL_BATCH // int(args[4].split("=")[1]) // _dp(args)
        peak = records[-1]["pp_peak_live"]  # rank 0 = stage 0
        if schedule == "afab":
            assert peak == m, (run_dir.name, peak)
        elif schedule in ("1f1b", "zb"):
            assert peak <= pp, (run_dir.name, peak)
        assert 0.0 < records[-1]["pp_bubble"] < 1.0
        assert len(list((run_dir / "timeline").glob("rank_*.json"))) == pp * _dp(args) * (
            2 if "--parallel.tp=2" in args else 1)


@pytest.mark.parametrize("pp", [2, 4])
def test_schedules_match_single_process(pp: int, references) -> None:  # noqa: ANN001
    base, root, refs = references
    runs = layouts(pp, root)
    check(runs, run_world(pp, train_runs, base, runs)[0], refs)


def test_pipeline_with_dp_and_tp(references) -> None:  # noqa: ANN001
    """8 workers: pp 4 x dp 2 (ZeRO-1, 1F1B) and pp 4 x tp 2 (sequence parallel, ZB)."""
    base, root, refs = references
    runs = (layouts(4, root, ["--parallel.dp=2", "--parallel.zero=1"], ["1f1b"])[:1]
            + layouts(4, root, ["--parallel.tp=2", "--parallel.sp=true"], ["zb"])[:1])
    check(runs, run_world(8, train_runs, base, runs)[0], refs)


def test_tied_embeddings_across_stages(references, tmp_path: Path) -> None:  # noqa: ANN001
    """The first and last stage hold copies of a tied embedding; their gradients are summed."""
    base, _, _ = references
    tied = base + ["--model.n_layers=5", "--model.tie_embeddings=true"]
    ref_dir = tmp_path / "reference"
    ref = train(load_config(None, tied + ["--train.micro_batch=8", f"--run.dir={ref_dir}"]),
                log=lambda _m: None, progress=False)
    ref_norms = [r["grad_norm"] for r in read_metrics(ref_dir / "metrics.jsonl")]
    runs = [["--parallel.pp=4", "--parallel.pp_schedule=zb", "--train.micro_batch=2",
             f"--run.dir={tmp_path / 'pp4-zb'}"],
            ["--parallel.pp=2", "--parallel.dp=2", "--parallel.zero=3", "--train.micro_batch=2",
             f"--run.dir={tmp_path / 'pp2-dp2-zero3'}"]]
    results = run_world(4, train_runs, tied, runs)[0]
    for args, losses in zip(runs, results, strict=True):
        run_dir = Path(args[-1].split("=", 1)[1])
        for step, loss in ref.losses.items():
            assert abs(losses[step] - loss) / loss < 1e-5, (run_dir.name, step)
        weights = final_weights(run_dir)
        assert "output.weight" not in weights  # saved once, as in a one-process run
        worst, name = max_relative_difference(weights, final_weights(ref_dir))
        assert worst < 1e-5, (run_dir.name, name, worst)
        norms = [r["grad_norm"] for r in read_metrics(run_dir / "metrics.jsonl")]
        for got, want in zip(norms, ref_norms, strict=True):
            assert abs(got - want) / want < 1e-5  # the tied gradient counts once


def test_end_stages_without_decoder_layers(references) -> None:  # noqa: ANN001
    """An explicit split whose first stage holds only the embedding and whose last holds only
    the final norm, head and loss (Megatron-Core's account-for-embedding / loss in the pipeline
    split): 1F1B and ZB over 4 stages, and interleaved over 8 chunks on 4 ranks."""
    base, root, refs = references
    runs = [
        ["--model.n_layers=5", "--parallel.pp=4", "--parallel.pp_schedule=1f1b",
         "--parallel.pp_virtual=1", "--train.micro_batch=2", "--parallel.pp_layers=0,3,2,0",
         f"--run.dir={root / 'pp4-1f1b-ends'}"],
        ["--model.n_layers=5", "--parallel.pp=4", "--parallel.pp_schedule=zb",
         "--parallel.pp_virtual=1", "--train.micro_batch=1", "--parallel.pp_layers=0,2,3,0",
         f"--run.dir={root / 'pp4-zb-ends'}"],
        ["--model.n_layers=8", "--parallel.pp=4", "--parallel.pp_schedule=interleaved",
         "--parallel.pp_virtual=2", "--train.micro_batch=2",
         "--parallel.pp_layers=0,2,1,1,1,1,2,0", f"--run.dir={root / 'pp4-interleaved-ends'}"],
    ]
    check(runs, run_world(4, train_runs, base, runs)[0], refs)
