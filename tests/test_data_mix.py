"""Mixtures of prepared datasets (``data.mix``).

- every batch takes each source's share to within one sequence (systematic sampling), the
  shares over many batches converge to the weights, and the batch of step k depends only on
  (seed, k): the data-parallel ranks' micro-batches of any dp put together are the one-process
  batch, document ids included;
- training on a mixture: dp 2, and cp 2 (zigzag) with document masking, match one process;
  a run resumed from a checkpoint continues exactly;
- a weight that is not a positive number, a folder named twice or missing, and data.mix with
  data.path: one line each, from the config, before anything runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from meshlm.config import ConfigError, load_config
from meshlm.data.prepare import prepare
from meshlm.data.sampler import Source, StepSampler
from meshlm.data.shards import open_prepared
from meshlm.testing import final_weights, max_relative_difference, run_world, train_runs
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

STEPS = 4


@pytest.fixture(scope="module")
def datasets(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two prepared datasets of different halves of the test corpus, one tokenizer."""
    root = tmp_path_factory.mktemp("mix")
    files = sorted(corpus_dir.iterdir())
    halves = [files[: len(files) // 2], files[len(files) // 2 :]]
    a, b = root / "a", root / "b"
    prepare([str(f) for f in halves[0]], a, vocab_size=512, log=lambda _m: None)
    prepare([str(f) for f in halves[1]], b, tokenizer=str(a / "tokenizer.json"),
            log=lambda _m: None)
    return a, b


def _sources(datasets: tuple[Path, Path], split: str = "train") -> list[Source]:
    out = []
    for path, weight in zip(datasets, (0.7, 0.3), strict=True):
        stream = getattr(open_prepared(path), split)
        out.append(Source(stream, weight, stream.doc_starts, path.name))
    return out


def test_each_batch_holds_each_source_by_weight(datasets: tuple[Path, Path]) -> None:
    sampler = StepSampler(_sources(datasets), 32, 8, seed=3)
    counts = []
    for k in range(400):
        which, offsets = sampler.draw(k)
        counts.append(int((which == 0).sum()))
        for i, src in enumerate(sampler.sources):  # offsets inside their own source
            assert offsets[which == i].max(initial=0) <= len(src.tokens) - 33
    assert set(counts) <= {5, 6}  # 0.7 * 8 = 5.6: 5 or 6, never further off
    assert abs(np.mean(counts) / 8 - 0.7) < 0.01
    again = StepSampler(_sources(datasets), 32, 8, seed=3)
    assert all(np.array_equal(sampler.draw(k)[1], again.draw(k)[1]) for k in (0, 7, 99))
    assert not np.array_equal(sampler.draw(5)[0], StepSampler(_sources(datasets), 32, 8,
                                                              seed=4).draw(5)[0])


@pytest.mark.parametrize("dp", [2, 4])
def test_the_ranks_of_any_dp_read_the_one_process_batch(datasets: tuple[Path, Path],
                                                         dp: int) -> None:
    sampler = StepSampler(_sources(datasets), 32, 8, seed=1, doc_mask=True)
    one = sampler.rank_micro_batches(6, 0, 1, 8)[0]
    micro = 8 // dp // 2
    ranks = [sampler.rank_micro_batches(6, r, dp, micro) for r in range(dp)]
    # micro-batch i of rank r holds rows [(i dp + r) m, (i dp + r + 1) m) of the global batch
    rows = [ranks[r][i] for i in range(2) for r in range(dp)]
    for j in range(3):  # inputs, targets, document ids
        assert torch.equal(torch.cat([mb[j] for mb in rows]), one[j])


def _args(datasets: tuple[Path, Path], cache: Path) -> list[str]:
    a, b = datasets
    return ["--model.preset=tiny", f"--data.mix={a}:0.7,{b}:0.3", f"--data.cache_dir={cache}",
            "--data.seq_len=32", f"--train.steps={STEPS}", "--train.global_batch=8",
            "--train.micro_batch=4", "--train.warmup_steps=2", "--train.eval_every=4",
            "--train.eval_batches=2", "--run.sample_tokens=0", "--train.peak_flops=1e10",
            # (an eps well above the gradients' rounding: Adam's first steps would otherwise
            # turn last-bit differences of near-zero gradients into whole lr-sized steps)
            "--train.eps=1e-5"]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}


RUNS = {"dp2": ["--parallel.dp=2"],
        "cp2-doc-mask": ["--parallel.cp=2", "--data.doc_mask=true"]}


def test_training_on_a_mixture_matches_one_process_and_resumes_exactly(
        datasets: tuple[Path, Path], cache_dir: Path, tmp_path: Path) -> None:
    base = _args(datasets, cache_dir)
    refs = {"dp2": tmp_path / "ref", "cp2-doc-mask": tmp_path / "ref-doc-mask"}
    train(load_config(None, [*base, f"--run.dir={refs['dp2']}", "--train.checkpoint_every=2"]),
          log=lambda _m: None, progress=False)
    train(load_config(None, [*base, f"--run.dir={refs['cp2-doc-mask']}",
                             "--data.doc_mask=true"]), log=lambda _m: None, progress=False)
    runs = [[*args, f"--run.dir={tmp_path / name}"] for name, args in RUNS.items()]
    results = run_world(2, train_runs, base, runs)[0]
    for (name, _), got in zip(RUNS.items(), results, strict=True):
        ref = _losses(refs[name])
        assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), name
        assert max(abs(got[s] - ref[s]) / ref[s] for s in ref) < 1e-5, (name, got, ref)
        weights, tensor = max_relative_difference(final_weights(tmp_path / name),
                                                  final_weights(refs[name]))
        print(f"{name}: weights {weights:.1e} ({tensor})")
        assert weights < 1e-5, (name, tensor, weights)
    # resume: drop the last checkpoint, continue from step 2
    into = tmp_path / "resumed"
    shutil.copytree(refs["dp2"], into)
    shutil.rmtree(into / "checkpoints" / f"step_{STEPS:07d}")
    train(load_config(None, [*base, f"--run.dir={into}", "--run.resume=auto"]),
          log=lambda _m: None, progress=False)
    resumed = {r["step"]: r["loss"] for r in read_metrics(into / "metrics.jsonl")
               if r["step"] > 2}
    assert resumed == {s: _losses(refs["dp2"])[s] for s in (3, 4)}


