"""Multi-node on one machine: the README's multi-node lines, run as written, match one process.

Two torchrun "nodes" on loopback (c10d rendezvous, 2 x 2 workers, dp=2 x tp=2) and the same
layout as a SLURM job (4 tasks on 2 "nodes", the SLURM variables set here; srun not needed) each
train a tiny model for a few steps; their per-step losses in ``run.dir/metrics.jsonl`` must equal
the one-process run's (``--parallel.dp=1 --parallel.tp=1``, same global batch) to rel < 1e-5.

The commands come from README.md between the ``<!-- multinode-torchrun -->`` and
``<!-- multinode-slurm -->`` markers and must read exactly as pinned below: a change to those
lines fails here until this test runs the new ones. The only changes made to run them on one
machine: ``HEAD_NODE=127.0.0.1``, a free port for 29500, and tiny sizes appended (keys the
lines do not set).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from meshlm.launch import free_port
from meshlm.testing import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent

# What README.md shows between the markers (shell lines, comments and continuations joined).
TORCHRUN_LINE = (
    "torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d "
    "--rdzv-endpoint=$HEAD_NODE:29500 --rdzv-id=mn2x2 -m meshlm.cli train --parallel.dp=2 "
    "--parallel.tp=2 --run.dir=runs/mn2x2"
)
SLURM_LINE = "srun .venv/bin/meshlm train --parallel.dp=2 --parallel.tp=2 --run.dir=runs/mn2x2-slurm"
SBATCH = "#SBATCH --nodes=2 --ntasks-per-node=2 --gpus-per-node=2"

STEPS = 4
SIZES = ["--model.preset=tiny", f"--train.steps={STEPS}", "--data.seq_len=32",
         "--run.sample_tokens=0", "--train.eval_every=0", "--precision.dtype=fp32",
         "--train.log_every=1"]
TIMEOUT_S = HANG_GUARD_S  # per launch; a hang (e.g. a rendezvous that never completes) fails

# A parent's world must not leak into the "nodes": they find their world from these alone.
_WORLD_VARS = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|"
                         r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|MESHLM_.*|SLURM_.*|PMI_.*|"
                         r"OMPI_.*)$")


def section(marker: str) -> tuple[list[str], list[str]]:
    """(commands, comment lines) of the bash block between ``<!-- marker -->`` and its end."""
    text = README.read_text()
    m = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)```\s*<!-- /{marker} -->", text, re.S)
    assert m, f"README.md has no ```bash block between <!-- {marker} --> and <!-- /{marker} -->"
    body = m.group(1).replace("\\\n", " ")
    lines = [" ".join(ln.split()) for ln in body.splitlines() if ln.strip()]
    return ([ln for ln in lines if not ln.startswith("#")],
            [ln for ln in lines if ln.startswith("#")])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _WORLD_VARS.match(k)}
    env.update(OMP_NUM_THREADS="1", PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
               PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A stand-in for the repository checkout the README's lines are run from (.venv linked);
    the data cache is shared with the session's other tests through XDG_CACHE_HOME."""
    root = tmp_path_factory.mktemp("multinode")
    (root / ".venv").symlink_to(VENV_BIN.parent)
    return root


def _tail(text: str, n: int = 2500) -> str:
    return text[-n:]


def run_together(cmds: list[tuple[str, dict[str, str]]], cwd: Path) -> list[str]:
    """Start every ``(bash line, env)`` at once, each in its own process group; wait for all
    (at most TIMEOUT_S); on a failure or timeout kill every group and show each one's tail."""
    procs, logs = [], []
    for line, env in cmds:
        log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed below)
        logs.append(log)
        procs.append(subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT_S
    failed = None
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            failed = f"timed out after {TIMEOUT_S}s"
            break
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(3)  # let the others report why before they are stopped
            failed = "a process failed"
            break
        time.sleep(0.2)
    if failed is None and any(p.returncode != 0 for p in procs):
        failed = "a process failed"
    for p in procs:  # each group, also what outlived its leader (e.g. workers of a failure)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if failed:
        report = "\n".join(
            f"--- [{i}] exit {p.returncode}: {line}\n{_tail(out)}"
            for i, ((line, _), p, out) in enumerate(zip(cmds, procs, outputs, strict=True)))
        pytest.fail(f"{failed}:\n{report}")
    return outputs


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
               if ln.strip()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), steps
    return [float(r["loss"]) for r in steps]


