"""What a config key accepts, declared once next to the key, and the messages made from it.

A key's rule is a :class:`Choice` (one of listed values) or a :class:`Range` (bounds, and what
0 means where 0 is special), given to the key's dataclass field by :func:`declare`. The rule both
decides whether a value is valid and writes the one line that names the key, the value and
what would be valid (:meth:`Choice.problem`, :meth:`Range.problem`), so the allowed values are
never written twice. :func:`rules` reads the declarations of a section back. A field whose
name cannot be the key (``checkpoint.async``: ``async`` is a Python keyword) declares the key
it is spelled as (``declare(..., key="async")``); :func:`key_of` gives it, and every reader
and writer of keys (the loader, the TOML writer, :func:`rules`) goes through it.

Rules that relate several keys (``train.min_lr <= train.lr``, a layout that must divide the
model) are not declarations: they live in the code that checks them (``meshlm.config``,
:class:`meshlm.layout.Layout`).

No communication; no memory beyond the declarations.
"""

from __future__ import annotations

import math
from dataclasses import Field, dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T")

_RULE = "rule"  # the field metadata entry holding a key's rule
_KEY = "key"  # the field metadata entry holding the key's spelling, where not the field name
_DOC = "doc"  # the field metadata entry holding the key's one-line doc


@dataclass(frozen=True)
class Choice:
    """The key takes one of ``values``; ``what`` names them in the message instead
    (``model.preset='x' is not a preset (valid: ...)``)."""

    values: tuple[Any, ...]
    what: str = ""
    spoken: bool = False  # the message reads ``key=4 must be 0, 1, 2 or 3`` (a short list)
    # booleans and their spellings are read as two of the values (``run.resume``)
    booleans: bool = False

    def allows(self, value: Any) -> bool:
        return value in self.values

    @property
    def listed(self) -> str:
        return ", ".join(str(v) for v in self.values)

    @property
    def spoken_list(self) -> str:
        """``0, 1, 2 or 3``."""
        *head, last = (str(v) for v in self.values)
        return f"{', '.join(head)} or {last}" if head else last

    def problem(self, key: str, value: Any) -> str | None:
        """The message for ``key=value`` (None: the value is allowed)."""
        if self.allows(value):
            return None
        if self.spoken:
            return f"{key}={value} must be {self.spoken_list}"
        if self.booleans:
            return f"{key}={value!r}: expected one of {self.listed} (or a boolean)"
        if self.what:
            return f"{key}={value!r} is not a {self.what} (valid: {self.listed})"
        return f"{key}={value!r} is not one of {self.listed}"


@dataclass(frozen=True)
class Range:
    """The key is a number within bounds: ``gt``/``ge`` below, ``lt``/``le`` above (both: the
    message reads ``must lie in [lo, hi)``). ``zero``: 0 is allowed too and means this;
    ``note``: what the bound is about, shown in parentheses; ``most``: the largest value a
    consumer can hold (above it: ``is too large``); ``finite``: inf is refused too."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    zero: str = ""
    note: str = ""
    most: int | None = None
    finite: bool = False

    def allows(self, value: Any) -> bool:
        if self.zero and value == 0:
            return True
        if self.finite and not math.isfinite(value):
            return False
        return ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le)
                and (self.most is None or value <= self.most))

    @property
    def requirement(self) -> str:
        """What a valid value satisfies: ``must be positive``, ``must be >= 1 (or 0: ...)``,
        ``must lie in (0, 1)``, ..."""
        low = self.gt if self.gt is not None else self.ge
        high = self.lt if self.lt is not None else self.le
        if low is not None and high is not None:
            text = (f"must lie in {'(' if self.gt is not None else '['}{low}, {high}"
                    f"{')' if self.lt is not None else ']'}")
        elif self.gt == 0:
            text = "must be positive"
        elif self.gt is not None:
            text = f"must be > {self.gt}"
        elif self.ge is not None:
            text = f"must be >= {self.ge}"
        elif self.lt is not None:
            text = f"must be < {self.lt}"
        else:
            text = f"must be <= {self.le}"
        if self.zero:
            text += f" (or 0: {self.zero})"
        if self.note:
            text += f" ({self.note})"
        return text

    def problem(self, key: str, value: Any) -> str | None:
        """The message for ``key=value`` (None: the value is allowed)."""
        if self.allows(value):
            return None
        if self.most is not None and value > self.most:
            return f"{key}={value} is too large"
        return f"{key}={value} {self.requirement}"


Rule = Choice | Range


def declare(default: T, rule: Rule | None = None, key: str = "", doc: str = "") -> T:
    """A config field with its ``default``, the ``rule`` its values obey and its one-line
    ``doc``; ``key``: how the key is spelled in TOML and on the command line when that cannot
    be the field's name."""
    meta: dict[str, Any] = {_RULE: rule} if rule is not None else {}
    if key:
        meta[_KEY] = key
    if doc:
        meta[_DOC] = doc
    out: Any = field(default=default, metadata=meta)
    return out


def key_of(f: Field) -> str:
    """The key a dataclass field is spelled as in TOML and overrides (its name by default)."""
    return f.metadata.get(_KEY, f.name)


def doc_of(f: Field) -> str:
    """The one-line doc a field's key is declared with ("" when none)."""
    return f.metadata.get(_DOC, "")


def section_keys(section: Any) -> dict[str, str]:
    """``{key: field name}`` of a section (a dataclass or an instance), in field order."""
    return {key_of(f): f.name for f in fields(section)}


def rules(section: type, prefix: str) -> dict[str, Rule]:
    """``{prefix.key: rule}`` of every field of the dataclass ``section`` that declares one."""
    return {f"{prefix}.{key_of(f)}": f.metadata[_RULE] for f in fields(section)
            if _RULE in f.metadata}