@pytest.mark.parametrize(("mix", "message"), [
    ("{a}:0.7,{b}:0", "'{b}:0' is not FOLDER:WEIGHT with a positive number"),
    ("{a}:-1,{b}:1", "'{a}:-1' is not FOLDER:WEIGHT"),
    ("{a}:x,{b}:1", "'{a}:x' is not FOLDER:WEIGHT"),
    ("{a},{b}:1", "'{a}' is not FOLDER:WEIGHT"),
    ("{a}:nan,{b}:1", "'{a}:nan' is not FOLDER:WEIGHT"),
    ("{a}:1,{a}:2", "data.mix names '{a}' twice"),
    ("{a}:1,{a}/missing:1", "data.mix: '{a}/missing' is not a folder"),
])
def test_bad_mixtures_are_one_line_before_anything_runs(
        datasets: tuple[Path, Path], mix: str, message: str) -> None:
    a, b = datasets
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--data.mix={mix.format(a=a, b=b)}"])
    assert message.format(a=a, b=b) in str(err.value)
    assert "\n" not in str(err.value)


def test_mix_and_path_together_are_refused(datasets: tuple[Path, Path]) -> None:
    a, b = datasets
    with pytest.raises(ConfigError, match="both name the data"):
        load_config(None, [f"--data.mix={a}:1,{b}:1", f"--data.path={a}"])
