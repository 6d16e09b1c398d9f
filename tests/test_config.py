"""Config parsing and validation: typed values, clear one-line errors, TOML round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlm.config import Config, ConfigError, load_config, to_toml


def test_defaults_are_valid() -> None:
    cfg = load_config()
    assert cfg.model.preset == "small" and cfg.grad_accum == 1 and cfg.world_size == 1


def test_overrides_are_typed() -> None:
    cfg = load_config(None, ["--train.steps=50", "--train.lr=1e-3", "--parallel.sp=false",
                             "--model.n_layers=3", "--precision.dtype=bf16", "--run.dir=x"])
    assert cfg.train.steps == 50 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.parallel.sp is False
    assert cfg.model_config().n_layers == 3
    assert cfg.precision.dtype == "bf16"


def test_toml_file_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny"\nn_layers = 3\n[train]\nsteps = 7\nlr = 0.01\n'
                    'global_batch = 8\nmicro_batch = 2\n')
    cfg = load_config(path, ["--train.steps=9"])  # the command line wins over the file
    assert (cfg.model.preset, cfg.model.n_layers, cfg.train.steps) == ("tiny", 3, 9)
    assert cfg.grad_accum == 4
    saved = tmp_path / "saved.toml"
    saved.write_text(to_toml(cfg))
    assert load_config(saved) == cfg


@pytest.mark.parametrize(
    "override,message",
    [
        ("--train.stepz=5", "unknown config key 'train.stepz'"),
        ("--trian.steps=5", "unknown config key 'trian.steps'"),
        ("--train.steps=five", "train.steps='five': expected an integer"),
        ("--train.steps=2.5", "expected an integer"),
        ("--train.lr=fast", "train.lr='fast': expected a number"),
        ("--parallel.sp=maybe", "expected true or false"),
        ("--data.path=/no/such/dir", "data.path='/no/such/dir' does not exist"),
        ("--train.global_batch=10", "train.global_batch=10 is not divisible by train.micro_batch"),
        ("--model.preset=gpt5", "model.preset='gpt5' is not a preset"),
        ("--precision.dtype=fp8", "precision.dtype='fp8' is not one of"),
        ("--parallel.pp_schedule=gpipe", "parallel.pp_schedule='gpipe' is not one of"),
        ("--parallel.zero=4", "parallel.zero=4 must be 0, 1, 2 or 3"),
        ("--model.n_heads=3", "not divisible by model.n_heads=3"),
        ("--data.seq_len=4096", "data.seq_len=4096 exceeds model.max_seq_len"),
        ("--train.steps=0", "train.steps=0 must be positive"),
        ("--train.eval_batches=0", "train.eval_batches=0 must be >= 1 when train.eval_every > 0"),
        ("--run.sample_prompt=", "run.sample_prompt must not be empty"),
        ("--parallel.tp=2 --precision.dtype=fp16", "fp16 with parallel.tp > 1 is not supported"),
        ("--parallel.pp=2 --parallel.pp_layers=3,,1", "parallel.pp_layers='3,,1' must be a comma"),
        ("--parallel.pp=2 --parallel.pp_layers=4,0", "must be a comma list of layer counts >= 1"),
        ("--parallel.pp=2 --parallel.pp_layers=1,2", "must list 2 counts summing to model.n_layers=4"),
    ],
)
def test_bad_values_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, override.split())
    text = str(err.value)
    assert message in text
    assert "\n" not in text  # one line


def test_bad_toml_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    flat = tmp_path / "flat.toml"
    flat.write_text("steps = 3\n")
    with pytest.raises(ConfigError, match="must be a \\[section\\]"):
        load_config(flat)
    typed = tmp_path / "typed.toml"
    typed.write_text('[train]\nsteps = "many"\n')
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(typed)


def test_every_contract_key_exists() -> None:
    keys = ["model.preset", "model.n_layers", "data.path", "data.vocab_size", "train.steps",
            "train.global_batch", "train.micro_batch", "train.seed", "run.dir", "parallel.dp",
            "parallel.tp", "parallel.sp", "parallel.pp", "parallel.pp_schedule",
            "parallel.pp_virtual", "parallel.cp", "parallel.ep", "parallel.zero",
            "precision.dtype"]
    cfg = Config()
    for key in keys:
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key


def test_every_key_is_documented_in_readme() -> None:
    from dataclasses import fields

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    cfg = Config()
    for section in fields(cfg):
        for f in fields(getattr(cfg, section.name)):
            assert f"`{section.name}.{f.name}`" in readme, f"{section.name}.{f.name}"


@pytest.mark.parametrize("name", ["small.toml", "tiny-moe.toml"])
def test_examples_are_valid(name: str) -> None:
    cfg = load_config(Path(__file__).parents[1] / "examples" / name)
    assert cfg.model_config().num_params() > 0
