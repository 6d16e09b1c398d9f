"""Every bad input ends in one ``meshlm: error:`` line, exit status 2, no traceback, before any
worker starts, and leaves every file that was there byte for byte as it was.

In-process (``meshlm.cli.main``) for speed; one subprocess shows what reaches a terminal.
Checkpoint cases corrupt copies of one real tiny checkpoint trained once for the module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshlm.cli import main
from meshlm.config import DataSection
from meshlm.data import build_data
from meshlm.testing import HANG_GUARD_S, cli

MESHLM = Path(sys.executable).parent / "meshlm"
ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


def assert_one_line(rc: int, lines: list[str], message: str) -> None:
    assert rc == 2, lines
    assert len(lines) == 1 and lines[0].startswith("meshlm: error:"), lines
    assert message in lines[0], lines[0]
    assert "Traceback" not in lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


# Root passes permission bits by two capabilities; without them root is bound like any owner.
UNPRIVILEGED = (["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                 "--bounding-set=-dac_override,-dac_read_search"] if ROOT else [])


def run_unprivileged(argv: list[str], cwd: Path) -> tuple[int, list[str]]:
    """(exit status, stderr lines) of ``meshlm argv`` in a process that permission bits bind
    (as root: without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, through util-linux's setpriv)."""
    if ROOT and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permission bits cannot bind")
    out = subprocess.run([*UNPRIVILEGED, str(MESHLM), *argv], capture_output=True, text=True,
                         cwd=cwd, timeout=HANG_GUARD_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out.returncode, out.stderr.strip().splitlines()


def train_args(corpus: Path, cache: Path, run_dir: Path) -> list[str]:
    return ["train", "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
            "--data.vocab_size=512", "--data.seq_len=32", "--train.steps=2",
            "--train.global_batch=4", "--train.eval_every=0", "--run.sample_tokens=0",
            "--train.peak_flops=1e10", f"--run.dir={run_dir}"]


@pytest.fixture(scope="module")
def trained(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Path:
    """A real tiny run (2 steps) with its checkpoint: run_dir/checkpoints/step_0000002."""
    run_dir = tmp_path_factory.mktemp("bad_input") / "run"
    assert main(train_args(corpus_dir, cache_dir, run_dir)) == 0
    return run_dir


# ------------------------------------------------------------------ config (overrides)
@pytest.mark.parametrize("args,message", [
    (["--train.lr=inf"], "train.lr='inf': expected a finite number"),
    (["--train.lr=-inf"], "expected a finite number"),
    (["--distributed.timeout_s=inf"], "distributed.timeout_s='inf': expected a finite number"),
    (["--train.steps=1e30"], "train.steps='1e30': out of range"),
    (["--train.seed=-1"], "train.seed=-1 must be >= 0"),
    (["--train.eps=-1"], "train.eps=-1.0 must be positive"),
    (["--train.weight_decay=-0.1"], "train.weight_decay=-0.1 must be >= 0"),
    (["--train.peak_flops=-1"], "train.peak_flops=-1.0 must be >= 0"),
    (["--train.global_batch=0"], "train.global_batch=0 must be positive"),
    (["--train.warmup_steps=-1"], "train.warmup_steps=-1 must be >= 0"),
    (["--train.loss_chunk=0"], "train.loss_chunk=0 must be >= 1"),
    (["--train.eval_batch_size=0"], "train.eval_batch_size=0 must be >= 1"),
    (["--data.seq_len=0"], "data.seq_len=0 must be >= 2"),
    (["--data.val_fraction=1"], "data.val_fraction=1.0 must lie in (0, 1)"),
    (["--data.vocab_size=100"], "data.vocab_size=100 must be >= 260"),
    (["--data.tokenizer=/no/such/tokenizer.json"], "data.tokenizer='/no/such/tokenizer.json' is"),
    (["--model.dim=0"], "model.dim must be positive, got 0"),
    (["--model.n_layers=-2"], "model.n_layers must be positive, got -2"),
    (["--model.n_kv_heads=3"], "model.n_heads=8 is not divisible by model.n_kv_heads=3"),
    (["--model.head_dim=-2"], "model.head_dim must be >= 0, got -2"),
    (["--model.rope_theta=0"], "model.rope_theta must be positive"),
    (["--model.init_std=-1"], "model.init_std must be positive"),
    (["--model.max_seq_len=16"], "data.seq_len=32 exceeds model.max_seq_len=16"),
    (["--parallel.tp=0"], "parallel.tp=0 must be >= 1"),
    (["--parallel.tp=8"], "parallel.tp=8 does not divide model.n_kv_heads=4"),
    (["--parallel.dp=3"], "train.global_batch=4 is not divisible by parallel.dp=3"),
    (["--parallel.tp=2", "--parallel.sp=true", "--data.seq_len=33"],
     "parallel.sp=true: data.seq_len=33 is not divisible by parallel.tp=2"),
    (["--parallel.bucket_mb=-1"], "parallel.bucket_mb=-1.0 must be positive"),
    (["--model.preset=tiny-moe", "--model.moe_topk=9"], "model.moe_topk=9 must lie in [1,"),
    (["--train.steps"], "override '--train.steps' has no value"),
    (["--train.steps", "--train.lr=1"], "override '--train.steps' has no value"),
    (["--.steps=3"], "unknown config key '.steps'"),
    (["--model.n_layers=100000"], "by the planner's estimate (peak at the backward), but cpu has"),
    (["--model.dim=65536", "--model.n_heads=64", "--model.n_kv_heads=8"],
     "GiB of weights, gradients and Adam moments (parallel.tp, parallel.pp, parallel.dp with "
     "parallel.zero=3)"),
    (["--train.optimizer=lion"], "train.optimizer='lion' is not one of adamw, sgd"),
    (["--train.optimizer=sgd", "--parallel.offload=disk"], "it needs train.optimizer=adamw"),
    (["--parallel.islands=0"], "parallel.islands=0 must be >= 1"),
    (["--parallel.islands=3"], "train.global_batch=4 is not divisible by parallel.dp * "
                               "islands = 1 * 3"),
    (["--parallel.islands=2", "--diloco.inner_steps=0"], "diloco.inner_steps=0 must be >= 1"),
    (["--parallel.islands=2", "--diloco.outer_lr=0"], "diloco.outer_lr=0.0 must be positive"),
    (["--parallel.islands=2", "--diloco.outer_momentum=1"],
     "diloco.outer_momentum=1.0 must lie in [0, 1)"),
    (["--parallel.islands=2", "--diloco.reduce_dtype=int8"],
     "diloco.reduce_dtype='int8' is not one of fp32, bf16, fp16"),
    (["--parallel.islands=2", "--diloco.fragments=3"],
     "diloco.fragments=3 must lie in [1, model.n_layers=2]"),
    (["--parallel.islands=2", "--diloco.inner_steps=3", "--diloco.fragments=2"],
     "diloco.inner_steps=3 is not divisible by diloco.fragments=2"),
    (["--parallel.islands=2", "--train.on_nonfinite=rollback"],
     "train.on_nonfinite=rollback cannot be used with parallel.islands > 1"),
])
def test_config_mistake(args: list[str], message: str, corpus_dir: Path, cache_dir: Path,
                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    rc, lines = cli(train_args(corpus_dir, cache_dir, run_dir) + args, capsys)
    assert_one_line(rc, lines, message)
    assert not run_dir.exists()


def test_memory_refusal_spares_the_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    """The planner's "does NOT fit" is a refusal for training, a report for --dry-run."""
    rc = main(["train", "--dry-run", "--model.preset=tiny", "--model.n_layers=100000",
               f"--run.dir={tmp_path / 'run'}"])
    assert rc == 0 and "does NOT fit" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ config (TOML file)
@pytest.mark.parametrize("content,message", [
    (b"\xff\xfe\x00garbage", "is not UTF-8 text (byte 0xff at offset 0)"),
    (b"[train\nsteps = 3\n", "is not valid TOML"),
    (b'[train]\nsteps = "3\n', "is not valid TOML"),
    (b"steps = 3\n", "top-level key 'steps' must be a [section]"),
    (b"[trainer]\nsteps = 3\n", "unknown config key 'trainer.steps'"),
    (b"[train.sub]\nx = 1\n", "unknown config key 'train.sub'"),
    (b"[train]\nsteps = [1, 2]\n", "train.steps=[1, 2]: expected an integer"),
    (b"[train]\nsteps = true\n", "train.steps=True: expected an integer"),
    (b"[train]\nlr = nan\n", "train.lr=nan: expected a finite number"),
    (b"[train]\nlr = inf\n", "train.lr=inf: expected a finite number"),
    (b"[train]\nlr = 1979-05-27\n", "expected a number"),
    (b"[data]\npath = {a = 1}\n", "data.path={'a': 1}: expected a string"),
    (b"[parallel]\nsp = 1\n", "parallel.sp=1: expected true or false"),
    (b"[train]\nsteps = 99999999999999999999\n", "out of range"),
])
def test_toml_file_mistake(content: bytes, message: str, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.toml"
    config.write_bytes(content)
    rc, lines = cli(["train", str(config), f"--run.dir={tmp_path / 'run'}"], capsys)
    assert_one_line(rc, lines, message)
    assert config.read_bytes() == content and not (tmp_path / "run").exists()


def test_config_path_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines = cli(["train", str(tmp_path), f"--run.dir={tmp_path / 'run'}"], capsys)
    assert_one_line(rc, lines, "does not exist")


# ------------------------------------------------------------------ data
def _write(folder: Path, name: str, data: bytes) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(data)
    return folder / name


TEXT = b"def f(x):\n    return x + 1\n" * 400


@pytest.mark.parametrize("files,message", [
    ({"a.bin": bytes(range(256)) * 64}, "is binary, not text (NUL bytes)"),
    ({"a.txt": TEXT, "b.txt": b"\x00\x01\x02" * 500}, "b.txt' is binary"),
    ({"a.txt": "caf\xe9 au lait ".encode("latin-1") * 400}, "is not UTF-8 text"),
    ({"a.txt": b""}, "gives a train split of 0 tokens"),
    ({"a.txt": b"tiny", "b.txt": b"small"}, "data.seq_len=32 needs at least 34"),
    ({"a.jsonl": b'{"text": "ok"}\n{broken\n'}, "a.jsonl:2: not valid JSON"),
    ({"a.jsonl": b'{"text": "ok"}\n{"body": "x"}\n'}, "a.jsonl:2: no string field 'text'"),
    ({"a.jsonl": b'[1, 2]\n'}, "a.jsonl:1: no string field 'text'"),
    ({"a.jsonl": b'{"text": 3}\n'}, "a.jsonl:1: no string field 'text'"),
    ({"a.png": b"\x89PNG"}, "holds no non-empty text files"),
])
def test_data_mistake(files: dict[str, bytes], message: str, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "corpus"
    for name, data in files.items():
        _write(folder, name, data)
    path = folder / next(iter(files)) if len(files) == 1 and "a.png" not in files else folder
    before = snapshot(folder)
    rc, lines = cli(train_args(path, tmp_path / "cache", tmp_path / "run"), capsys)
    assert_one_line(rc, lines, message)
    assert snapshot(folder) == before and not (tmp_path / "run").exists()


def test_a_few_stray_bytes_are_replaced_not_refused(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    _write(folder, "a.txt", TEXT + b"\xe9" + TEXT)
    data = build_data(DataSection(path=str(folder), cache_dir=str(tmp_path / "cache"),
                                  vocab_size=300, seq_len=32), log=lambda _m: None)
    assert len(data.train_tokens) > 100


def test_unreadable_corpus_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dangling symlink in the corpus folder (root reads every file, so no chmod here)."""
    folder = tmp_path / "corpus"
    _write(folder, "a.txt", TEXT)
    (folder / "b.txt").symlink_to(tmp_path / "gone.txt")
    rc, lines = cli(train_args(folder, tmp_path / "cache", tmp_path / "run"), capsys)
    assert_one_line(rc, lines, "cannot read corpus file")
    assert "b.txt" in lines[0] and not (tmp_path / "run").exists()


def test_corpus_file_without_read_permission(tmp_path: Path) -> None:
    path = _write(tmp_path / "corpus", "a.txt", TEXT)
    path.chmod(0)
    try:
        rc, lines = run_unprivileged(train_args(path, tmp_path / "cache", tmp_path / "run"),
                                     tmp_path)
    finally:
        path.chmod(0o644)
    assert not (tmp_path / "run").exists()
    assert_one_line(rc, lines, "cannot read corpus file")


@pytest.mark.parametrize("content,message", [
    (b"{not json", "is not a valid tokenizer.json"),
    (b"{}", "is not a valid tokenizer.json"),
])
def test_bad_tokenizer_file(content: bytes, message: str, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str], corpus_dir: Path) -> None:
    tok = _write(tmp_path / "tok", "tokenizer.json", content)
    rc, lines = cli(train_args(corpus_dir, tmp_path / "cache", tmp_path / "run")
                    + [f"--data.tokenizer={tok}"], capsys)
    assert_one_line(rc, lines, message)
    assert tok.read_bytes() == content and not (tmp_path / "run").exists()


def test_token_file_of_the_wrong_dtype_is_rebuilt(tmp_path: Path) -> None:
    """A cached token shard rewritten as another dtype (same tokens, other bytes) is rebuilt,
    not trusted: its size and hash disagree with the manifest."""
    folder = tmp_path / "corpus"
    _write(folder, "a.txt", TEXT)
    _write(folder, "b.txt", TEXT.replace(b"x", b"y"))
    cfg = DataSection(path=str(folder), cache_dir=str(tmp_path / "cache"), vocab_size=300,
                      seq_len=32)
    first = build_data(cfg, log=lambda _m: None)
    tokens = np.array(first.train_tokens)
    shard = first.cache_dir / first.sources[0][2].manifest["splits"]["train"]["shards"][0]["name"]
    part = np.fromfile(shard, dtype=first.train_tokens.dtype)
    del first  # (release the mapping before touching the file)
    shard.write_bytes(part.astype(np.float32).tobytes())
    logs: list[str] = []
    again = build_data(cfg, log=logs.append)
    assert any("is damaged" in m and "rebuilding" in m for m in logs), logs
    assert again.train_tokens.dtype == np.uint16
    assert np.array_equal(np.array(again.train_tokens), tokens)


# ------------------------------------------------------------------ checkpoints and run dirs
def _copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "copy"
    shutil.copytree(trained, run)
    return run, run / "checkpoints" / "step_0000002"


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        target = data
        *parents, last = key.split("__")
        for p in parents:
            target = target[p]
        target[last] = value
    path.write_text(json.dumps(data))


def _truncate(ckpt: Path) -> None:
    f = ckpt / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _bad_header(ckpt: Path) -> None:
    f = ckpt / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"X" * 12
    f.write_bytes(bytes(data))


DAMAGE = {
    "truncated shard": (_truncate, "bytes, the index records"),
    "shard header": (_bad_header, "Error while deserializing header"),
    "trainer.json not JSON": (lambda c: (c / "trainer.json").write_text("{oops"),
                              "cannot read"),
    "trainer.json step edited": (lambda c: _edit_json(c / "trainer.json", step="abc"),
                                 "trainer.json: malformed (step or sampler state"),
    "trainer.json sampler removed": (lambda c: _edit_json(c / "trainer.json", sampler=None),
                                     "trainer.json: malformed"),
    "another model's metadata": (lambda c: _edit_json(c / "trainer.json", model__dim=96),
                                 "tok_embeddings.weight has shape [512, 64], the model "
                                 "expects [512, 96]"),
    "unknown model field": (lambda c: _edit_json(c / "trainer.json", model__bogus=1),
                            "unexpected keyword argument 'bogus'"),
    "index.json not a meshlm index": (lambda c: (c / "index.json").write_text("[]"),
                                      "not a meshlm-sharded/1 index"),
    "index.json not UTF-8": (lambda c: (c / "index.json").write_bytes(b"\xff\xfe"),
                             "index.json: 'utf-8' codec can't decode"),
    "index.json tensor renamed": (
        lambda c: (c / "index.json").write_text(
            (c / "index.json").read_text().replace("norm.weight", "norm.weight2", 1)),
        "index"),
    "config.toml missing": (lambda c: (c / "config.toml").unlink(),
                            "is incomplete: missing config.toml"),
    "tokenizer.json missing": (lambda c: (c / "tokenizer.json").unlink(),
                               "has no tokenizer.json"),
    "tokenizer.json invalid": (lambda c: (c / "tokenizer.json").write_text("{}"),
                               "is not a valid tokenizer.json"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_checkpoint_for_generate(kind: str, trained: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    run, ckpt = _copy(trained, tmp_path)
    damage, message = DAMAGE[kind]
    damage(ckpt)
    before = snapshot(run)
    rc, lines = cli(["generate", "--checkpoint", str(ckpt), "--prompt", "x",
                     "--max-new-tokens", "2"], capsys)
    assert_one_line(rc, lines, message)
    assert snapshot(run) == before


@pytest.mark.parametrize("kind", ["truncated shard", "trainer.json step edited"])
def test_damaged_checkpoint_is_not_resumed(kind: str, trained: Path, tmp_path: Path,
                                           corpus_dir: Path, cache_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    run, ckpt = _copy(trained, tmp_path)
    DAMAGE[kind][0](ckpt)
    before = snapshot(run)
    rc, lines = cli(train_args(corpus_dir, cache_dir, run) + ["--train.steps=3",
                                                              "--run.resume=true"], capsys)
    assert_one_line(rc, lines, "holds no complete checkpoint to resume from")
    assert snapshot(run) == before


def test_init_from_a_damaged_checkpoint(trained: Path, tmp_path: Path, corpus_dir: Path,
                                        cache_dir: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    run, ckpt = _copy(trained, tmp_path)
    _truncate(ckpt)
    before = snapshot(run)
    rc, lines = cli(train_args(corpus_dir, cache_dir, tmp_path / "new")
                    + [f"--model.init_from={run}"], capsys)
    assert_one_line(rc, lines, "(truncated or replaced)")
    assert snapshot(run) == before and not (tmp_path / "new").exists()


def test_run_dir_of_another_run_is_not_overwritten(trained: Path, tmp_path: Path,
                                                   corpus_dir: Path, cache_dir: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = _copy(trained, tmp_path)
    before = snapshot(run)
    rc, lines = cli(train_args(corpus_dir, cache_dir, run), capsys)
    assert_one_line(rc, lines, "already holds files; pass --run.resume=true")
    rc, lines = cli(train_args(corpus_dir, cache_dir, run)
                    + ["--run.resume=true", "--model.n_layers=3"], capsys)
    assert_one_line(rc, lines, "run.resume: [model] differs from the saved config")
    assert snapshot(run) == before


def test_run_dir_that_cannot_be_created(tmp_path: Path, corpus_dir: Path, cache_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("mine")
    rc, lines = cli(train_args(corpus_dir, cache_dir, tmp_path / "file" / "run"), capsys)
    assert_one_line(rc, lines, "cannot be created:")
    rc, lines = cli(train_args(corpus_dir, cache_dir, tmp_path / "file"), capsys)
    assert_one_line(rc, lines, "is a file, not a directory")
    assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.parametrize("where", ["parent", "run_dir", "checkpoints"])
def test_read_only_run_dir(where: str, tmp_path: Path, corpus_dir: Path, cache_dir: Path
                           ) -> None:
    """A run dir that cannot be created, is read-only, or whose checkpoints folder is
    read-only: refused before training (a save must not fail after hours of steps)."""
    parent = tmp_path / "ro"
    parent.mkdir()
    run = parent / "run"
    if where != "parent":
        (run / "checkpoints").mkdir(parents=True)
        (run / "config.toml").write_text("# an earlier run's\n")
    locked = {"parent": parent, "run_dir": run, "checkpoints": run / "checkpoints"}[where]
    before = snapshot(parent)
    locked.chmod(0o555)
    try:
        rc, lines = run_unprivileged(train_args(corpus_dir, cache_dir, run)
                                     + ["--run.resume=auto"], tmp_path)
    finally:
        locked.chmod(0o755)
    assert snapshot(parent) == before
    assert_one_line(rc, lines, "is not writable")
    assert str(locked) in lines[0]


def test_convert_into_a_folder_with_files(trained: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    _write(out, "mine.txt", b"keep me")
    rc, lines = cli(["convert", str(trained), "--to-hf", str(out)], capsys)
    assert_one_line(rc, lines, "already exists and is not an empty folder")
    assert snapshot(out) == {"mine.txt": b"keep me"}


# ------------------------------------------------------------------ command-line misuse
@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt", "x"], "generate: the following arguments are required: "
                                    "--checkpoint"),
    (["frobnicate"], "argument command: invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: command"),
    (["train", "--max-restarts=x"], "train: argument --max-restarts: invalid int value"),
    (["train", "--max-restarts=-1"], "--max-restarts=-1 must be >= 0"),
    (["train", "stray", "words"], "unexpected argument 'words'"),
    (["generate", "--checkpoint", "/no/such/run", "--prompt", ""], "--prompt must not be empty"),
    (["generate", "--checkpoint", "/no/such/run", "--prompt", "x", "--max-new-tokens", "-1"],
     "--max-new-tokens=-1 must be >= 0"),
    (["generate", "--checkpoint", "/no/such/run", "--prompt", "x"],
     "checkpoint path '/no/such/run' does not exist"),
    (["info", "--seq-len", "0"], "--seq-len=0 must be >= 1"),
    (["info", "extra"], "unexpected arguments 'extra'"),
    (["schedule", "--pp", "0"], "parallel.pp=0, micro-batches=8"),
    (["schedule", "--schedule", "gpipe"], "parallel.pp_schedule='gpipe' is not one of"),
    (["report", "/no/such/run"], "/no/such/run: no such run directory"),
    (["convert", "/no/such/run", "--to-hf", "/no/such/out"], "does not exist"),
])
def test_command_line_misuse(argv: list[str], message: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines = cli(argv, capsys)
    assert_one_line(rc, lines, message)


def test_generate_on_a_folder_without_checkpoint(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "notes", "a.txt", b"mine")
    rc, lines = cli(["generate", "--checkpoint", str(tmp_path / "notes"), "--prompt", "x"],
                    capsys)
    assert_one_line(rc, lines, "no complete checkpoint found in")
    assert snapshot(tmp_path / "notes") == {"a.txt": b"mine"}


def test_no_traceback_reaches_the_terminal(tmp_path: Path) -> None:
    """The installed script: argparse's usage block is replaced by the one line too."""
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe[train]")
    for args, message in ((["frobnicate"], "invalid choice: 'frobnicate'"),
                          (["train", str(bad)], "is not UTF-8 text")):
        out = subprocess.run([str(MESHLM), *args], capture_output=True, text=True, timeout=HANG_GUARD_S,
                             env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("meshlm: error:")
        assert message in out.stderr and "Traceback" not in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]
