"""Process launching: find the distributed world we are in, or start one on this machine.

meshlm runs the same training function in three situations:

* under ``torchrun`` (or any torch-elastic agent), which sets ``RANK``, ``WORLD_SIZE``, ...;
* under SLURM with one task per GPU (``srun python -m meshlm.cli train ...``), which sets
  ``SLURM_PROCID``, ``SLURM_NTASKS``, ... and nothing torch understands;
* on a laptop or a single-task allocation, where meshlm starts the workers itself with
  :func:`launch_local`.

:func:`detect_external_world` tells the first two apart from the third. :func:`init_worker`
turns whichever environment a worker finds into an initialised ``torch.distributed`` process
group, on the GPU :func:`choose_device` picks from what the launcher made visible (one GPU per
rank, or a one-line :class:`DeviceError`). :func:`launch_local` starts local workers through
torch's elastic agent -- the machinery behind ``torchrun`` -- so local runs behave like
``torchrun --nproc-per-node=N``: the same environment variables, rendezvous and fail-stop
behaviour (one failed worker stops the others). The workers fork from a forkserver that has
torch and meshlm imported (no CUDA initialised there), so N workers cost one import.
With ``max_restarts`` > 0 the agent then starts the whole worker group again, up to that many
times; the new workers see ``TORCHELASTIC_RESTART_COUNT`` > 0 (meshlm's trainer then resumes from
the latest checkpoint) and rank 0 prints one line saying so. A failure of the last attempt comes
back as one :class:`WorkerFailure` whose message is a single line naming the rank and the root
cause; the full report is kept on ``.details``.

Workers never outlive the launching process: each ends at once when it has gone, however it
ended (:func:`end_with_launcher`), and each holds the run directory's lock while it lives
(``hold``), so the lock is free only when no process of the run is left.

Communication: the agent's rendezvous store and the workers' process group (TCP, gloo/NCCL).
Memory: one agent in the launching process, and whatever ``fn`` needs in each worker.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import select
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .config import ConfigError
from .distributed.forkserver import (  # noqa: F401 (start_worker_server: re-exported)
    LAUNCH_PRELOAD,
    CallerStdio,
    ensure_server,
    forkserver_context,
    start_worker_server,
)
from .world import (  # noqa: F401 (world detection, re-exported: launch is where users look)
    _SOURCE_VAR,
    WorldInfo,
    detect_external_world,
    expand_nodelist,
    export_env,
    free_port,
)

T = TypeVar("T")

# The elastic agent runs inside this process and logs every rendezvous, worker start and shutdown
# at INFO/WARNING, plus a full ERROR traceback for each failure, which WorkerFailure already
# reports. These are the logger name prefixes silenced while launch_local runs.
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher",
                  "torch.multiprocessing")

# Failures a worker sees when a *peer* died or a collective broke: consequences of another rank's
# failure rather than root causes. torch raises the Dist* types; gloo reports a dead peer as a
# plain RuntimeError, recognisable only by its message.
_SECONDARY_ERRORS = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
_SECONDARY_MARKERS = ("closed by peer", "reset by peer", "remote worker crashing", "Broken pipe")

# A worker failing with a secondary error waits this long before exiting, so that the agent (which
# polls every _MONITOR_INTERVAL_S and reports the first dead worker it sees) observes the rank
# that really failed -- e.g. one killed by a signal, which leaves no error file to compare by --
# before the ranks that only lost their peer. The agent SIGTERMs the waiting worker anyway.
_SECONDARY_EXIT_DELAY_S = 2.0
_MONITOR_INTERVAL_S = 0.05

# How long the agent waits for SIGTERMed workers before SIGKILL when the group fails (torch's
# default is 30 s). Short: the workers are failing anyway, and a frozen (SIGSTOPped) worker
# never exits before SIGKILL.
_SHUTDOWN_TIMEOUT_S = 5

# launch_local's folder of per-rank pid files (graceful stop: SIGTERM/SIGINT are relayed).
_LAUNCH_DIR_VAR = "MESHLM_LAUNCH_DIR"

# The pid of the process that ran launch_local: its workers end when it has ended.
_LAUNCHER_PID_VAR = "MESHLM_LAUNCHER_PID"
# How a worker whose launcher has gone exits (nobody is left to read it).
_ORPHAN_EXIT = 128 + signal.SIGHUP

# Set by the elastic agent (torchrun's or launch_local's) in every worker it starts.
_RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"
_MAX_RESTARTS_VAR = "TORCHELASTIC_MAX_RESTARTS"
_UNSHARED_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# The environment this module was imported with. In a forked worker that is the forkserver's,
# from when it started: _adopt_environ replaces it by the launcher's of this launch.
_IMPORT_ENV = dict(os.environ)


class WorkerFailure(RuntimeError):
    """A launch_local worker raised or died; ``str()`` is one line, ``details`` the full report."""

    def __init__(self, message: str, rank: int, details: str = "", log_dir: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.details = details
        self.log_dir = log_dir


# --------------------------------------------------------------------------- inside a worker


class DeviceError(ConfigError):
    """This rank has no GPU of its own; the message is one line naming the fix."""


def choose_device(local_rank: int, local_world_size: int, visible_gpus: int,
                  per_task: bool = False, visible: str | None = None) -> int | None:
    """The CUDA device index of local rank ``local_rank`` of ``local_world_size`` on a node
    where this process sees ``visible_gpus`` GPUs; None without GPUs (a CPU run, gloo).

    * ``visible_gpus >= local_world_size``: ``local_rank`` -- torchrun and
      :func:`launch_local` show every rank all GPUs, and so does SLURM without GPU binding
      (``local_rank`` is then ``SLURM_LOCALID``);
    * ``visible_gpus == 1`` where the launcher may give each task its own GPU (``per_task``:
      SLURM with ``--gpus-per-task=1`` or ``--gpu-bind``): ``0``, that GPU;
    * anything else would put two ranks on one GPU (NCCL refuses: "Duplicate GPU detected")
      or name a device that does not exist: :class:`DeviceError`. ``visible``: the value of
      ``CUDA_VISIBLE_DEVICES`` for the message.
    """
    if visible_gpus <= 0:
        return None
    if visible_gpus >= local_world_size:
        return local_rank
    if visible_gpus == 1 and per_task:
        return 0
    most = f"at most {visible_gpus} {{}}{'s' * (visible_gpus != 1)} per node"
    fix = (f"give each task one GPU (srun --gpus-per-task=1) or start {most.format('task')}"
           if per_task else f"start {most.format('rank')} (e.g. --parallel.dp={visible_gpus}), "
           "or run on a node with more GPUs")
    raise DeviceError(f"{local_world_size} local ranks but only {visible_gpus} GPU"
                      f"{'s' * (visible_gpus != 1)} visible (CUDA_VISIBLE_DEVICES="
                      f"{visible if visible is not None else 'unset'}): {fix}")


def worker_device(info: WorldInfo, env: Mapping[str, str] = os.environ) -> torch.device | None:
    """The CUDA device of the rank ``info`` describes (:func:`choose_device` on what the
    launcher made visible); None on a machine without CUDA."""
    if not torch.cuda.is_available():
        return None
    index = choose_device(info.local_rank, info.local_world_size, torch.cuda.device_count(),
                          per_task=info.source == "slurm",
                          visible=env.get("CUDA_VISIBLE_DEVICES"))
    return None if index is None else torch.device("cuda", index)


def refuse_local_ranks(nprocs: int, env: Mapping[str, str] = os.environ) -> None:
    """:class:`DeviceError` when :func:`launch_local` would start more ranks than this
    machine's GPUs (on a machine with CUDA), before any worker starts."""
    if torch.cuda.is_available():
        choose_device(nprocs - 1, nprocs, torch.cuda.device_count(),
                      visible=env.get("CUDA_VISIBLE_DEVICES"))


