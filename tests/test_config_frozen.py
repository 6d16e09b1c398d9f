"""Nothing writes the config after validation: what is derived (the world's dp, the automatic
layout and micro-batch, the run directory, the resume decision) goes into new configs, and the
one a run reads is sealed."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from meshlm import cli
from meshlm.config import Config, load_config
from meshlm.layout import Layout


def test_sealed_config_refuses_writes_and_derives_copies() -> None:
    cfg = load_config(None, ["--model.preset=tiny", "--train.global_batch=8"])
    sealed = cfg.sealed()
    assert sealed == cfg and sealed.is_sealed and not cfg.is_sealed
    for write in (lambda: setattr(sealed.train, "steps", 3),
                  lambda: setattr(sealed.run, "resume", "true"),
                  lambda: setattr(sealed, "micro_batch_auto", False),
                  lambda: setattr(sealed, "train", Config().train)):
        with pytest.raises(AttributeError, match="the resolved config is frozen"):
            write()
    assert sealed == cfg  # the refused writes changed nothing
    derived = sealed.derive({"run.dir": "elsewhere", "checkpoint.async": True})
    assert (derived.run.dir, derived.checkpoint.async_save) == ("elsewhere", True)
    assert not derived.is_sealed and sealed.run.dir == "" and not sealed.checkpoint.async_save
    moved = sealed.with_layout(Layout(dp=2, micro_batch=2, zero=1))
    assert moved.layout().zero == 1 and sealed.layout().zero == 0
    assert copy.deepcopy(sealed).is_sealed  # (pickled to workers: still sealed)


@pytest.mark.parametrize("extra", [["--parallel.auto=true", "--run.dir="],
                                   ["--train.micro_batch=0"]])
def test_train_never_writes_the_validated_config(extra: list[str], tiny_args: list[str],
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """``meshlm train``: the automatic layout, the fitted micro-batch and the named run
    directory are new configs; the trainer's is sealed; load_config's is untouched."""
    from meshlm.train import trainer as trainer_module

    loaded: list[tuple[Config, Config]] = []
    real_load = cli.load_config

    def load(*args, **kwargs) -> Config:  # noqa: ANN002, ANN003
        cfg = real_load(*args, **kwargs)
        loaded.append((cfg, copy.deepcopy(cfg)))
        return cfg

    seen: list[Config] = []
    real_init = trainer_module.Trainer.__init__

    def init(self, cfg, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        real_init(self, cfg, *args, **kwargs)
        seen.append(self.cfg)

    monkeypatch.setattr(cli, "load_config", load)
    monkeypatch.setattr(trainer_module.Trainer, "__init__", init)
    monkeypatch.chdir(tmp_path)  # (an empty run.dir names one under runs/)
    args = [a for a in tiny_args if not a.startswith("--train.micro_batch")] + extra
    assert cli.main(["train", *args, "--train.steps=1", "--train.eval_every=0"]) == 0
    (cfg, before), = loaded
    assert cfg == before and vars(cfg) == vars(before)
    (run_cfg,) = seen
    assert run_cfg.is_sealed and run_cfg.run.dir and run_cfg.run.resume == "false"
    with pytest.raises(AttributeError):
        run_cfg.run.dir = "x"
