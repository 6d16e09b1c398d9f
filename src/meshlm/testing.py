"""Test helpers: parity checks of a layout against the single-process reference, training
runs as spawned-world bodies, and ``run_world`` (from :mod:`meshlm.distributed.spawn`).

Weights are compared per tensor by the relative norm of the difference,
``||a - b|| / ||b||``. Element-wise relative error is the wrong measure after a few AdamW steps:
an element whose gradient is a near-cancelling sum has a large relative rounding error under
any change of summation order (micro-batching, a reduce-scatter), and Adam's normalised update
``m / sqrt(v)`` turns that into an absolute weight difference of up to ``lr * rel_error`` on that
one element, while the tensor as a whole agrees to ~1e-7.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping

import torch

from .distributed.spawn import run_world

# How long a test waits for a command or a spawned world before calling it hung. A guard against
# hangs, never a speed requirement: on a loaded 2-core machine a command runs several times
# slower than on an idle one. MESHLM_TEST_HANG_GUARD_S changes it.
HANG_GUARD_S = float(os.environ.get("MESHLM_TEST_HANG_GUARD_S", "1800"))

__all__ = ["HANG_GUARD_S", "assert_weights_close", "command_env", "final_weights", "max_relative_difference",
           "relative_difference", "run_cli", "run_world", "train_runs"]


def command_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a ``meshlm`` command a test runs: no injected faults
    and no world of its own (torchrun / SLURM variables dropped), one thread per worker."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MESHLM_FAULT", "TORCHELASTIC_", "RANK", "WORLD_SIZE",
                                "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", **(extra or {}))
    return env


def run_cli(argv: list[str], extra: Mapping[str, str] | None = None, *,
            environ: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
            merge_stderr: bool = False) -> subprocess.CompletedProcess:
    """``meshlm ARGV`` run in this process, as a command a test runs (:func:`command_env`'s
    environment plus ``extra``, or exactly ``environ``; in ``cwd``; stdout and stderr captured
    -- as one stream, in the order written, with ``merge_stderr`` -- exit status returned): its
    local workers fork from this process's forkserver, which has torch and meshlm imported,
    instead of a new launcher and server importing them (seconds per command). The
    environment, the folder and the descriptors 1 and 2 are restored afterwards."""
    import sys
    import tempfile

    from .cli import main

    env = dict(environ) if environ is not None else command_env(extra)
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    out = [tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")]
    out.append(out[0] if merge_stderr else
               tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace"))
    saved_streams = (sys.stdout, sys.stderr)
    for stream in saved_streams:
        stream.flush()
    saved_fds = [os.dup(1), os.dup(2)]
    try:
        os.environ.clear()
        os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        os.dup2(out[0].fileno(), 1)  # (what its workers write: they take this process's 1, 2)
        os.dup2(out[1].fileno(), 2)
        sys.stdout, sys.stderr = out
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's own errors
            code = e.code if isinstance(e.code, int) else 1
    finally:
        for f in out:
            f.flush()
        sys.stdout, sys.stderr = saved_streams
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    texts = []
    for f in dict.fromkeys(out):  # (one file when merged)
        f.seek(0)
        texts.append(f.read())
        f.close()
    return subprocess.CompletedProcess(["meshlm", *argv], code, texts[0],
                                       "" if merge_stderr else texts[1])


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (0 when both are zero)."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    denom = b64.norm().item()
    diff = (a64 - b64).norm().item()
    return diff if denom == 0 else diff / denom


def max_relative_difference(
    got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]
) -> tuple[float, str]:
    """Largest per-tensor relative difference and its name; names must match exactly."""
    if set(got) != set(ref):
        raise AssertionError(f"parameter names differ: {sorted(set(got) ^ set(ref))[:5]}")
    worst, worst_name = 0.0, ""
    for name, r in ref.items():
        if got[name].shape != r.shape:
            raise AssertionError(f"{name}: shape {tuple(got[name].shape)} != {tuple(r.shape)}")
        d = relative_difference(got[name], r)
        if d > worst:
            worst, worst_name = d, name
    return worst, worst_name


def assert_weights_close(
    got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], rel: float = 1e-5
) -> None:
    worst, name = max_relative_difference(got, ref)
    if worst >= rel:
        raise AssertionError(f"{name}: relative difference {worst:.3e} >= {rel:.0e}")


# ---------------------------------------------------------------------- training runs
def train_runs(base: list[str], runs: list[list[str]]) -> list[dict[int, float]]:
    """Train ``base + run`` for each run in turn (works as a spawned-world body); losses."""
    from .config import load_config
    from .train.trainer import train

    return [train(load_config(None, base + r), log=lambda _m: None, progress=False).losses
            for r in runs]


def final_weights(run_dir) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Full weights of the latest checkpoint of a run directory (read from its shards)."""
    from .checkpoint.loading import load_model

    return {n: p.detach() for n, p in load_model(run_dir).named_parameters()}


def cli(argv: list[str], capsys) -> tuple[int, list[str]]:  # noqa: ANN001
    """(exit status, stderr lines) of ``meshlm argv`` run in this process (``capsys``: pytest's
    capture fixture)."""
    from .cli import main

    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    return rc, capsys.readouterr().err.strip().splitlines()