def init_worker(timeout_s: float = 300) -> WorldInfo:
    """Join the process group of the world this worker was started in; returns that world."""
    info = detect_external_world()
    if info is None:
        raise RuntimeError("init_worker() found no distributed environment: start workers "
                           "with torchrun, srun (more than one task) or meshlm.launch.launch_local")
    if info.source == "slurm":
        export_env(info)
    device = worker_device(info)
    if device is not None:
        # GPU-only path past this line: set_device and NCCL are untested on CPU machines
        # (the choice of the device is tested, tests/test_devices.py).
        torch.cuda.set_device(device)
        backend, device_id = "nccl", device  # bound device: eager NCCL init, ncclCommSplit
    else:
        # Several CPU workers share the cores; one intra-op thread each avoids oversubscription.
        torch.set_num_threads(1)
        backend, device_id = "gloo", None
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device_id)
        if backend == "gloo" and info.world_size > 1:
            # gloo's full mesh is built rank by rank: a rank whose work needs no collective can
            # end and close its sockets while a peer is still connecting, and that peer fails
            # ("Connection closed by peer"). Init returns once every rank's mesh is complete.
            dist.barrier()
    return info


def nccl_flight_env(flight_dir: str) -> dict[str, str]:
    """torch's own NCCL Flight Recorder, dumped into ``flight_dir`` on a collective timeout
    (``nccl_trace_rank_N``; read with ``torch.distributed.flight_recorder``). GPU-only path,
    untested on the CPU machines meshlm's tests run on; empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": os.path.join(flight_dir, "nccl_trace_rank_")}


def restart_message(env: Mapping[str, str] = os.environ) -> str | None:
    """The line rank 0 prints when the elastic agent restarted the worker group (else None)."""
    try:
        count = int(env.get(_RESTART_COUNT_VAR, "") or 0)
    except ValueError:
        return None
    if count <= 0:
        return None
    limit = env.get(_MAX_RESTARTS_VAR, "?")
    return (f"worker group restarted ({count} of {limit}) after a worker failure; "
            "every rank was started again")


def announce_restart(rank: int) -> None:
    """Rank 0 prints :func:`restart_message` when there is one."""
    message = restart_message()
    if message is not None and rank == 0:
        print(message, flush=True)


def shutdown_worker(wait_for_peers: bool = False, timeout_s: float = 30.0) -> None:
    """Destroy the default process group if there is one.

    ``wait_for_peers`` (a run that ended well): rank 0 leaves only after every rank has
    destroyed its group. Under SLURM rank 0 hosts the rendezvous store (no agent does);
    leaving first closes it under peers still tearing gloo down, which can abort them
    ("terminate called without an active exception") after a complete run.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store() if wait_for_peers and world > 1 else None
    dist.destroy_process_group()
    if store is None:
        return
    key = f"meshlm/left/{os.environ.get(_RESTART_COUNT_VAR, '0')}"
    with contextlib.suppress(Exception):  # best effort: the run itself is complete
        left = store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while rank == 0 and left < world and time.monotonic() < deadline:
            time.sleep(0.02)
            left = store.add(key, 0)


