"""Config parsing and validation: typed values, clear one-line errors, TOML round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from meshlm.config import Config, ConfigError, load_config, to_toml, validate
from meshlm.models import hf_config
from meshlm.models.config import ModelConfig
from meshlm.models.presets import get_preset
from meshlm.schema import key_of


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
        ("--train.global_batch=10 --train.micro_batch=4",
         "train.global_batch=10 is not divisible by train.micro_batch"),
        ("--train.global_batch=9 --parallel.dp=2",
         "train.global_batch=9 is not divisible by parallel.dp=2"),
        ("--train.micro_batch=-1", "train.micro_batch=-1 must be positive"),
        ("--train.on_nonfinite=ignore", "train.on_nonfinite='ignore' is not one of"),
        ("--train.max_skips=0", "train.max_skips=0 must be >= 1"),
        ("--train.skip_batches=3,x", "train.skip_batches='3,x': expected batch numbers"),
        ("--train.skip_batches=0", "batches start at 1"),
        ("--distributed.timeout_s=0", "distributed.timeout_s=0.0 must be positive"),
        ("--distributed.init_timeout_s=-5", "distributed.init_timeout_s=-5.0 must be positive"),
        ("--distributed.flight_records=0", "distributed.flight_records=0 must be >= 1"),
        ("--distributed.straggler_threshold=-0.1",
         "distributed.straggler_threshold=-0.1 must be >= 0 (0: no straggler detection)"),
        ("--distributed.straggler_steps=0", "distributed.straggler_steps=0 must be >= 1"),
        ("--model.preset=gpt5", "model.preset='gpt5' is not a preset"),
        ("--precision.dtype=fp4", "precision.dtype='fp4' is not one of fp32, bf16, fp16, fp8"),
        ("--parallel.pp_schedule=gpipe", "parallel.pp_schedule='gpipe' is not one of"),
        ("--parallel.zero=4", "parallel.zero=4 must be 0, 1, 2 or 3"),
        ("--model.n_heads=3", "not divisible by model.n_heads=3"),
        ("--data.seq_len=4096", "data.seq_len=4096 exceeds model.max_seq_len"),
        ("--train.steps=0", "train.steps=0 must be positive"),
        ("--train.eval_batches=0", "train.eval_batches=0 must be >= 1 when train.eval_every > 0"),
        ("--run.sample_prompt=", "run.sample_prompt must not be empty"),
        ("--precision.grad_reduce_dtype=fp16", "precision.grad_reduce_dtype='fp16' is not one"),
        ("--train.loss=fused", "train.loss='fused' is not one of torch, chunked"),
        ("--train.recompute=layers", "train.recompute='layers' is not one of none, selective"),
        ("--parallel.offload=nvme", "parallel.offload='nvme' is not one of none, cpu, disk"),
        ("--profile.steps=a-b", "profile.steps='a-b': expected a step or a range"),
        ("--precision.loss_scale=0", "precision.loss_scale=0.0 must be positive"),
        ("--parallel.pp=2 --parallel.pp_layers=3,,1", "parallel.pp_layers='3,,1' must be a comma"),
        ("--parallel.pp=3 --parallel.pp_layers=2,0,2", "must be a comma list of layer counts >= 1"),
        ("--parallel.pp=2 --parallel.pp_layers=1,2", "must list 2 counts summing to model.n_layers=4"),
        ("--run.resume=maybe", "run.resume='maybe': expected one of false, true, auto"),
        ("--run.resume=true", "run.resume=true needs run.dir"),
        ("--run.resume=auto", "run.resume=auto needs run.dir"),
        ("--checkpoint.keep=-1", "checkpoint.keep=-1 must be >= 0"),
        ("--run.malloc_keep=true --run.malloc_mmap_kb=128",
         "run.malloc_keep=true and run.malloc_mmap_kb=128 contradict each other"),
        ("--model.init_from=/no/such/model", "model.init_from='/no/such/model' does not exist"),
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
            assert f"`{section.name}.{key_of(f)}`" in readme, f"{section.name}.{key_of(f)}"


@pytest.mark.parametrize("name", ["small.toml", "tiny-moe.toml"])
def test_examples_are_valid(name: str) -> None:
    cfg = load_config(Path(__file__).parents[1] / "examples" / name)
    assert cfg.model_config().num_params() > 0


# ---------------------------------------------------------------------- run.resume modes
@pytest.mark.parametrize("given,mode", [
    ("true", "true"), ("false", "false"), ("auto", "auto"), ("AUTO", "auto"), ("yes", "true"),
    ("no", "false"), ("1", "true"), ("0", "false"), (" True ", "true"),
])
def test_resume_modes_on_the_command_line(given: str, mode: str) -> None:
    cfg = load_config(None, ["--run.dir=somewhere", f"--run.resume={given}"])
    assert cfg.run.resume == mode


@pytest.mark.parametrize("given,mode", [
    ("true", "true"), ("false", "false"), ('"auto"', "auto"), ('"yes"', "true"), ("1", "true"),
    ("0", "false"),
])
def test_resume_modes_in_toml_round_trip(given: str, mode: str, tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f'[run]\ndir = "somewhere"\nresume = {given}\n')
    cfg = load_config(path)
    assert cfg.run.resume == mode
    assert f'resume = "{mode}"' in to_toml(cfg)  # written as the mode's string
    saved = tmp_path / "saved.toml"
    saved.write_text(to_toml(cfg))
    assert load_config(saved) == cfg


@pytest.mark.parametrize("given", ['"sometimes"', "2", "1.5", '""'])
def test_bad_resume_in_toml(given: str, tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f'[run]\ndir = "somewhere"\nresume = {given}\n')
    with pytest.raises(ConfigError, match=r"run.resume=.*expected one of false, true, auto"):
        load_config(path)


def test_resume_default_and_set_in_code() -> None:
    cfg = load_config()
    assert cfg.run.resume == "false"  # a string mode: `if cfg.run.resume:` would be wrong
    cfg.run.dir, cfg.run.resume = "somewhere", True  # type: ignore[assignment]
    validate(cfg)
    assert cfg.run.resume == "true"


# ---------------------------------------------------------------------- [checkpoint]
def test_checkpoint_section() -> None:
    cfg = load_config()
    assert cfg.checkpoint.keep == 0
    cfg = load_config(None, ["--checkpoint.keep=3"])
    assert cfg.checkpoint.keep == 3
    assert "[checkpoint]\nkeep = 3" in to_toml(cfg)
    assert cfg.train.checkpoint_every == 0  # the interval stays a [train] key


# ---------------------------------------------------------------------- model.init_from
def test_init_from_a_checkpoint_dir_keeps_the_preset_shape(tmp_path: Path) -> None:
    """A meshlm run dir (no config.json): the shape is the preset's; init_from is no override."""
    cfg = load_config(None, ["--model.preset=tiny", f"--model.init_from={tmp_path}",
                             "--data.seq_len=32"])
    assert cfg.model_config() == get_preset("tiny")
    assert f'init_from = "{tmp_path}"' in to_toml(cfg)
    # a saved config is read without the path checks (the folder may be gone)
    assert load_config(None, ["--model.init_from=/gone", "--data.seq_len=32"],
                       check_paths=False).model.init_from == "/gone"


