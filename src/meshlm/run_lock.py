"""One command per output folder: a run directory (``meshlm train``), a dataset folder
(``meshlm prepare --out``), a Hugging Face export (``meshlm convert --to-hf``).

:func:`claim` takes an exclusive ``flock`` on a lock file -- ``.meshlm.lock`` inside the folder,
or beside a folder that is written elsewhere and renamed into place -- and writes who holds it
into the file as JSON (pid, host, command, start time). A second command finds the lock taken
and stops with one line naming the folder and the holder, before it writes anything.

Why ``flock``: the kernel drops the lock when the last descriptor of the locked open file is
closed, i.e. when its holders exit, however they end (``kill -9``, the OOM killer, a crash).
A lock left by a dead command is therefore stale by construction -- its file is still there,
with the old holder's JSON, but nobody holds it -- and the next claim takes it and rewrites the
record; no pid check or timeout decides staleness. Worker processes hold the launcher's lock
too (:meth:`DirLock.handle` hands each one a descriptor of the same open file), so the lock is
free only once the launcher *and* every worker have ended, and a successor never writes beside
a leftover writer. (``flock`` is honoured on local file systems and on NFS, where Linux maps it
to a byte-range lock.)

Release: the holder removes the lock file while still holding it, then closes it; a claimer
that opened the old file checks, once it holds the lock, that the path still names the file it
locked, and otherwise starts over. Folders the claim had to create are removed again when they
are still empty (a refused command leaves nothing behind).

No communication; no memory beyond a descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from .config import ConfigError

LOCK_NAME = ".meshlm.lock"

# A holder on this host whose pid has exited may have workers that are still ending (they exit
# within about a second of their launcher): a claim waits this long for them before refusing.
ORPHAN_WAIT_S = 10.0
_POLL_S = 0.1

# flock errors meaning "this file system keeps no locks" (the claim then goes on unlocked).
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}

# Descriptors of a launcher's lock held by this (worker) process for its whole life.
_HELD: list[int] = []


class DirInUse(ConfigError):
    """The folder is claimed by a live command; the message is one line naming the holder."""


def is_lock_file(path: Path) -> bool:
    """Whether ``path`` is a lock file of this module (folder contents checks skip it)."""
    return path.name == LOCK_NAME


def contents(directory: Path) -> list[Path]:
    """What ``directory`` holds, apart from its lock file."""
    return [p for p in directory.iterdir() if not is_lock_file(p)]


def lock_path(directory: Path, beside: bool = False) -> Path:
    """The lock file of ``directory``: inside it, or (``beside``) next to it."""
    return directory.parent / f".{directory.name}{LOCK_NAME}" if beside else directory / LOCK_NAME


class _Handle:
    """A picklable share of a held lock: a process started with it (unpickled while it starts,
    as multiprocessing's ``DupFd`` does for descriptors) holds the lock until it exits."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return _hold, (reduction.DupFd(self.fd),)


def _hold(dup: Any) -> None:
    fd = dup.detach()
    os.set_inheritable(fd, False)
    _HELD.append(fd)  # never closed: the process's exit releases it


class DirLock:
    """A claimed folder (a context manager that releases it)."""

    def __init__(self, directory: Path, path: Path, fd: int | None, created: list[Path]) -> None:
        self.directory = directory
        self.path = path
        self._fd = fd
        self._created = created  # folders the claim made, outermost first

    @property
    def held(self) -> bool:
        return self._fd is not None

    def handle(self) -> _Handle | None:
        """What a worker process is handed so that it holds this lock too (None: not held)."""
        return None if self._fd is None else _Handle(self._fd)

    def release(self) -> None:
        """Remove the lock file (when it is still the one held), close it, and remove the
        folders the claim created when they are empty. Idempotent."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                if _same_file(self._fd, self.path):
                    self.path.unlink()
            os.close(self._fd)
            self._fd = None
        _remove_empty(self._created)
        self._created = []

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim(directory: str | Path, what: str, option: str, command: str, *,
          beside: bool = False, wait_s: float = ORPHAN_WAIT_S) -> DirLock:
    """Claim ``directory`` (created with its parents when missing) for this process.

    ``what`` names the folder in messages (``run.dir``), ``option`` is the flag that chooses
    another (``--run.dir``), ``command`` what the holder record says is running (``meshlm
    train``). Raises :class:`DirInUse` when a live command holds it, ConfigError when the
    folder or its lock file cannot be made.
    """
    directory = Path(directory).expanduser()
    path = lock_path(directory, beside)
    where = f"{what} {directory}"
    try:
        created = _make_dirs(path.parent)
    except OSError as e:
        raise ConfigError(f"{where} cannot be created: {e.strerror or e}") from None
    try:
        fd = _lock(path, where, option, wait_s)
        if fd is not None:
            _write_holder(fd, command)
    except BaseException:
        _remove_empty(created)
        raise
    return DirLock(directory, path, fd, created)


def _lock(path: Path, where: str, option: str, wait_s: float) -> int | None:
    """The descriptor of ``path``, exclusively locked; None where the file system has no
    locks (said on stderr)."""
    deadline: float | None = None
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ConfigError(f"{where}: cannot write its lock file {path.name} "
                              f"({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            if _orphaned(holder):  # its launcher died: its workers are ending
                deadline = deadline if deadline is not None else time.monotonic() + wait_s
                if time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                    continue
            raise DirInUse(f"{where} is in use by {_describe(holder)}; wait for it or choose "
                           f"another {option}") from None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                os.close(fd)
                raise ConfigError(f"{where}: cannot lock {path.name} ({e.strerror or e})") from None
            os.close(fd)
            print(f"meshlm: warning: {where} cannot be locked on this file system; nothing "
                  "stops another command from using it at the same time", file=sys.stderr)
            return None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # released and removed while this process opened it: once more


def _same_file(fd: int, path: Path) -> bool:
    try:
        st, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def _make_dirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; the ones created, outermost first."""
    missing: list[Path] = []
    p = folder
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def _remove_empty(created: list[Path]) -> None:
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            return


def _write_holder(fd: int, command: str) -> None:
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
              "argv": sys.argv, "started": datetime.now().isoformat(timespec="seconds")}
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read_holder(fd: int) -> dict[str, Any]:
    """The holder's record ({} when unreadable). A holder writes it right after locking, so an
    empty file is read again a few times."""
    for _ in range(5):
        try:
            data = os.pread(fd, 65536, 0)
        except OSError:
            return {}
        if data.strip():
            try:
                record = json.loads(data)
            except ValueError:
                return {}
            return record if isinstance(record, dict) else {}
        time.sleep(0.02)
    return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process)
        return True
    return True


def _orphaned(holder: dict[str, Any]) -> bool:
    """Whether the recorded holder ran on this host and has exited (its lock is held by the
    processes it started)."""
    pid = holder.get("pid")
    return (isinstance(pid, int) and holder.get("host") == socket.gethostname()
            and not _alive(pid))


def _describe(holder: dict[str, Any]) -> str:
    if not isinstance(holder.get("pid"), int):
        return "another process"
    who = f"pid {holder['pid']} on {holder.get('host', '?')}"
    if _orphaned(holder):
        who = f"the workers of {who}, which has exited"
    what = [str(holder[k]) for k in ("command",) if holder.get(k)]
    if holder.get("started"):
        what.append(f"started {str(holder['started']).replace('T', ' ')}")
    return f"{who} ({', '.join(what)})" if what else who
