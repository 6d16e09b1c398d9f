"""Shared fixtures: a small text corpus (a few stdlib modules) and a shared data cache."""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from meshlm.distributed.spawn import PRELOAD, forkserver_context

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# This process's forkserver (started by whichever test forks first) preloads what the ranks of
# run_world, launch_local's workers and `prepare`'s workers import.
forkserver_context([*PRELOAD, "meshlm.launch", "meshlm.data.prepare"])

# The order in which `make test` hands files to its workers (pytest-xdist --dist loadfile
# --no-loadscope-reorder): xdist's own, the files with the most tests first, except these,
# which go first. Each runs its commands one at a time (the README tour, the GPU benchmark's
# rows) for minutes; with few tests, xdist's order started them last, where one ran alone for
# the last 2-4 minutes. At the start they run beside the compile-heavy worlds.
FIRST = ["test_readme.py", "test_gpu_benchmark.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    count: dict[Path, int] = {}
    for item in items:
        count[item.path] = count.get(item.path, 0) + 1
    first = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: (first.get(item.path.name, len(first)), -count[item.path]))


CORPUS_MODULES = [
    "textwrap.py", "json/decoder.py", "json/encoder.py", "fnmatch.py", "shlex.py",
    "string.py", "bisect.py", "heapq.py", "glob.py", "csv.py", "calendar.py", "copy.py",
    "queue.py", "sched.py", "colorsys.py", "graphlib.py", "keyword.py", "operator.py",
]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 250 KB of Python source in a folder, as a user's data.path would be."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in CORPUS_MODULES:
        dst = root / rel.replace("/", "_")
        shutil.copyfile(stdlib / rel, dst)
    return root


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def short_docs(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test corpus as JSONL documents of 4 lines each: several per 64-token sequence
    (document masking cuts every sequence)."""
    root = tmp_path_factory.mktemp("short-docs")
    with open(root / "docs.jsonl", "w") as f:
        for path in sorted(corpus_dir.iterdir()):
            lines = path.read_text().splitlines(keepends=True)
            for i in range(0, len(lines), 4):
                if (text := "".join(lines[i : i + 4])).strip():
                    f.write(json.dumps({"text": text}) + "\n")
    return root


@pytest.fixture()
def tiny_args(corpus_dir: Path, cache_dir: Path, tmp_path: Path) -> list[str]:
    """Overrides for a fast tiny run on the small corpus (a fresh run dir per test)."""
    return [
        "--model.preset=tiny", f"--data.path={corpus_dir}", f"--data.cache_dir={cache_dir}",
        "--data.vocab_size=512", "--data.seq_len=32", "--train.steps=6",
        "--train.global_batch=8", "--train.micro_batch=4", "--train.warmup_steps=2",
        "--train.eval_every=3", "--train.eval_batches=2", "--train.log_every=1",
        "--run.sample_tokens=0", f"--run.dir={tmp_path / 'run'}", "--train.peak_flops=1e10",
    ]


@pytest.fixture(scope="session")
def import_benchmark():  # noqa: ANN201
    """``import_benchmark(name)``: the script ``benchmarks/<name>.py`` as a module
    (:func:`load_benchmark`)."""
    return load_benchmark


def load_benchmark(name: str):  # noqa: ANN201
    """The script ``benchmarks/<name>.py`` as a module (the scripts are not a package; their
    folder is on the path only while importing)."""
    import importlib
    import sys

    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)