@pytest.fixture()
def fake_hf(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``model_config_from_hf`` reading a test shape from config.json (Config.model_config's
    part is tested here; the real reader's in test_hf_interop)."""
    calls: list[Any] = []

    def model_config_from_hf(path_or_dict: Any) -> ModelConfig:
        calls.append(path_or_dict)
        d = json.loads((Path(path_or_dict) / "config.json").read_text())
        if "error" in d:
            raise ValueError(d["error"])
        return get_preset("tiny").with_(name="hf", n_layers=d["num_hidden_layers"])

    monkeypatch.setattr(hf_config, "model_config_from_hf", model_config_from_hf)
    return calls


def test_init_from_a_hugging_face_folder_gives_the_shape(tmp_path: Path, fake_hf: list[Any]
                                                         ) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    cfg = load_config(None, [f"--model.init_from={tmp_path}", "--data.seq_len=32"])
    mc = cfg.model_config()
    assert (mc.name, mc.n_layers, mc.dim) == ("hf", 3, get_preset("tiny").dim)  # not `small`
    assert fake_hf and Path(fake_hf[-1]) == tmp_path
    # explicit overrides still apply on top of the folder's shape
    cfg = load_config(None, [f"--model.init_from={tmp_path}", "--data.seq_len=32",
                             "--model.n_layers=1"])
    assert cfg.model_config().n_layers == 1


def test_init_from_an_unsupported_hugging_face_folder(tmp_path: Path, fake_hf: list[Any]
                                                      ) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"error": "hidden_act='gelu': not silu"}))
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--model.init_from={tmp_path}"])
    assert str(err.value) == f"model.init_from={str(tmp_path)!r}: hidden_act='gelu': not silu"


def test_init_from_a_real_llama_config(tmp_path: Path) -> None:
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
          "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 8,
          "num_key_value_heads": 4, "intermediate_size": 160, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = load_config(None, [f"--model.init_from={tmp_path}", "--data.seq_len=64",
                             "--model.n_kv_heads=2"])
    mc = cfg.model_config()
    assert (mc.n_layers, mc.dim, mc.ffn_hidden, mc.max_seq_len) == (3, 64, 160, 128)
    assert mc.n_kv_heads == 2  # the override
    with pytest.raises(ConfigError, match="data.seq_len=256 exceeds model.max_seq_len=128"):
        load_config(None, [f"--model.init_from={tmp_path}"])


@pytest.mark.parametrize(("per_rank", "pp", "schedule", "micro"), [
    (16, 1, "1f1b", 16), (16, 2, "zb", 8), (16, 4, "1f1b", 4), (16, 3, "1f1b", 4),
    (12, 3, "interleaved", 4), (16, 3, "interleaved", 1), (2, 4, "afab", 1)])
def test_automatic_micro_batch_gives_a_pipeline_at_least_pp_micro_batches(
        per_rank: int, pp: int, schedule: str, micro: int) -> None:
    from meshlm.config import pipeline_micro_batch

    assert pipeline_micro_batch(per_rank, pp, schedule) == micro


def test_the_pipeline_tour_line_runs_two_micro_batches() -> None:
    """`--parallel.pp=2` with the default batch: 2 micro-batches of 8, not 1 of 16."""
    cfg = load_config(None, ["--parallel.pp=2", "--parallel.pp_schedule=zb"])
    assert cfg.train.micro_batch == 8 and cfg.layout().micro_batches(cfg.train.global_batch) == 2
    explicit = load_config(None, ["--parallel.pp=2", "--train.micro_batch=16"])
    assert explicit.train.micro_batch == 16  # (a value the user set is kept)
