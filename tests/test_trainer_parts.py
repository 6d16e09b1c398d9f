"""The trainer's structure: parts built from their own config sections, one step path.

Every part of a :class:`Trainer` keeps the config section it was built from and never the
whole config; a plain run and a pipelined run take the same ``train_step`` and ``evaluate``
(micro-batches -> runner.forward_backward -> optimizer update -> loss reduce) and differ only
in the runner; the metrics record is the recorder's fields plus its contributors'; the
checkpointer saves and restores named stateful parts it knows nothing of.
"""

from __future__ import annotations

import ast
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import meshlm.train.parts.checkpointer as checkpointer_module
from meshlm.checkpoint.sharded import ShardedCheckpoint
from meshlm.config import load_config
from meshlm.testing import run_world
from meshlm.train.parts import Stateful
from meshlm.train.pipelined import PipelineRunner
from meshlm.train.steps import MicroBatchRunner
from meshlm.train.trainer import Trainer


def _trainer(args: list[str], states: Mapping[str, Stateful] | None = None) -> Trainer:
    return Trainer(load_config(None, args), log=lambda _m: None, progress=False, states=states)


def test_every_part_is_built_from_its_own_section(tiny_args: list[str]) -> None:
    trainer = _trainer(tiny_args)
    parts = trainer.parts
    assert len(parts) == len({type(p) for p in parts}) >= 9
    for part in parts:
        name = type(part).__name__
        assert part.section is getattr(trainer.cfg, part.SECTION), name
        assert all(v is not trainer.cfg for v in vars(part).values()), name
        annotations = [str(p.annotation) for p in
                       inspect.signature(type(part).__init__).parameters.values()]
        assert "Config" not in annotations, name  # sections, never the whole config


def _one_step(args: list[str]) -> dict[str, Any]:
    """Step 1 and one evaluation of a trainer, with the calls its parts received."""
    trainer = _trainer(args)
    calls: list[str] = []

    def spy(obj: object, name: str) -> None:
        method = getattr(obj, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            calls.append(name)
            return method(*a, **k)

        setattr(obj, name, wrapped)

    spy(trainer.batches, "micro_batches")
    spy(trainer.runner, "forward_backward")
    spy(trainer.optimizer, "update")
    spy(trainer.runner, "eval_loss")
    loss, grad_norm = trainer.train_step(1)
    step_calls = list(calls)
    calls.clear()
    val = trainer.evaluate()
    return {"runner": type(trainer.runner).__name__, "step": step_calls,
            "eval": sorted(set(calls)), "loss": loss, "grad_norm": grad_norm, "val": val,
            "pipeline": trainer.model_part.pipe is not None}


def test_plain_and_pipelined_runs_take_the_same_step(tiny_args: list[str], tmp_path: Path
                                                      ) -> None:
    plain = _one_step(tiny_args + [f"--run.dir={tmp_path / 'plain'}"])
    piped = run_world(2, _one_step, tiny_args + [f"--run.dir={tmp_path / 'pp'}",
                                                 "--parallel.pp=2"])
    assert plain["runner"] == MicroBatchRunner.__name__ and not plain["pipeline"]
    for rank in piped:
        assert rank["runner"] == PipelineRunner.__name__ and rank["pipeline"]
        assert rank["step"] == plain["step"] == ["micro_batches", "forward_backward", "update"]
        assert rank["eval"] == plain["eval"] == ["eval_loss"]
        assert rank["loss"] == pytest.approx(plain["loss"], rel=1e-5)
        assert rank["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
        assert rank["val"] == pytest.approx(plain["val"], rel=1e-5)


def test_record_merges_the_contributors_in_order(tiny_args: list[str]) -> None:
    trainer = _trainer(tiny_args)

    class Extra:
        def record(self, step: int) -> dict[str, Any]:
            return {"extra": step}

    trainer.recorder.contributors = [*trainer.recorder.contributors, Extra()]
    loss, grad_norm = trainer.train_step(1)
    rec = trainer.record(1, loss, grad_norm, 1.0)
    keys = list(rec)
    assert rec["extra"] == 1
    assert keys.index("comm_bytes") < keys.index("extra") < keys.index("step_time_per_rank")
    # a dense fp32 run without pp or cp: no contributor but the test's adds a field
    assert "loss_scale" not in rec and "pp_bubble" not in rec and "cp_attention" not in rec


# ------------------------------------------------------------------ stateful parts
def _imported(path: Path, package: str) -> set[str]:
    """Every module (and ``module.name``) that the file of a module of ``package`` imports."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            anchor = parts[:len(parts) - node.level + 1] if node.level else []
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            out |= {base, *(f"{base}.{a.name}" for a in node.names)}
    return out


def test_the_checkpointer_imports_no_part() -> None:
    path = Path(checkpointer_module.__file__)
    parts = {f"meshlm.train.parts.{p.stem}" for p in path.parent.glob("*.py")
             if p.stem not in ("__init__", path.stem)}
    assert len(parts) >= 8
    imported = _imported(path, "meshlm.train.parts")
    assert "meshlm.train.parts.Stateful" in imported  # (the resolution works)
    assert not imported & parts


class Counter:
    """A part added from outside: its run state is one number, counted per step."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"counter": {"count": self.count}}

    def load_state_dict(self, state: Mapping[str, Any], ckpt: ShardedCheckpoint) -> None:
        self.count = int(state["counter"]["count"])


def _counted_fit(trainer: Trainer, counter: Counter) -> None:
    step = trainer.train_step

    def counted(k: int) -> tuple[float, float | None]:
        counter.count += 1
        return step(k)

    trainer.train_step = counted  # type: ignore[method-assign]
    trainer.fit()


def test_a_registered_stateful_part_is_saved_and_restored(tiny_args: list[str],
                                                          tmp_path: Path) -> None:
    args = tiny_args + ["--train.eval_every=0"]
    first = Counter()
    assert isinstance(first, Stateful)
    _counted_fit(_trainer(args + ["--train.steps=2"], {"counter": first}), first)
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_0000002" / "trainer.json")
                       .read_text())
    assert saved["counter"] == {"count": 2}
    # the format's keys are those it always had, plus the new part's
    assert set(saved) == {"sampler", "model", "tokens_seen", "layout", "scaler", "step",
                          "adam_step", "counter"}
    assert saved["step"] == 2 and saved["tokens_seen"] == 2 * 8 * 32

    second = Counter()
    trainer = _trainer(args + ["--train.steps=4", "--run.resume=true"], {"counter": second})
    assert trainer.step == 2 and second.count == 2  # restored with the rest of the run
    _counted_fit(trainer, second)
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000004" / "trainer.json"
    assert json.loads(ckpt.read_text())["counter"] == {"count": 4}

    class Clash:  # a part claiming a key another part owns is refused, by name
        def state_dict(self) -> dict[str, Any]:
            return {"sampler": {}}

        def load_state_dict(self, state: Mapping[str, Any], ckpt: ShardedCheckpoint) -> None:
            pass

    trainer.checkpointer.states["clash"] = Clash()
    with pytest.raises(ValueError, match="'sampler'.*'clash'.*'batches'"):
        trainer.checkpointer.state_dict()
    with pytest.raises(ValueError, match="trainer's own"):
        _trainer(args, {"model": Counter()})
