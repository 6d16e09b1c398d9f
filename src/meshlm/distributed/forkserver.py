"""The forkserver that local workers fork from, started without importing torch.

A process has one multiprocessing forkserver: it imports a list of modules once (torch, its
compiler front end, meshlm: seconds) and then forks every worker from itself in a fraction of a
second. Nothing here imports torch, so a launcher can start the server first thing and let the
server's imports run beside its own (on another core) instead of before the first fork.
Communication: one unix socket to the server per started process; memory: one idle server
process holding the imported modules.
"""

from __future__ import annotations

import contextlib
import os
import sys

# What launch_local's workers find imported. torch._dynamo: torch's optimizers import it when
# the first one is built (seconds per rank).
LAUNCH_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "meshlm.train.trainer",
                  "meshlm.launch"]

_PRELOADS: set[str] = set()


class CallerStdio:
    """The caller's stdout and stderr, for a process forked from a forkserver (whose own are
    those of whoever started the server, e.g. an earlier test's captured output). Pickled while
    the process starts, the descriptors travel with it, and unpickling puts them in place of
    the child's 1 and 2 before the process runs anything."""

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, ValueError, OSError):
                stream.flush()
        return _adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt_stdio(out, err) -> CallerStdio:  # noqa: ANN001
    for dup, fd in ((out, 1), (err, 2)):
        os.dup2(dup.detach(), fd)
    return CallerStdio()


def forkserver_context(preload: list[str]):  # noqa: ANN201
    """multiprocessing's forkserver context, its server importing ``preload`` and what every
    earlier caller in this process asked for (a process has one server, started by the first
    process forked, with the list of that moment); the spawn context where there is none."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    _PRELOADS.update(preload)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(sorted(_PRELOADS))
    return ctx


def start_worker_server(preload: list[str] = LAUNCH_PRELOAD) -> None:
    """Start the forkserver now (where there is one), importing ``preload``: its imports then
    overlap whatever this process does before its first fork (importing torch itself, checking
    and caching data)."""
    ensure_server(forkserver_context(preload))


def ensure_server(ctx) -> None:  # noqa: ANN001
    """Start ``ctx``'s forkserver if it is one and not running yet, with /dev/null for its stdin
    and stdout. Every process forked from it takes its caller's (:class:`CallerStdio`); the
    server itself would otherwise hold this process's stdout open after this process exits,
    while it tears down its imports (a second here), and ``meshlm train ... | tee log`` would
    wait for that. Its stderr stays this process's: a child that fails before it takes its
    caller's (importing the main module, e.g. a script without a ``__main__`` guard) says why
    there."""
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stdout.flush()
    null = os.open(os.devnull, os.O_RDWR)
    saved = [os.dup(fd) for fd in (0, 1)]
    try:
        for fd in (0, 1):
            os.dup2(null, fd)
        forkserver.ensure_running()
    finally:
        for fd, dup in zip((0, 1), saved, strict=True):
            os.dup2(dup, fd)
            os.close(dup)
        os.close(null)


def run_script(path: str, argv: list[str], log: str, environ: dict[str, str]) -> None:
    """Body of a forked process that runs the script ``path`` as ``__main__`` with ``argv``:
    in a session of its own (so its caller can kill it and whatever it started as one group),
    stdout and stderr to the file ``log``, with ``environ`` (the caller's, as it is now: a
    forked process has the server's). A benchmark's rows run this way start in a fraction of
    a second instead of importing torch and meshlm in a fresh interpreter."""
    import runpy

    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")