@pytest.fixture(scope="module")
def reference(workdir: Path, cache_dir: Path) -> list[float]:
    """The one-process losses of the same config (and it builds the shared data cache)."""
    line = " ".join(["meshlm train --parallel.dp=1 --parallel.tp=1 --run.dir=runs/ref", *SIZES])
    (out,) = run_together([(line, clean_env(XDG_CACHE_HOME=str(cache_dir)))], workdir)
    assert "world 1 (pp=1 dp=1 cp=1 tp=1)" in out, out
    ref = losses(workdir / "runs/ref")
    assert all(math.isfinite(x) for x in ref) and ref[-1] < ref[0], ref
    return ref


def assert_same_losses(got: list[float], ref: list[float]) -> None:
    assert len(got) == len(ref), (got, ref)
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True))
    assert rel < 1e-5, f"losses {got} differ from the one-process {ref} (max rel {rel:.2e})"


def test_readme_multinode_lines_are_the_tested_ones() -> None:
    torchrun_cmds, _ = section("multinode-torchrun")
    assert torchrun_cmds == [TORCHRUN_LINE], torchrun_cmds
    slurm_cmds, comments = section("multinode-slurm")
    assert slurm_cmds == [SLURM_LINE], slurm_cmds
    assert SBATCH in comments, comments  # 2 nodes x 2 tasks: the world the test sets up
    text = " ".join(comments)
    for var in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
                "SLURM_TASKS_PER_NODE", "SLURM_JOB_NODELIST", "20000 + SLURM_JOB_ID % 20000"):
        assert var in text, f"README's SLURM block no longer mentions {var}"
    assert "filesystem every node sees" in README.read_text()


def test_two_torchrun_nodes_on_loopback(workdir: Path, cache_dir: Path,
                                        reference: list[float]) -> None:
    (line,) = section("multinode-torchrun")[0]
    port = free_port()
    line = line.replace("torchrun ", f"{VENV_BIN / 'torchrun'} ", 1)
    line = line.replace(":29500", f":{port}") + " " + " ".join(SIZES)
    env = clean_env(HEAD_NODE="127.0.0.1", XDG_CACHE_HOME=str(cache_dir))
    outs = run_together([(line, env), (line, env)], workdir)
    log = "\n".join(outs)
    assert "world 4 (pp=1 dp=2 cp=1 tp=2)" in log, _tail(log)
    assert_same_losses(losses(workdir / "runs/mn2x2"), reference)
    shards = sorted(p.name for p in (workdir / "runs/mn2x2/checkpoints").glob("step_*/rank_*"))
    assert len(shards) == 4, shards  # every rank of both nodes wrote into the shared run dir


def _slurm_job_id() -> int:
    """A job id whose derived port (20000 + id % 20000, as the README says) is free now."""
    rng = random.Random()
    for _ in range(200):
        job_id = rng.randrange(1_000_000, 9_000_000)
        port = 20000 + job_id % 20000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job_id
    pytest.skip("no free port in 20000-39999")


def test_slurm_style_world(workdir: Path, cache_dir: Path, reference: list[float]) -> None:
    (line,) = section("multinode-slurm")[0]
    assert line.startswith("srun ")
    task = line.removeprefix("srun ") + " " + " ".join(SIZES)  # what srun starts on every task
    job_id = _slurm_job_id()
    cmds = []
    for rank in range(4):  # 2 nodes x 2 tasks, as #SBATCH asks; block distribution
        node, local = divmod(rank, 2)
        cmds.append((task, clean_env(
            SLURM_PROCID=str(rank), SLURM_NTASKS="4", SLURM_LOCALID=str(local),
            SLURM_NNODES="2", SLURM_NODEID=str(node), SLURM_TASKS_PER_NODE="2(x2)",
            SLURM_JOB_NODELIST="127.0.0.1", SLURM_JOB_ID=str(job_id),
            XDG_CACHE_HOME=str(cache_dir))))
    outs = run_together(cmds, workdir)
    assert "world 4 (pp=1 dp=2 cp=1 tp=2)" in outs[0], _tail(outs[0])
    assert_same_losses(losses(workdir / "runs/mn2x2-slurm"), reference)
