"""One layout type: config, mesh and planner share :class:`meshlm.layout.Layout`, its rules
give one verdict whoever asks, validation runs once per launch, one stage partition."""

from __future__ import annotations

from pathlib import Path

import pytest

import meshlm.config as config_module
from meshlm.cli import main
from meshlm.config import ConfigError, load_config, resolve_world
from meshlm.distributed.mesh import Mesh
from meshlm.layout import (
    CONFIG_KEYS,
    SCHEDULES,
    Layout,
    partition_layers,
    schedule_problems,
)
from meshlm.models.presets import PRESETS
from meshlm.planner import (
    CATALOGUE,
    ModelSpec,
    Workload,
    evaluate,
    get_accelerator,
    parse_layout,
    search,
)


def test_config_mesh_and_planner_use_the_one_type() -> None:
    import meshlm.distributed.mesh as mesh_module
    import meshlm.parallel.schedules as schedules_module
    import meshlm.planner as planner
    import meshlm.planner.workload as workload_module

    cfg = load_config(None, ["--parallel.tp=2", "--train.micro_batch=8"])
    layout = cfg.layout()
    assert type(layout) is Layout
    assert (layout.tp, layout.dp, layout.micro_batch) == (2, 1, 8)  # dp 0 -> 1 outside a world
    assert type(parse_layout("tp=2,mbs=8")) is Layout
    assert parse_layout("tp=2,mbs=8", 2) == layout
    assert Mesh(Layout()).layout == Layout()
    work = Workload(ModelSpec(PRESETS["small"]), 256, 16, dtype="fp32")
    assert all(type(p.layout) is Layout for p in search(work, 2, CATALOGUE["h100-sxm"], top=3))
    assert planner.Layout is Layout
    assert not hasattr(mesh_module, "ParallelDims")
    assert workload_module.Layout is Layout and not hasattr(workload_module, "layout_problems")
    assert schedules_module.SCHEDULES is SCHEDULES
    assert not hasattr(config_module, "PP_SCHEDULES")


def test_config_round_trips_through_the_layout() -> None:
    cfg = load_config(None, ["--model.preset=tiny", "--train.micro_batch=4"])
    lo = Layout(pp=2, dp=2, pp_schedule="interleaved", pp_virtual=2, micro_batch=2, zero=1)
    cfg = cfg.with_layout(lo)
    assert cfg.layout() == lo
    assert (cfg.parallel.pp_schedule, cfg.train.micro_batch, cfg.world_size) == (
        "interleaved", 2, 4)
    assert cfg.grad_accum == lo.micro_batches(cfg.train.global_batch) == 4
    cfg = cfg.with_layout(Layout(recompute="full"))  # recomputation is train.recompute
    assert cfg.train.recompute == "full" and cfg.layout().recompute == "full"
    with pytest.raises(ConfigError, match="tp overlap is not a config key"):
        cfg.with_layout(Layout(tp_overlap=True))


def test_describe_parses_back() -> None:
    for lo in (Layout(), Layout(tp=4, sp=True, dp=2, zero=1, micro_batch=2),
               Layout(pp=4, dp=2, pp_schedule="interleaved", pp_virtual=2, recompute="selective"),
               Layout(pp=2, cp=2, ep=2, dp=2, pp_schedule="zb", tp_overlap=True, tp=2)):
        assert parse_layout(lo.describe()) == lo


