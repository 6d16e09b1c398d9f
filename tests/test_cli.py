"""The command line end to end on `tiny`, its error contract, and its frozen surface."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshlm.cli import build_parser, main
from meshlm.testing import HANG_GUARD_S, run_cli

MESHLM = Path(sys.executable).parent / "meshlm"  # the installed console script


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([str(MESHLM), *args], capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env=env, cwd=cwd)


def here(*args: str) -> subprocess.CompletedProcess:
    """The command run in this process (:func:`meshlm.testing.run_cli`: its workers fork from
    the test process's forkserver); ``run`` starts the console script itself."""
    return run_cli(list(args))


def test_train_then_generate_end_to_end(tiny_args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = here("train", *tiny_args, "--run.sample_tokens=16")
    assert out.returncode == 0, out.stderr
    assert "layout: world 1" in out.stdout and "measured" not in out.stdout  # peak given
    assert "step 6/6" in out.stdout and "sample:" in out.stdout
    assert out.stdout.split("sample:\n", 1)[1].startswith("def ")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    assert 'preset = "tiny"' in (run_dir / "config.toml").read_text()

    gen = here("generate", "--checkpoint", str(run_dir), "--prompt", "import ",
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
    # which vocabulary the counts use, and that training uses the tokenizer's
    assert rows["tiny"]["vocab"] == 512 and "tokenizer's" in table.stdout


def test_an_override_value_may_hold_spaces(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse would take ``--run.sample_prompt=The licensee`` for the config file."""
    assert main(["train", "--run.sample_prompt=The licensee", "--model.preset=tiny",
                 "--dry-run"]) == 0
    assert 'sample_prompt = "The licensee"' in capsys.readouterr().out
    assert main(["train", "--run.sample_prompt", "two words", "--dry-run"]) == 0
    assert 'sample_prompt = "two words"' in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "--train.stepz=3"], "unknown config key 'train.stepz'"),
        (["train", "--train.steps=abc"], "train.steps='abc': expected an integer"),
        (["train", "--data.path=/nonexistent/corpus"], "data.path='/nonexistent/corpus' does not exist"),
        (["train", "--train.global_batch=12", "--train.micro_batch=5"], "not divisible"),
        (["train", "no_such_config.toml"], "config file 'no_such_config.toml' does not exist"),
        (["train", "--parallel.dp=2", "--parallel.ep=2", "--train.micro_batch=8"],
         "parallel.ep=2 needs a Mixture-of-Experts model"),
        (["train", "--model.preset=tiny-moe", "--parallel.dp=3", "--parallel.ep=3",
          "--train.global_batch=12", "--train.micro_batch=4"], "parallel.ep=3 does not divide the 4 experts"),
        (["train", "--model.preset=tiny-moe", "--parallel.dp=2", "--parallel.ep=4"],
         "parallel.ep=4 must divide parallel.dp * cp = 2"),
        (["train", "--model.preset=tiny-moe", "--model.moe_balance=loss"],
         "model.moe_balance='loss' is not one of aux, seq_aux, bias"),
        (["train", "--model.preset=tiny-moe", "--model.moe_capacity=-1"],
         "model.moe_capacity=-1.0 must be >= 0 (0: dropless)"),
        (["train", "--parallel.cp=16", "--parallel.cp_attention=ulysses"],
         "parallel.cp_attention=ulysses: parallel.cp=16 does not divide the 8 query heads"),
        (["train", "--parallel.cp=3", "--data.seq_len=64"],
         "parallel.cp=3: data.seq_len=64 is not divisible by 2 * cp (zigzag)"),
        (["train", "--parallel.cp=2", "--parallel.cp_attention=star"],
         "parallel.cp_attention='star' is not one of zigzag, ring, ulysses"),
        (["train", "--parallel.pp=2", "--parallel.pp_schedule=interleaved"],
         "the interleaved schedule needs parallel.pp_virtual >= 2"),
        (["train", "--parallel.pp=3", "--model.n_layers=2"],
         "parallel.pp * pp_virtual = 3 stages exceed model.n_layers=2"),
        (["train", "--parallel.tp=3"], "parallel.tp=3 does not divide model.n_heads=8"),
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
    assert here("train", *tiny_args, "--train.steps=1").returncode == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000001"
    (ckpt / "rank_00000.safetensors").write_bytes(b"not a safetensors file")
    out = here("generate", "--checkpoint", str(ckpt), "--prompt", "x")
    assert out.returncode == 2 and "rank_00000.safetensors" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_cli_surface_is_frozen() -> None:
    """Scripts depend on these names; change them on purpose, with this test."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == ["convert", "generate", "info", "plan", "prepare", "report",
                                   "schedule", "train"]
    options = {name: sorted(o for a in p._actions for o in a.option_strings)
               for name, p in sub.choices.items()}
    assert options["train"] == sorted(["--dry-run", "--gpu", "--keys", "--max-restarts", "-h",
                                       "--help"])
    assert {"--checkpoint", "--prompt", "--max-new-tokens", "--temperature", "--top-k",
            "--seed"} <= set(options["generate"])
    assert {"--seq-len", "--json"} <= set(options["info"])
    assert options["report"] == sorted(["--out", "-h", "--help"])
    assert {"--pp", "--microbatches", "--schedule", "--virtual", "--plot", "--timeline"} <= set(
        options["schedule"])
    assert {"--model", "--gpus", "--gpu", "--seq-len", "--global-batch-tokens", "--layout",
            "--precision", "--states", "--loss", "--top", "--json", "--calibrate",
            "--calibration"} <= set(options["plan"])


def test_train_launches_data_parallel_workers(tiny_args: list[str], tmp_path: Path) -> None:
    """`meshlm train --parallel.dp=2` outside torchrun starts 2 workers through the agent."""
    out = here("train", *tiny_args, "--parallel.dp=2", "--parallel.zero=2", "--train.steps=3")
    assert out.returncode == 0, out.stderr
    assert "layout: world 2 (pp=1 dp=2 cp=1 tp=1), zero 2" in out.stdout
    assert out.stdout.count("layout:") == 1  # only rank 0 speaks
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["comm_bytes"]["reduce_scatter/dp"] > 0
    assert 'dp = 2' in (tmp_path / "run" / "config.toml").read_text()


@pytest.mark.parametrize(
    "world,args,message",
    [
        ("4", ["--parallel.dp=3", "--train.global_batch=12", "--train.micro_batch=1"],
         "parallel.dp=3 does not fit the world: pp * dp * cp * tp = 3, but the world has 4 ranks "
         "(leave parallel.dp unset to infer it)"),
        ("4", ["--train.global_batch=6", "--train.micro_batch=1"],
         "train.global_batch=6 is not divisible by train.micro_batch * parallel.dp = 1 * 4 = 4"),
    ],
)
def test_bad_layout_under_torchrun_fails_before_init(world: str, args: list[str], message: str,
                                                     tmp_path: Path) -> None:
    env = dict(os.environ, RANK="0", WORLD_SIZE=world, LOCAL_RANK="0", LOCAL_WORLD_SIZE=world,
               MASTER_ADDR="127.0.0.1", MASTER_PORT="1", OMP_NUM_THREADS="1")
    out = subprocess.run([str(MESHLM), "train", "--model.preset=tiny", *args,
                          f"--run.dir={tmp_path / 'r'}"], capture_output=True, text=True,
                         timeout=HANG_GUARD_S, env=env)
    assert out.returncode == 2
    assert out.stderr.strip() == f"meshlm: error: {message}"  # one line, before any rendezvous
    assert not (tmp_path / "r").exists()
    # the other ranks exit with the same status, silently
    quiet = subprocess.run([str(MESHLM), "train", "--model.preset=tiny", *args],
                           capture_output=True, text=True, timeout=HANG_GUARD_S, env=env | {"RANK": "1"})
    assert quiet.returncode == 2 and quiet.stderr == ""


def test_train_tensor_parallel_with_sample(tiny_args: list[str], tmp_path: Path) -> None:
    """tp=2 with sequence parallelism end to end, including the sample (vocab shards gathered)."""
    out = here("train", *tiny_args, "--parallel.tp=2", "--parallel.sp=true", "--train.steps=2",
              "--run.sample_tokens=8")
    assert out.returncode == 0, out.stderr
    assert "layout: world 2 (pp=1 dp=1 cp=1 tp=2)" in out.stdout
    assert out.stdout.split("sample:\n", 1)[1].startswith("def ")
    gen = here("generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "x",
              "--max-new-tokens", "3")
    assert gen.returncode == 0, gen.stderr  # the layout-free checkpoint loads in one process


def test_schedule_command(tmp_path: Path) -> None:
    png = tmp_path / "s.png"
    out = run("schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved",
              "--virtual", "2", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert "ideal bubble (F=1, B=2, I=W=1 per stage): 0.1579" in out.stdout  # 3 / (2*8 + 3)
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = run("schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved",
              "--virtual", "2")
    assert bad.returncode == 2 and "divisible" in bad.stderr


def test_pipeline_run_records_and_draws_its_timeline(tiny_args: list[str], tmp_path: Path) -> None:
    out = here("train", *tiny_args, "--parallel.pp=2", "--parallel.pp_schedule=1f1b",
              "--train.steps=2", "--run.sample_tokens=5")
    assert out.returncode == 0, out.stderr
    assert "sample:" in out.stdout
    png = tmp_path / "t.png"
    drawn = run("schedule", "--timeline", str(tmp_path / "run"), "--plot", str(png))
    assert drawn.returncode == 0, drawn.stderr
    assert "measured 1f1b step over 2 stages: bubble" in drawn.stdout and png.exists()


def test_train_with_auto_layout(tiny_args: list[str], tmp_path: Path) -> None:
    """parallel.auto asks the planner for the layout of the ranks given (here 2)."""
    out = here("train", *tiny_args, "--parallel.dp=2", "--parallel.auto=true", "--train.steps=2")
    assert out.returncode == 0, out.stderr
    assert "parallel.auto: 2 ranks ->" in out.stdout
    assert "layout: world 2" in out.stdout


def test_automatic_micro_batch_shrinks_to_fit_then_trains(
        tiny_args: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """train.micro_batch left unset on a device (the planner's) that holds micro-batch 2 but
    not 4 or 8 (= global / dp): it becomes 2, the run says so and trains with accumulation 4,
    on the losses of an explicit micro_batch=2 run."""
    import dataclasses

    from meshlm.cli import main
    from meshlm.config import load_config
    from meshlm.planner import cli as planner_cli
    from meshlm.planner.hardware import get_accelerator
    from meshlm.planner.memory import memory
    from meshlm.train.metrics import read_metrics

    args = [a for a in tiny_args if not a.startswith(("--train.micro_batch", "--train.steps"))]
    args += ["--train.steps=2"]
    cfg = load_config(None, args)
    assert cfg.train.micro_batch == 8 and cfg.micro_batch_auto
    cpu = get_accelerator("cpu")
    work = planner_cli.config_workload(cfg, 512)

    def need(m: int) -> float:
        return memory(work, dataclasses.replace(cfg.layout(), micro_batch=m), cpu).total

    small = dataclasses.replace(cpu, memory=(need(2) + need(4)) / 2)
    monkeypatch.setattr(planner_cli, "hardware_here", lambda _purpose: small)
    capsys.readouterr()
    assert main(["train", *args]) == 0
    out = capsys.readouterr().out
    assert "train.micro_batch: 2 (a micro-batch of 8 does not fit" in out, out
    assert "micro-batch 2, accumulation 4" in out, out
    run_dir = Path(next(a for a in args if a.startswith("--run.dir=")).split("=", 1)[1])
    got = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]
    explicit = [a.replace(str(run_dir), str(run_dir) + "-explicit") for a in args]
    assert main(["train", *explicit, "--train.micro_batch=2"]) == 0
    want = [r["loss"] for r in read_metrics(Path(str(run_dir) + "-explicit") / "metrics.jsonl")]
    assert got == want and len(got) == 2
