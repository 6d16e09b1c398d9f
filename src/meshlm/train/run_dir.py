"""The run directory: chosen once, never overwritten, and the files that describe the run.

``resolve_run_dir`` picks the directory (default ``runs/<preset>-<timestamp>``) and refuses a
non-empty one unless resuming; ``agree_run_dir`` does that on rank 0 and broadcasts the choice
(or the error) to every rank, so ranks that parsed the config themselves under torchrun agree
on one directory. ``write_run_files`` writes ``config.toml``, ``tokenizer.json`` and
``env.json`` (versions, git commit, layout). Communication: one object broadcast at start-up.
"""

from __future__ import annotations

import json
import platform
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..checkpoint.state import find_latest
from ..config import Config, ConfigError, load_config, to_toml
from ..data.tokenizer import Tokenizer
from ..distributed.comm import Comm


def resolve_run_dir(cfg: Config) -> Path:
    """The run directory; refuses to reuse a non-empty one unless resuming."""
    if not cfg.run.dir:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.run.dir = str(Path("runs") / f"{cfg.model.preset}-{stamp}")
    run_dir = Path(cfg.run.dir).expanduser()
    if cfg.run.resume:
        if find_latest(run_dir / "checkpoints") is None:
            raise ConfigError(f"run.resume=true but {run_dir} holds no checkpoint to resume from")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            f"run.dir={str(run_dir)!r} already holds files; pass --run.resume=true to continue "
            "that run or choose another run.dir"
        )
    return run_dir


def check_resume_compatible(cfg: Config, run_dir: Path) -> None:
    """The saved run must have the same model, data order and batch as the new config."""
    saved = load_config(run_dir / "config.toml", check_paths=False)
    for key in ("model", "data"):
        if getattr(saved, key) != getattr(cfg, key):
            raise ConfigError(f"run.resume: [{key}] differs from the saved config of {run_dir}")
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


def agree_run_dir(cfg: Config, comm: Comm) -> Path:
    """Rank 0 checks the run dir (and a resumed run's config); every rank gets its path."""
    error = ""
    if comm.mesh.is_logging_rank:
        try:
            run_dir = resolve_run_dir(cfg)
            if cfg.run.resume:
                check_resume_compatible(cfg, run_dir)
        except ConfigError as e:
            error = str(e)
    cfg.run.dir, error = comm.broadcast_object([cfg.run.dir, error])
    if error:
        raise ConfigError(error)
    return Path(cfg.run.dir).expanduser()


def write_run_files(run_dir: Path, cfg: Config, tokenizer: Tokenizer, extra: dict[str, Any]
                    ) -> None:
    """``config.toml`` (resolved), ``tokenizer.json`` and ``env.json`` (+ ``extra``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    tokenizer.save(run_dir / "tokenizer.json")
    (run_dir / "env.json").write_text(json.dumps(environment() | extra, indent=1))
