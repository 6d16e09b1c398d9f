"""Output paths named on the command line, checked before any work: one rule for all.

A FILE output (``schedule --plot``, ``plan --calibration``) goes into a folder that must
already exist -- a missing one is named in the error, as matplotlib and most tools do; an
existing file of that name is replaced (written beside it first, then renamed over it, so a
failure leaves it as it was). A FOLDER output (``report --out``, ``prepare --out``,
``convert --to-hf``) is created with any missing parents. No communication; no memory beyond
the path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from .config import ConfigError


def output_file(path: str | Path, flag: str, formats: Iterable[str] | None = None) -> Path:
    """``path`` as a file meshlm may write (ConfigError naming ``flag`` and the path when it
    cannot): its folder exists and is writable, it is not a folder itself, and with
    ``formats`` its suffix is one of them."""
    p = Path(path).expanduser()
    where = f"{flag} {str(path)!r}"
    if formats is not None:
        kinds = sorted(formats)
        suffix = p.suffix.lower().lstrip(".")
        if suffix not in kinds:
            got = f"unknown format {p.suffix!r}" if suffix else "has no file suffix"
            raise ConfigError(f"{where}: {got} (one of {', '.join('.' + k for k in kinds)})")
    if p.is_dir():
        raise ConfigError(f"{where} is a folder; name a file in it, e.g. {p / ('out' + p.suffix)}")
    parent = p.parent
    if not parent.exists():
        raise ConfigError(f"{where}: folder {str(parent)!r} does not exist (create it first)")
    if not parent.is_dir():
        raise ConfigError(f"{where}: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{where}: no permission to write there")
    return p


def output_dir(path: str | Path, flag: str) -> Path:
    """``path`` as a folder meshlm may create (with its parents) or write into."""
    p = Path(path).expanduser()
    where = f"{flag} {str(path)!r}"
    if p.exists():
        if not p.is_dir():
            raise ConfigError(f"{where} is a file, not a folder")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(f"{where}: no permission to write there")
        return p
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{where} cannot be created: {str(parent)!r} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} cannot be created: no permission to write in "
                          f"{str(parent)!r}")
    return p


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a file beside ``path``, then rename it over ``path`` (a failure
    leaves ``path`` as it was and no temporary behind)."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
