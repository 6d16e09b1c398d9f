"""The config's declarations: each key's allowed values are declared once (on its field, or in
meshlm.layout / meshlm.precision for the keys those own), every message is made from them,
validate only checks, and resolve derives the automatic values."""

from __future__ import annotations

import copy
import inspect
import typing
from dataclasses import fields
from typing import Any

import pytest

import meshlm.config as config_module
from meshlm import layout as layout_module
from meshlm import precision
from meshlm.config import (
    DTYPES,
    RULES,
    SECTIONS,
    Config,
    ConfigError,
    load_config,
    resolve,
    validate,
)
from meshlm.planner import workload
from meshlm.schema import Choice, Range, key_of

# Keys whose message is worded by their own reader or layout rule rather than "is not one
# of": it still lists every allowed value.
WORDED = {"parallel.zero", "run.resume"}


def _field_type(dotted: str) -> Any:
    section, _, name = dotted.partition(".")
    hint = typing.get_type_hints(SECTIONS[section].default_factory)[name]  # type: ignore[arg-type]
    return typing.get_args(hint)[0] if typing.get_args(hint) else hint


def _breaking(rule: Range) -> list[float]:
    """Values just outside ``rule``'s bounds."""
    out = []
    if rule.gt is not None:
        out.append(rule.gt if not rule.zero else rule.gt - 1)
    if rule.ge is not None:
        out.append(rule.ge - 1 if not (rule.zero and rule.ge - 1 == 0) else -1)
    if rule.lt is not None:
        out.append(rule.lt)
    if rule.le is not None:
        out.append(rule.le + 1)
    if rule.most is not None:
        out.append(rule.most + 1)
    return out


def _message(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, check_paths=False)
    return str(err.value)


def test_every_choice_message_lists_the_declared_values() -> None:
    choices = {k: r for k, r in RULES.items() if isinstance(r, Choice)}
    assert len(choices) >= 12
    for dotted, rule in choices.items():
        bad = 9 if _field_type(dotted) is int else "bogus"
        text = _message([f"--{dotted}={bad}"])
        assert f"{dotted}={bad!r}" in text, (dotted, text)
        if dotted in WORDED:
            assert all(str(v) in text for v in rule.values), (dotted, text)
        else:
            assert text.endswith(rule.problem(dotted, bad)), (dotted, text)  # type: ignore[arg-type]
            assert rule.listed in text, (dotted, text)


def test_every_range_message_is_the_declared_one() -> None:
    ranges = {k: r for k, r in RULES.items() if isinstance(r, Range)}
    assert len(ranges) >= 40
    for dotted, rule in ranges.items():
        kind = _field_type(dotted)
        for raw in _breaking(rule):
            value = kind(raw)
            assert not rule.allows(value), (dotted, value)
            text = _message([f"--{dotted}={value}"])
            if dotted in ("train.beta1", "train.beta2"):  # checked together, one message
                assert f"{dotted}={value}" in text and text.endswith(rule.requirement), text
            else:
                assert text == rule.problem(dotted, value), (dotted, text)


def test_allowed_values_are_declared_once() -> None:
    """The layout's keys take the layout's tuples, the dtypes precision's map; config.py and
    the planner spell none of them again."""
    for dotted, owned in (("parallel.pp_schedule", "SCHEDULES"),
                          ("parallel.cp_attention", "CP_MODES"),
                          ("train.recompute", "RECOMPUTE"), ("parallel.offload", "OFFLOADS"),
                          ("parallel.zero", "ZERO_STAGES")):
        assert RULES[dotted].values is getattr(layout_module, owned), dotted  # type: ignore[union-attr]
    assert DTYPES == tuple(precision.DTYPES)
    assert RULES["precision.dtype"].values is precision.PRECISIONS  # type: ignore[union-attr]
    assert precision.PRECISIONS == (*DTYPES, "fp8")
    assert RULES["diloco.reduce_dtype"].values is DTYPES  # type: ignore[union-attr]
    assert set(RULES["precision.grad_reduce_dtype"].values) < set(DTYPES)  # type: ignore[union-attr]
    assert workload.DTYPES is precision.PRECISIONS
    source = inspect.getsource(config_module) + inspect.getsource(workload)
    for values in (layout_module.SCHEDULES, layout_module.CP_MODES, layout_module.RECOMPUTE,
                   layout_module.OFFLOADS, DTYPES, DTYPES[:2]):
        assert ", ".join(f'"{v}"' for v in values) not in source, values
    # each rule lives on exactly one field: the declarations are the fields' metadata
    declared = [f"{name}.{key_of(f)}" for name, s in SECTIONS.items()
                for f in fields(s.default_factory) if "rule" in f.metadata]  # type: ignore[arg-type]
    assert declared == list(RULES)


def test_validate_changes_nothing() -> None:
    for cfg in (Config(), load_config(None, ["--train.global_batch=12", "--parallel.dp=3"])):
        cfg.run.dir = "somewhere"
        before = copy.deepcopy(cfg)
        validate(cfg, check_paths=False)
        assert cfg == before and vars(cfg) == vars(before)
    fresh = Config()
    validate(fresh)
    assert fresh.train.micro_batch == 0 and not fresh.micro_batch_auto


def test_resolve_sets_the_automatic_micro_batch() -> None:
    cfg = Config()
    cfg.train.global_batch, cfg.parallel.dp = 12, 3
    assert resolve(cfg) is cfg
    assert cfg.train.micro_batch == 4 and cfg.micro_batch_auto
    assert cfg.grad_accum == 1
    cfg.train.global_batch = 24  # the micro-batch follows the layout: resolved again
    assert resolve(cfg).train.micro_batch == 8
    set_by_hand = Config()
    set_by_hand.train.micro_batch = 2
    assert resolve(set_by_hand).train.micro_batch == 2 and not set_by_hand.micro_batch_auto
    loaded = load_config(None, ["--train.global_batch=12", "--parallel.dp=3"])
    assert (loaded.train.micro_batch, loaded.micro_batch_auto) == (4, True)