def rank_zero_text(text: str) -> str:
    """Rank 0's ``text`` on every rank of the initialised world (the others' ``text`` is
    ignored), through the rendezvous store: no collective, one key per (re)start."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return text
    store = dist.distributed_c10d._get_default_store()
    key = f"meshlm/rank0/{os.environ.get(_RESTART_COUNT_VAR, '0')}"
    if dist.get_rank() == 0:
        store.set(key, text)
    return store.get(key).decode()


def _is_secondary(message: str) -> bool:
    """Whether a ``"TypeName: text"`` error message is a consequence of a peer's failure."""
    type_name = message.split(":", 1)[0].strip()
    return type_name in _SECONDARY_ERRORS or any(m in message for m in _SECONDARY_MARKERS)


def _adopt_environ(environ: Mapping[str, str]) -> None:
    """This worker's environment: the launcher's ``environ`` as it was at this launch, plus what
    the agent set for this worker (the variables that differ from the inherited ones)."""
    agent = {k: v for k, v in os.environ.items() if _IMPORT_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(agent)


def _wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` has ended (at once when there is none)."""
    try:
        fd = os.pidfd_open(pid)  # Linux >= 5.3: readable when the process ends
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfds here: poll
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except OSError:
                pass
            time.sleep(0.2)
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def end_with_launcher(pid: int) -> None:
    """End this worker at once (``os._exit``) when the launcher ``pid`` has ended, however it
    ended (``kill -9``, the OOM killer, a crash); a daemon thread waits for that.

    A parent-death signal (``prctl(PR_SET_PDEATHSIG)``) would not do: the workers are children
    of the forkserver, not of the launcher, and the forkserver lives on while they do. Without
    its launcher a worker would go on training and writing into the run directory, and after
    a stop request wait forever (futex) for the agent to collect its result. Nothing it
    leaves is half-written where a successor reads: checkpoints become visible by a rename
    (a ``.tmp`` folder is ignored and deleted), and the run directory's lock is free only once
    every worker has ended (:mod:`meshlm.run_lock`)."""

    def watch() -> None:
        _wait_for_exit(pid)
        os._exit(_ORPHAN_EXIT)

    threading.Thread(target=watch, daemon=True, name="meshlm-launcher-watch").start()


def _start_method() -> str:
    """launch_local's workers fork from a forkserver that has imported :data:`LAUNCH_PRELOAD`
    once (a spawned worker imports torch and meshlm itself: seconds per rank); spawn where there
    is no forkserver."""
    return forkserver_context(LAUNCH_PRELOAD).get_start_method()


# @record writes the exception (type, message, traceback) to the error file the agent assigned
# this worker; the agent reads it back into ChildFailedError, which is where WorkerFailure gets
# the root cause from. Module level, because spawn pickles the entry point by qualified name.
@record
def _worker_main(stdio: CallerStdio, held: object, fn: Callable[..., T], timeout_s: float,
                 environ: Mapping[str, str], *args: Any) -> T:
    """What each launch_local worker runs: init, ``fn(*args)``, shutdown (also on failure).
    ``stdio``: the launcher's stdout / stderr, already in place (put there when this process's
    arguments were unpickled; first, so a failure to unpickle the rest is seen); ``held``:
    the launcher's run-directory lock, held by this process too from when it was unpickled
    (None: no lock); ``environ``: the launcher's environment. The worker ends at once when the
    launcher has ended (:func:`end_with_launcher`)."""
    _adopt_environ(environ)
    if launcher := os.environ.get(_LAUNCHER_PID_VAR):
        end_with_launcher(int(launcher))
    if folder := os.environ.get(_LAUNCH_DIR_VAR):
        with contextlib.suppress(OSError):
            with open(os.path.join(folder, f"pid_{os.environ.get('RANK', '0')}"), "w") as f:
                f.write(str(os.getpid()))
    try:
        announce_restart(init_worker(timeout_s).rank)
        return fn(*args)
    except BaseException as exc:
        if isinstance(exc, dist.DistError) or _is_secondary(f"{type(exc).__name__}: {exc}"):
            time.sleep(_SECONDARY_EXIT_DELAY_S)  # see _SECONDARY_EXIT_DELAY_S
        raise
    finally:
        shutdown_worker()


# --------------------------------------------------------------------------- launching


@contextlib.contextmanager
def _patched_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set env vars for the duration (spawned workers inherit them), then restore."""
    keys = [*values, "TORCHELASTIC_SIGNALS_TO_HANDLE"]  # the agent sets this one and leaves it
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_agent_logs() -> Iterator[None]:
    """Raise the agent's loggers to CRITICAL for the duration, then restore their levels."""
    # Import the rendezvous modules first: their loggers are created on import and must exist
    # before we adjust levels (each elastic module sets its own level, so the parent's level
    # alone does not cover them).
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401

    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith(_AGENT_LOGGERS)]
    loggers += [logging.getLogger(name) for name in _AGENT_LOGGERS]
    saved = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)


@contextlib.contextmanager
def _short_failure_shutdown() -> Iterator[None]:
    """Make the agent give failed workers ``_SHUTDOWN_TIMEOUT_S`` to exit before SIGKILL.

    When a worker fails, torch's process context waits a fixed 30 s for the others after
    SIGTERM (its shutdown_timeout applies only at the end of a run), so a frozen (SIGSTOPped)
    worker would hold the job that long. The agent class ``elastic_launch`` builds is swapped
    for a subclass that passes a grace period to that join, while this runs; where torch's
    internals differ, its own behaviour stays.
    """
    import functools

    import torch.distributed.launcher.api as launcher_api

    base = launcher_api.LocalElasticAgent

    class _Agent(base):  # type: ignore[misc, valid-type]
        def _stop_workers(self, worker_group: Any) -> None:
            self._shutdown(timeout=_SHUTDOWN_TIMEOUT_S)

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            out = super()._start_workers(worker_group)
            pc = getattr(getattr(self, "_pcontext", None), "_pc", None)
            if pc is not None and callable(getattr(pc, "join", None)):
                pc.join = functools.partial(pc.join, grace_period=_SHUTDOWN_TIMEOUT_S / 2)
            return out

    launcher_api.LocalElasticAgent = _Agent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = base


@contextlib.contextmanager
def _kept_signal_handlers() -> Iterator[None]:
    """Restore the handlers the agent installs for SIGTERM/SIGINT/SIGHUP/SIGQUIT and never removes.

    Without this, a later SIGTERM or Ctrl-C in the launching process would raise torch's
    SignalException instead of behaving as before.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # the agent only installs handlers from the main thread
        return
    sigs = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    saved = {s: signal.getsignal(s) for s in sigs}
    try:
        yield
    finally:
        for s, h in saved.items():
            if h is not None:
                signal.signal(s, h)


class _SignalRelay:
    """launch_local's SIGTERM/SIGINT handler: pass the signal to every worker (which finish the
    step, save a checkpoint and exit 0: train/stopping.py). A repeat at least a second later
    is relayed too (the workers then stop at once) and remembered as ``repeated``."""

    def __init__(self, folder: str) -> None:
        self.folder, self.first, self.repeated = folder, 0.0, False

    def __call__(self, signum: int, _frame: object) -> None:
        now = time.monotonic()
        if self.first and now - self.first >= 1.0:
            self.repeated = True
        self.first = self.first or now
        for path in glob.glob(os.path.join(self.folder, "pid_*")):
            try:
                with open(path) as f:
                    os.kill(int(f.read().strip()), signum)
            except (OSError, ValueError):
                continue

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        for s in saved:
            signal.signal(s, self)
        try:
            yield
        finally:
            for s, h in saved.items():
                signal.signal(s, h)


def _last_attempt(log_dir: str) -> int:
    """The highest ``attempt_<k>`` the agent made logs for in this launch (0 when none)."""
    attempts = [int(m.group(1)) for path in glob.glob(os.path.join(log_dir, "*", "attempt_*"))
                if (m := re.fullmatch(r"attempt_(\d+)", os.path.basename(path)))]
    return max(attempts, default=0)


def _error_files(log_dir: str) -> dict[int, tuple[float, dict[str, Any]]]:
    """Error files written by @record in the last attempt of this launch: local rank -> (mtime,
    parsed json)."""
    found: dict[int, tuple[float, dict[str, Any]]] = {}
    attempt = f"attempt_{_last_attempt(log_dir)}"
    for path in glob.glob(os.path.join(log_dir, "*", attempt, "*", "error.json")):
        try:
            with open(path) as f:
                data = json.load(f)
            found[int(os.path.basename(os.path.dirname(path)))] = (os.path.getmtime(path), data)
        except (OSError, ValueError):
            continue
    return found


def _error_message(data: Mapping[str, Any]) -> str:
    msg = data.get("message", "")
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    return str(msg)


def _first_line(text: str, limit: int = 300) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _last_collective(flight_dir: str | None, rank: int) -> str:
    """"; its last collective: ..." from the rank's flight records ("" when none)."""
    if not flight_dir:
        return ""
    from .distributed.flight import coords_text, describe_record, read_ring

    meta = read_ring(Path(flight_dir), rank)
    if not meta:
        return ""
    rec = meta["records"][-1] if meta["records"] else None
    return (f" ({coords_text(meta)}); its last collective: {describe_record(rec)} "
            f"(flight records: {flight_dir})")


def _summarise(err: Any, log_dir: str, flight_dir: str | None = None) -> tuple[int, str]:
    """(rank, one-line message) of the root cause of a ChildFailedError."""
    rank, failure = err.get_first_failure()
    aborted = failure.exitcode == -signal.SIGABRT
    if failure.exitcode < 0 and not aborted:
        # Died by a signal: nothing ran afterwards to write an error file, so it failed first.
        return rank, (f"worker rank {rank} died (signal {failure.signal_name()})"
                      + _last_collective(flight_dir, rank))
    # SIGABRT is what NCCL's watchdog (or NCCL-semantics mode) does to a rank whose collective
    # timed out: a consequence. The root cause is in another rank's error file (the stall
    # monitor's verdict, meshlm/distributed/stall.py) when there is one.
    # No error file (e.g. the worker died while starting up) leaves torch's placeholder data.
    has_file = os.path.isfile(failure.error_file)
    reported = _error_message(failure.error_file_data) if has_file else ""
    if not reported or _is_secondary(reported):
        # The reported rank may only have lost its peer. Prefer the earliest error file holding
        # a primary exception (single node: local rank == global rank).
        primary = [(mtime, r, _error_message(d)) for r, (mtime, d) in _error_files(log_dir).items()
                   if _error_message(d) and not _is_secondary(_error_message(d))]
        if primary:
            _, rank, reported = min(primary)
    # meshlm's own one-line reports
    for own in ("CollectiveFailure: ", "NonFiniteError: ", "OutOfMemory: "):
        if reported.startswith(own):
            return rank, _first_line(reported.removeprefix(own), 1000)
    if reported:
        return rank, f"worker rank {rank} failed: {_first_line(reported)}"
    if aborted:
        return rank, (f"worker rank {rank} aborted (SIGABRT: a collective timed out and the "
                      "watchdog ended the process)" + _last_collective(flight_dir, rank))
    return rank, f"worker rank {rank} exited with code {failure.exitcode}"


def launch_local(nprocs: int, fn: Callable[..., T], *args: Any, run_id: str | None = None,
                 quiet_ranks: bool = True, timeout_s: float = 300, max_restarts: int = 0,
                 flight_dir: str | None = None, hold: object | None = None) -> dict[int, T]:
    """Run ``fn(*args)`` in ``nprocs`` local workers after :func:`init_worker`; {rank: result}.

    ``fn`` must be a module-level function (workers import it by name) and its
    arguments and return value picklable. With ``quiet_ranks`` only rank 0 writes to the console;
    the other ranks' stdout/stderr go to per-rank files that are kept when a worker fails
    (``WorkerFailure.log_dir``). ``timeout_s`` is the collective timeout of the process group.
    When a worker fails, the group is stopped and, up to ``max_restarts`` times, started again
    (every rank, ``fn(*args)`` from the beginning); ``fn`` must make a restart useful, e.g. by
    resuming from a checkpoint. SIGTERM/SIGINT to this process are relayed to the workers
    (meshlm's trainer then stops gracefully); a repeated one that ends them raises
    KeyboardInterrupt. ``flight_dir``: where the workers' flight records are (a dead rank's
    last collective joins the message). On a machine with CUDA, more ranks than GPUs is a
    :class:`DeviceError` before any worker starts. ``hold``: a lock every worker holds for its
    life (:meth:`meshlm.run_lock.DirLock.handle`). Workers end when this process ends, even
    by ``kill -9`` (:func:`end_with_launcher`).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    refuse_local_ranks(nprocs)  # (CUDA: one GPU per rank, before any worker starts)
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if "<" in getattr(fn, "__qualname__", "<"):
        # Lambdas and nested functions cannot be pickled by name; fail here, not in the agent.
        raise TypeError(f"launch_local needs a module-level function, got {fn!r}")
    log_dir = tempfile.mkdtemp(prefix="meshlm_launch_")
    if quiet_ranks:
        # Redirecting ranks 1.. to files keeps their output for post-mortems; the filter alone
        # would send it to /dev/null. Rank 0 is neither redirected nor filtered: console.
        logs = DefaultLogsSpecs(log_dir=log_dir, redirects={r: Std.ALL for r in range(1, nprocs)},
                                local_ranks_filter={0})
    else:
        logs = DefaultLogsSpecs(log_dir=log_dir)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs,
        rdzv_backend="c10d", rdzv_endpoint=f"localhost:{free_port()}",
        run_id=run_id or f"meshlm-{uuid.uuid4().hex[:12]}",
        max_restarts=max_restarts,  # a failed worker stops the others; then restart or end
        monitor_interval=_MONITOR_INTERVAL_S, start_method=_start_method(), logs_specs=logs,
        shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        signals_to_handle="SIGHUP,SIGQUIT",  # SIGTERM/SIGINT: relayed (graceful stop)
    )
    relay = _SignalRelay(log_dir)
    ensure_server(forkserver_context(LAUNCH_PRELOAD))  # (started already by meshlm train)
    # OMP_NUM_THREADS=1: each worker's OpenMP pool would otherwise claim every core.
    env = {"OMP_NUM_THREADS": "1", _SOURCE_VAR: "local", _LAUNCH_DIR_VAR: log_dir,
           _LAUNCHER_PID_VAR: str(os.getpid()),
           **(nccl_flight_env(flight_dir) if flight_dir else {})}
    if max_restarts:
        # The agent's store, shared with the workers by default, keeps the process group keys
        # of the failed attempt, and the restarted workers read the dead ranks' addresses
        # (pytorch/pytorch#135712). Unshared, worker rank 0 hosts a new store each attempt.
        env[_UNSHARED_STORE_VAR] = "1"
    try:
        with (_patched_env(env), _quiet_agent_logs(), _kept_signal_handlers(), relay.installed(),
              _short_failure_shutdown()):
            results = elastic_launch(config, _worker_main)(CallerStdio(), hold, fn, timeout_s,
                                                           dict(os.environ), *args)
    except ChildFailedError as err:
        if relay.repeated:  # the user asked twice: the workers stopped at once
            shutil.rmtree(log_dir, ignore_errors=True)
            raise KeyboardInterrupt from None
        rank, message = _summarise(err, log_dir, flight_dir)
        if max_restarts:
            done = _last_attempt(log_dir)
            message += f" (the worker group was restarted {done} time{'s' * (done != 1)})"
        details = f"{err}\nper-rank logs: {log_dir}"
        raise WorkerFailure(message, rank, details=details, log_dir=log_dir) from None
    except SignalException as err:
        shutil.rmtree(log_dir, ignore_errors=True)
        # The agent turns Ctrl-C into its own exception (after stopping the workers); callers
        # expect the usual KeyboardInterrupt.
        if err.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise
    except BaseException:
        shutil.rmtree(log_dir, ignore_errors=True)
        raise
    shutil.rmtree(log_dir, ignore_errors=True)
    return dict(sorted(results.items()))