def test_coords_are_row_major_with_tp_fastest() -> None:
    lo = Layout(pp=2, dp=2, cp=1, tp=2)
    assert lo.world_size == 8
    assert lo.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert [lo.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("overrides, layout_text, config_message, planner_message", [
    (["--parallel.tp=3"], "tp=3,mbs=16", "parallel.tp=3 does not divide model.n_heads=8",
     "tp=3 does not divide n_heads=8"),
    (["--parallel.sp=true"], "sp,mbs=16", "parallel.sp=true needs parallel.tp > 1",
     "sp=true needs tp > 1"),
    (["--parallel.zero=4"], "zero=4,mbs=16", "parallel.zero=4 must be 0, 1, 2 or 3",
     "zero=4 must be 0, 1, 2 or 3"),
    (["--parallel.pp=8", "--model.n_layers=4", "--train.micro_batch=2"], "pp=8,mbs=2",
     "parallel.pp * pp_virtual = 8 stages exceed model.n_layers=4",
     "pp * vpp = 8 stages exceed n_layers=4"),
    (["--train.micro_batch=5"], "mbs=5",
     "train.global_batch=16 is not divisible by train.micro_batch * parallel.dp = 5 * 1 = 5",
     "global_batch=16 is not divisible by mbs * dp = 5 * 1 = 5"),
    (["--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--parallel.pp_virtual=2",
      "--train.micro_batch=4"], "pp=2,schedule=1f1b,vpp=2,mbs=4",
     "parallel.pp_virtual=2 needs parallel.pp_schedule=interleaved",
     "vpp=2 needs schedule=interleaved"),
])
def test_a_rule_gives_one_verdict_through_config_and_planner(
        overrides: list[str], layout_text: str, config_message: str, planner_message: str
) -> None:
    """The same rule, checked once in meshlm.layout: the config names its keys, the planner
    its short names; both refuse."""
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert config_message in str(err.value)
    cfg = config_module.Config()
    if "--model.n_layers=4" in overrides:
        cfg.model.n_layers = 4
    work = Workload(ModelSpec(cfg.model_config()), cfg.data.seq_len, cfg.train.global_batch,
                    dtype="fp32")
    layout = parse_layout(layout_text, None)
    plan = evaluate(work, layout, get_accelerator("cpu"))
    assert planner_message in plan.problems
    config_view = layout.problems(work.model.config, work.seq_len, work.global_batch,
                                  trainer=True, keys=CONFIG_KEYS)
    assert any(config_message in p for p in config_view)


def test_check_args_is_the_layout_rule() -> None:
    from meshlm.parallel.schedules import check_args

    for args in (("interleaved", 4, 6, 2), ("1f1b", 2, 4, 2), ("gpipe", 2, 4, 1)):
        with pytest.raises(ValueError) as err:
            check_args(*args)
        assert str(err.value) == schedule_problems(*args)[0]


def _counting_validate(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = config_module.validate

    def counted(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(config_module, "validate", counted)
    return calls


@pytest.mark.parametrize("extra", [[], ["--parallel.auto=true"], ["--dry-run"]])
def test_validate_runs_once_per_launch(extra: list[str], tiny_args: list[str], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``meshlm train`` in one process: load_config validates, nothing else does (resolve_world,
    the auto layout and the Trainer check only what they change)."""
    calls = _counting_validate(monkeypatch)
    assert main(["train", *tiny_args, "--train.steps=1", "--train.eval_every=0", *extra]) == 0
    assert len(calls) == 1
    assert (tmp_path / "run").exists() == ("--dry-run" not in extra)


def test_resolve_world_checks_the_inferred_dp_without_validate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    bad = load_config(None, ["--train.global_batch=6", "--train.micro_batch=1"])
    ok = load_config(None, ["--train.global_batch=8", "--train.micro_batch=1"])
    calls = _counting_validate(monkeypatch)
    with pytest.raises(ConfigError, match="train.global_batch=6 is not divisible by "
                                          "train.micro_batch \\* parallel.dp = 1 \\* 4 = 4"):
        resolve_world(bad, 4)
    resolved = resolve_world(ok, 4)
    assert resolved.layout().dp == 4 and ok.parallel.dp == 0  # a copy: ok is left as it is
    assert resolve_world(resolved, 4).layout().dp == 4  # a set dp is only checked
    with pytest.raises(ConfigError, match="does not fit the world"):
        resolve_world(resolved, 8)
    assert not calls


def test_an_inferred_dp_is_checked_against_dp_shard_only_once_known() -> None:
    """Under torchrun / SLURM dp is inferred from the world after load_config: hybrid sharding
    with dp left unset validates, and the inferred dp is what dp_shard must divide."""
    cfg = load_config(None, ["--parallel.dp_shard=2", "--parallel.zero=3",
                             "--train.global_batch=8", "--train.micro_batch=1"])
    assert resolve_world(cfg, 4).layout().dp == 4
    with pytest.raises(ConfigError, match="parallel.dp_shard=2 does not divide parallel.dp=3"):
        resolve_world(load_config(None, ["--parallel.dp_shard=2", "--parallel.zero=3",
                                         "--train.global_batch=6", "--train.micro_batch=1"]), 3)
    with pytest.raises(ConfigError, match="parallel.dp_shard=2 does not divide parallel.dp=1"):
        resolve_world(cfg, None)  # a local launch: one process


def test_partition_layers_is_the_one_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    import meshlm.parallel.pipeline as pipeline

    # (the package's ``memory`` is the function: import the module by name)
    planner_memory = importlib.import_module("meshlm.planner.memory")

    assert pipeline.partition_layers is partition_layers
    assert planner_memory.partition_layers is partition_layers
    seen: list[tuple] = []

    def spy(*args):  # noqa: ANN002, ANN202
        seen.append(args)
        return partition_layers(*args)

    monkeypatch.setattr(planner_memory, "partition_layers", spy)
    work = Workload(ModelSpec(PRESETS["small"]), 64, 8, dtype="fp32")  # 4 layers
    split = Layout(pp=2, micro_batch=2, pp_layers="1,3")
    planner_memory.memory(work, split, get_accelerator("cpu"))
    assert (4, 2, "1,3") in seen  # the planner splits as the trainer does, explicit splits too
    assert planner_memory.stage_layers(4, Layout(pp=2, pp_layers="1,3"), 1) == [1, 2, 3]
    interleaved = Layout(pp=2, pp_virtual=2, pp_schedule="interleaved")
    assert planner_memory.stage_layers(8, interleaved, 0) == [0, 1, 4, 5]


def test_production_code_does_not_import_testing() -> None:
    import re

    import meshlm.distributed.spawn as spawn
    import meshlm.testing as testing

    assert testing.run_world is spawn.run_world
    imports_testing = re.compile(r"^\s*(from|import)\s+(meshlm\.|\.+)testing\b", re.M)
    src = Path(__file__).resolve().parents[1] / "src" / "meshlm"
    for path in src.rglob("*.py"):
        if path.name != "testing.py":
            assert not imports_testing.search(path.read_text()), path
