"""The command line end to end on `tiny`, its error contract, and its frozen surface."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshlm.cli import build_parser

MESHLM = Path(sys.executable).parent / "meshlm"  # the installed console script


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([str(MESHLM), *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


def test_train_then_generate_end_to_end(tiny_args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = run("train", *tiny_args, "--run.sample_tokens=16")
    assert out.returncode == 0, out.stderr
    assert "layout: world 1" in out.stdout and "measured" not in out.stdout  # peak given
    assert "step 6/6" in out.stdout and "sample:" in out.stdout
    assert out.stdout.split("sample:\n", 1)[1].startswith("def ")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    assert 'preset = "tiny"' in (run_dir / "config.toml").read_text()

    gen = run("generate", "--checkpoint", str(run_dir), "--prompt", "import ",
              "--max-new-tokens", "10")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("import ") and len(gen.stdout) > len("import \n")


def test_config_file_with_overrides(tmp_path: Path, tiny_args: list[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[train]\nsteps = 2\n')
    out = run("train", str(cfg), "--dry-run", *tiny_args)
    assert out.returncode == 0, out.stderr
    assert "steps = 6" in out.stdout  # the override beats the file
    assert "memory estimate" in out.stdout
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_info_lists_presets() -> None:
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["preset"]: r for r in json.loads(out.stdout)}
    assert round(rows["llama3-8b"]["params"] / 1e9, 2) == 8.03
    assert rows["mixtral-8x7b"]["active_params"] < rows["mixtral-8x7b"]["params"]
    table = run("info")
    assert table.returncode == 0 and "llama3-405b" in table.stdout and "8.03 B" in table.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "--train.stepz=3"], "unknown config key 'train.stepz'"),
        (["train", "--train.steps=abc"], "train.steps='abc': expected an integer"),
        (["train", "--data.path=/nonexistent/corpus"], "data.path='/nonexistent/corpus' does not exist"),
        (["train", "--train.global_batch=12", "--train.micro_batch=5"], "not divisible"),
        (["train", "no_such_config.toml"], "config file 'no_such_config.toml' does not exist"),
        (["train", "--parallel.tp=2"], "parallel.tp=2: this version trains on one process only"),
        (["train", "stray", "words"], "unexpected argument"),
        (["generate", "--checkpoint", "/nonexistent/ckpt", "--prompt", "x"], "does not exist"),
    ],
)
def test_bad_input_gives_one_clear_line(args: list[str], message: str, tmp_path: Path) -> None:
    out = run(*args, f"--run.dir={tmp_path / 'r'}" if args[0] == "train" else "--seed=0",
              cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshlm: error:"), out.stderr
    assert message in lines[0]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "runs").exists()


def test_generate_rejects_corrupt_checkpoint(tiny_args: list[str], tmp_path: Path) -> None:
    assert run("train", *tiny_args, "--train.steps=1").returncode == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000001"
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    out = run("generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "x")
    assert out.returncode == 2 and "cannot read" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_cli_surface_is_frozen() -> None:
    """Scripts depend on these names; change them on purpose, with this test."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == ["generate", "info", "train"]
    options = {name: sorted(o for a in p._actions for o in a.option_strings)
               for name, p in sub.choices.items()}
    assert options["train"] == sorted(["--dry-run", "-h", "--help"])
    assert {"--checkpoint", "--prompt", "--max-new-tokens", "--temperature", "--top-k",
            "--seed"} <= set(options["generate"])
    assert {"--seq-len", "--json"} <= set(options["info"])