def test_resolve_leaves_what_it_cannot_derive_to_validate() -> None:
    cfg = Config()
    cfg.train.global_batch, cfg.parallel.dp = 9, 2
    resolve(cfg)
    assert cfg.train.micro_batch == 0 and not cfg.micro_batch_auto
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == "train.global_batch=9 is not divisible by parallel.dp=2"


@pytest.mark.parametrize("overrides", [
    [], ["--train.global_batch=8", "--parallel.pp=2", "--model.preset=tiny"],
    ["--train.global_batch=6", "--parallel.dp=2", "--parallel.pp=2", "--model.preset=tiny",
     "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2"],
])
def test_validate_judges_a_config_as_resolve_leaves_it(overrides: list[str]) -> None:
    """The same verdict before and after resolve: an unresolved micro-batch is checked as
    resolve derives it."""
    cfg = Config()
    for item in overrides:
        config_module._set(cfg, *item[2:].split("=", 1))

    def verdict(c: Config) -> str:
        try:
            validate(c, check_paths=False)
        except ConfigError as e:
            return str(e)
        return "ok"

    assert verdict(cfg) == verdict(resolve(copy.deepcopy(cfg)))


def test_resume_is_read_into_a_mode_when_set() -> None:
    cfg = Config()
    for given, mode in ((True, "true"), (False, "false"), (" AUTO", "auto"), ("yes", "true")):
        cfg.run.resume = given  # type: ignore[assignment]
        assert cfg.run.resume == mode
    cfg.run.resume = "maybe"  # left for validate to name
    with pytest.raises(ConfigError, match="run.resume='maybe': expected one of false, true, "
                                          "auto \\(or a boolean\\)"):
        validate(cfg)


def test_rule_messages() -> None:
    assert Range(gt=0).requirement == "must be positive"
    assert Range(ge=1, zero="all of dp").problem("parallel.dp_shard", -1) == (
        "parallel.dp_shard=-1 must be >= 1 (or 0: all of dp)")
    assert Range(gt=0, lt=1).problem("data.val_fraction", 1.0) == (
        "data.val_fraction=1.0 must lie in (0, 1)")
    assert Range(ge=0, note="0: off").problem("k", -2) == "k=-2 must be >= 0 (0: off)"
    assert Range(ge=260, most=2**32 - 1).problem("v", 2**32) == "v=4294967296 is too large"
    assert Range(gt=0, finite=True).problem("x", float("inf")) == "x=inf must be positive"
    assert Range(gt=0).problem("x", float("inf")) is None
    assert Choice(("a", "b")).problem("k", "c") == "k='c' is not one of a, b"
    assert Choice(("a",), what="preset").problem("k", "c") == "k='c' is not a preset (valid: a)"
    assert Choice((0, 1, 2), spoken=True).problem("z", 4) == "z=4 must be 0, 1 or 2"
    assert Choice(("false", "true"), booleans=True).problem("r", "x") == (
        "r='x': expected one of false, true (or a boolean)")


def test_a_key_spelled_apart_from_its_field(tmp_path) -> None:  # noqa: ANN001
    """``checkpoint.async`` (a Python keyword) is the field ``async_save``: read from TOML and
    overrides, written back by to_toml, listed among the section's keys; the field's own name
    is not a key."""
    from meshlm.config import to_toml

    assert [key_of(f) for f in fields(SECTIONS["checkpoint"].default_factory)  # type: ignore[arg-type]
            ] == ["keep", "async"]
    cfg = load_config(None, ["--checkpoint.async=true"], check_paths=False)
    assert cfg.checkpoint.async_save is True and Config().checkpoint.async_save is False
    path = tmp_path / "c.toml"
    path.write_text("[checkpoint]\nasync = true\nkeep = 2\n")
    assert load_config(path, check_paths=False).checkpoint.async_save is True
    text = to_toml(cfg)
    assert "async = true" in text and "async_save" not in text
    path.write_text(text)
    assert load_config(path, check_paths=False).checkpoint == cfg.checkpoint
    assert _message(["--checkpoint.async_save=true"]) == (
        "unknown config key 'checkpoint.async_save' (valid keys in [checkpoint]: keep, async)")
    assert _message(["--checkpoint.async=maybe"]) == (
        "checkpoint.async='maybe': expected true or false")


def test_every_key_is_declared_with_its_doc(capsys: pytest.CaptureFixture) -> None:
    """Name, type, allowed values, default and a one-line doc: all on the key's field, and
    ``meshlm train --keys`` prints them from there."""
    from meshlm.cli import main
    from meshlm.config import key_reference

    reference = key_reference()
    every = [f"{name}.{key_of(f)}" for name, s in SECTIONS.items()
             for f in fields(s.default_factory)]  # type: ignore[arg-type]
    assert [k for k, *_ in reference] == every
    assert all(doc and "\n" not in doc for *_, doc in reference)
    rows = dict((k, (d, a)) for k, d, a, _ in reference)
    assert rows["parallel.zero"] == ("0", "0, 1, 2, 3")
    assert rows["train.steps"] == ("500", "int that must be positive")
    assert rows["model.n_layers"][0] == "preset's" and rows["checkpoint.async"][0] == "false"
    assert main(["train", "--keys"]) == 0
    out = capsys.readouterr().out
    for key, default, accepts, doc in reference:
        assert f"{key} = {default}  ({accepts})\n    {doc}\n" in out, key
