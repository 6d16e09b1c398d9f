"""Descriptions of one kind of technique, registered by the name the config gives each.

The torch-free cost descriptions (``precision_cost.py``, ``parallel/*_cost.py``) keep one
``Registry`` per kind: registering a name twice is an error, and looking up an unknown name
raises a ``ValueError`` listing the known ones. No communication; no memory to speak of.
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


class Registry(dict[Any, T]):
    """Descriptions of one kind, by the name the config gives them (each has ``.name``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, cost: T) -> T:
        name = cost.name  # type: ignore[attr-defined]
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is described twice")
        self[name] = cost
        return cost

    def __missing__(self, name: Any) -> T:
        raise ValueError(f"{self.kind} {name!r} is not one of {', '.join(map(str, self))}")


__all__ = ["Registry"]
