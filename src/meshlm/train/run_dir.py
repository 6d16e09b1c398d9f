"""The run directory: chosen once, never overwritten, and the files that describe the run.

``resolve_run_dir`` picks the directory (default ``runs/<preset>-<timestamp>``) and checks it
against ``run.resume``: ``false`` needs an empty (or new) directory; ``true`` needs a complete
checkpoint in it; ``auto`` resumes when there is one and otherwise starts at step 0, also over
the files of a run that died before its first checkpoint. Resuming, or starting over such
files, needs a compatible ``config.toml`` (same model, data, seed and global batch). In a worker
group that torch's elastic agent restarted (``TORCHELASTIC_RESTART_COUNT`` > 0, under torchrun or
meshlm's launcher) ``false`` is read as ``auto``, so the new group continues from the latest
checkpoint of the run the first group started.

``claim_run_dir`` makes the directory one run's for the run's whole life (a lock held by the
launching process and its workers, :mod:`meshlm.run_lock`): a second ``meshlm train`` into it is
refused before it writes anything, and the lock of a run that died is free again. The lock file
(``.meshlm.lock``) does not count as a file of the directory in the checks above.

``agree_run_dir`` does that on rank 0 and broadcasts the choice (or the error) to every rank, so
ranks that parsed the config themselves under torchrun agree on one directory and on whether to
resume. ``write_run_files`` writes ``config.toml``, ``tokenizer.json`` and ``env.json``
(versions, git commit, layout). Communication: at start-up, one all-reduce (the largest restart
count) and one object broadcast. Memory: none to speak of; the checks read ``config.toml`` and
look through ``checkpoints/``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import latest_valid
from ..config import Config, ConfigError, _unwritable_dir, load_config, to_toml
from ..data.tokenizer import Tokenizer
from ..distributed.comm import Comm
from ..run_lock import DirLock, claim
from ..run_lock import contents as lock_contents
from ..version import __version__

Log = Callable[[str], None]

# Set by torch's elastic agent in every worker: how many times the worker group was restarted.
RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """How many times the elastic agent restarted this worker group (0: the first start)."""
    try:
        return max(0, int(env.get(RESTART_COUNT_VAR, "") or 0))
    except ValueError:
        return 0


def effective_resume(cfg: Config, log: Log = print, restarts: int | None = None) -> str:
    """``run.resume`` as this process applies it: ``false`` reads as ``auto`` after a restart
    (``restarts``: the group's restart count; None -> :func:`restart_count` of this process)."""
    mode = cfg.run.resume
    restarts = restart_count() if restarts is None else restarts
    if mode == "false" and restarts > 0:
        log(f"run.resume=false read as auto: the worker group was restarted ({restarts}), "
            "so it continues from the latest checkpoint of the run, if there is one")
        return "auto"
    return mode


def _latest_checkpoint(run_dir: Path, log: Log) -> Path | None:
    """The newest complete, valid checkpoint of the run (damaged ones are skipped and logged)."""
    root = run_dir / "checkpoints"
    return latest_valid(root, log=log) if root.is_dir() else None


def _holds_files(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds anything but its lock file (a file in its place: one line)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir={str(run_dir)!r} is a file, not a directory")
    return run_dir.is_dir() and bool(lock_contents(run_dir))


def name_run_dir(cfg: Config, log: Log = print, restarts: int | None = None) -> Path:
    """The run directory: ``run.dir``, or ``runs/<preset>-<timestamp>`` when it was left empty
    (a new name at each call: :func:`with_run_dir` fixes one into a config). ``restarts`` as
    in :func:`effective_resume`."""
    restarts = restart_count() if restarts is None else restarts
    if cfg.run.dir:
        return Path(cfg.run.dir).expanduser()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    named = Path("runs") / f"{cfg.model.preset}-{stamp}"
    if restarts > 0:
        log(f"run.dir is not set: the restarted worker group starts a new run in {named}"
            " (set run.dir to continue the same run after a restart)")
    return named


def with_run_dir(cfg: Config, log: Log = print) -> Config:
    """``cfg``, or a copy naming the run directory when ``run.dir`` was left empty, so that
    every later check, the lock and the workers speak of one directory."""
    if cfg.run.dir:
        return cfg
    return cfg.derive({"run.dir": str(name_run_dir(cfg, log))})


def _check_writable(run_dir: Path) -> None:
    """ConfigError when ``run_dir`` is a file or it, or its checkpoints folder, cannot be
    written (a save must not fail mid-run)."""
    _holds_files(run_dir)  # (a file in its place: one line)
    for folder in (run_dir, run_dir / "checkpoints"):
        problem = _unwritable_dir(folder) if folder.exists() or folder == run_dir else None
        if problem:
            raise ConfigError(f"run.dir={str(run_dir)!r}: {str(folder)!r} {problem}; make it "
                              "writable or choose another run.dir")


def claim_run_dir(cfg: Config, log: Log = print) -> DirLock:
    """Claim the run directory (named first when ``run.dir`` is empty) for this process and the
    workers it starts, for the run's whole life (:mod:`meshlm.run_lock`): before anything is
    written into it, :class:`~meshlm.run_lock.DirInUse` when another run holds it."""
    run_dir = name_run_dir(cfg, log)
    _check_writable(run_dir)
    return claim(run_dir, "run.dir", "--run.dir", "meshlm train")


def plan_run_dir(cfg: Config, log: Log = print, restarts: int | None = None
                 ) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume from or None to start at step 0); see the module
    docstring for the rules (``run.dir`` left empty: a new name, see :func:`name_run_dir`);
    raises ConfigError when the directory cannot be used. ``restarts`` as in :func:`effective_resume`."""
    restarts = restart_count() if restarts is None else restarts
    run_dir = name_run_dir(cfg, log, restarts)
    _check_writable(run_dir)
    mode = effective_resume(cfg, log, restarts)
    if mode == "false":
        if _holds_files(run_dir):
            raise ConfigError(
                f"run.dir={str(run_dir)!r} already holds files; pass --run.resume=true (or auto) "
                "to continue that run or choose another run.dir"
            )
        return run_dir, None
    latest = _latest_checkpoint(run_dir, log)
    if latest is not None:
        check_resume_compatible(cfg, run_dir)
        return run_dir, latest
    if mode == "true":
        raise ConfigError(f"run.resume=true but {run_dir} holds no complete checkpoint to resume "
                          "from (run.resume=auto starts at step 0 then)")
    if _holds_files(run_dir):
        if not (run_dir / "config.toml").is_file():
            raise ConfigError(f"run.resume=auto: {run_dir} holds files but no config.toml, so it "
                              "is not a meshlm run; choose another run.dir")
        check_resume_compatible(cfg, run_dir)
        log(f"run.resume=auto: {run_dir} holds no complete checkpoint; starting at step 0")
    return run_dir, None


def resolve_run_dir(cfg: Config, log: Log = print) -> Path:
    """The run directory, checked against ``run.resume`` (see :func:`plan_run_dir`)."""
    return plan_run_dir(cfg, log)[0]


def check_resume_compatible(cfg: Config, run_dir: Path) -> None:
    """The saved run must have the same model, data order and batch as the new config.

    A directory without ``config.toml`` has nothing to compare with and passes.
    """
    path = run_dir / "config.toml"
    if not path.is_file():
        return
    saved = load_config(path, check_paths=False)
    for key in ("model", "data"):
        old, new = getattr(saved, key), getattr(cfg, key)
        if old != new:
            diff = [f"{key}.{name}: saved {getattr(old, name)!r}, now {getattr(new, name)!r}"
                    for name in vars(old) if getattr(old, name) != getattr(new, name)]
            raise ConfigError(f"run.resume: [{key}] differs from the saved config of {run_dir} "
                              f"({'; '.join(diff)})")
    for key in ("seed", "global_batch"):
        if getattr(saved.train, key) != getattr(cfg.train, key):
            raise ConfigError(
                f"run.resume: train.{key}={getattr(cfg.train, key)} differs from the saved "
                f"{getattr(saved.train, key)}"
            )


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict[str, Any]:
    return {
        "meshlm": __version__, "git_commit": git_commit(), "torch": torch.__version__,
        "python": platform.python_version(), "host": platform.node(),
        "threads": torch.get_num_threads(), "started": datetime.now().isoformat(timespec="seconds"),
    }


def agree_run_dir(cfg: Config, comm: Comm, log: Log = print) -> tuple[Config, Path]:
    """Rank 0 checks the run dir and decides whether to resume; every rank gets both, as a
    copy of ``cfg`` (``cfg`` itself is left as it is) and the directory.

    In the copy ``run.resume`` is the decision on every rank: ``"true"`` when the run
    continues from the latest checkpoint in ``run.dir``, ``"false"`` when it starts at step 0.
    The restart count is the largest of all ranks' (on several nodes, only the agent whose
    workers failed counts a restart; the others restart theirs as a change of membership).
    """
    error, mode, run_dir = "", cfg.run.resume, cfg.run.dir
    restarts = int(comm.max_scalar(float(restart_count())))
    if comm.mesh.is_logging_rank:
        try:
            folder, checkpoint = plan_run_dir(cfg, log, restarts)
            run_dir = run_dir or str(folder)
            mode = "false" if checkpoint is None else "true"
        except ConfigError as e:
            error = str(e)
    run_dir, mode, error = comm.broadcast_object([run_dir, mode, error])
    if error:
        raise ConfigError(error)
    return cfg.derive({"run.dir": run_dir, "run.resume": mode}), Path(run_dir).expanduser()


def write_run_files(run_dir: Path, cfg: Config, tokenizer: Tokenizer, extra: dict[str, Any]
                    ) -> None:
    """``config.toml`` (resolved), ``tokenizer.json`` and ``env.json`` (+ ``extra``)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run.dir={str(run_dir)!r} cannot be created: {e.strerror}") from None
    (run_dir / "config.toml").write_text(to_toml(cfg))
    tokenizer.save(run_dir / "tokenizer.json")
    (run_dir / "env.json").write_text(json.dumps(environment() | extra, indent=1))
