"""Property-based fuzzing of the config schema: random keys and values (overrides and TOML
files) either load or raise ConfigError with a one-line message, never another exception."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from meshlm.config import Config, ConfigError, load_config
from meshlm.schema import key_of

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

REAL_KEYS = [f"{s.name}.{key_of(f)}" for s in fields(Config)
             for f in fields(getattr(Config(), s.name))
             if f.name != "init_from"]  # (an existing folder would be read: not fuzzed here)
INVENTED = ["train.stepz", "model", "model.", ".steps", "trian.steps", "train.steps.x", "",
            "parallel.DP", "x.y"]
KEYS = st.one_of(st.sampled_from(REAL_KEYS), st.sampled_from(INVENTED),
                 st.text(alphabet="abcdefghijklmnopqrstuvwxyz._", max_size=12))
VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(["0", "-1", "1", "2", "3", "4", "8", "-0", "1e400", "9" * 40]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "NaN", "true", "false", "yes", "", " ", "none",
                     "auto", "1,2", "3-5", "fp16", "bf16", "zb", "interleaved", "ulysses",
                     "cpu", "disk", "rollback", "tiny-moe", "tiny", "full"]),
    st.text(max_size=12),
)
SETTINGS = settings(max_examples=500, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _loads_or_one_line(path: Path | None, overrides: list[str]) -> None:
    try:
        load_config(path, overrides, check_paths=False)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))


@SETTINGS
@given(st.lists(st.tuples(KEYS, VALUES), max_size=6))
def test_random_overrides_never_raise_anything_else(pairs: list[tuple[str, str]]) -> None:
    _loads_or_one_line(None, [f"--{k}={v}" for k, v in pairs])


TOML_SCALARS = st.one_of(
    st.integers(min_value=-(2**66), max_value=2**66).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(
        lambda x: {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(x), repr(x))),
    st.booleans().map(lambda b: "true" if b else "false"),
    st.text(max_size=8).map(lambda s: '"' + s.replace("\\", "").replace('"', "") + '"'),
    st.sampled_from(["[1, 2]", "{a = 1}", "1979-05-27", '""', "[]"]),
)
SECTIONS = st.sampled_from([f.name for f in fields(Config)] + ["trainer", "train.sub", ""])


@st.composite
def toml_text(draw: st.DrawFn) -> str:
    """TOML-ish text: mostly well-formed sections of real/invented keys, sometimes noise."""
    lines = []
    for _ in range(draw(st.integers(0, 4))):
        lines.append(f"[{draw(SECTIONS)}]")
        for _ in range(draw(st.integers(0, 4))):
            key = draw(KEYS).rpartition(".")[2] or "k"
            lines.append(f"{key} = {draw(TOML_SCALARS)}")
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.text(max_size=20)))
    return "\n".join(lines)


@SETTINGS
@given(toml_text(), st.binary(max_size=4))
def test_random_toml_files_never_raise_anything_else(text: str, junk: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.toml"
        path.write_bytes(text.encode("utf-8", "surrogatepass") + junk)
        _loads_or_one_line(path, [])
