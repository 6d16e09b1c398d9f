"""Which distributed world this process is in: torchrun's, SLURM's, or none (a laptop).

:func:`detect_external_world` reads the launcher's environment variables (torchrun's win over
SLURM's; one SLURM task is no world), :func:`export_env` writes a world as torch's variables for
``init_process_group("env://")``, :func:`expand_nodelist` reads SLURM host lists. No torch here:
the command line decides where to run before anything imports it.
No communication, no memory.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from .config import ConfigError

# Marks a world that a meshlm launcher set up, so detection keeps reporting where it came from
# after the env vars have been rewritten into torch's names (launch_local workers carry
# torchrun's variables; SLURM workers get them from export_env).
_SOURCE_VAR = "MESHLM_WORLD_SOURCE"
_SOURCES = ("torchrun", "slurm", "local")

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")


@dataclass(frozen=True)
class WorldInfo:
    """Where this process sits in the distributed world, and who told us."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "local"




def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; another process could take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _expand_range(body: str) -> list[str]:
    """``"01-03,07"`` -> ``["01", "02", "03", "07"]``, keeping zero padding."""
    out: list[str] = []
    for part in body.split(","):
        lo, sep, hi = part.partition("-")
        if not sep:
            out.append(lo)
            continue
        width = len(lo)
        out.extend(f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
    return out


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas that are not inside brackets: ``"a[1-2],b3"`` -> ``["a[1-2]", "b3"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced brackets in nodelist {nodelist!r}")
        elif ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced brackets in nodelist {nodelist!r}")
    parts.append(nodelist[start:])
    return [p for p in parts if p]


_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist: ``"node[01-02,07],gpu-b3"`` -> ``node01 node02 node07 gpu-b3``.

    Handles the common forms (ranges, lists, several bracket groups in one name). For anything
    this parser rejects it asks ``scontrol show hostnames``, when scontrol is installed.
    """
    try:
        hosts: list[str] = []
        for pattern in _split_top_level(nodelist.strip()):
            names = [""]
            pos = 0
            for m in _BRACKET.finditer(pattern):
                prefix = pattern[pos:m.start()]
                names = [n + prefix + v for n in names for v in _expand_range(m.group(1))]
                pos = m.end()
            tail = pattern[pos:]
            if "[" in tail or "]" in tail:
                raise ValueError(f"cannot parse nodelist {nodelist!r}")
            hosts.extend(n + tail for n in names)
        if not hosts:
            raise ValueError(f"empty nodelist {nodelist!r}")
        return hosts
    except ValueError:
        if shutil.which("scontrol") is None:
            raise
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                             capture_output=True, text=True, timeout=30).stdout
        return out.split()


def _tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed per-node task counts: ``"4(x2),3"`` -> ``[4, 4, 3]``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"cannot parse SLURM tasks-per-node {spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _slurm_world(env: Mapping[str, str]) -> WorldInfo | None:
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    world_size = int(env["SLURM_NTASKS"])
    if world_size <= 1:
        # A single task (e.g. `salloc` then `meshlm train`) is a laptop: meshlm starts local
        # workers itself instead of forming a world of one.
        return None
    rank = int(env["SLURM_PROCID"])
    local_rank = int(env.get("SLURM_LOCALID", "0"))
    spec = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec:
        counts = _tasks_per_node(spec)
        node = int(env.get("SLURM_NODEID", "0"))
        local_world_size = counts[min(node, len(counts) - 1)]
    else:
        local_world_size = max(1, world_size // int(env.get("SLURM_NNODES", "1")))
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    master_addr = env.get("MASTER_ADDR") or (expand_nodelist(nodelist)[0] if nodelist else "")
    if not master_addr:
        raise ValueError("SLURM world without SLURM_JOB_NODELIST/SLURM_NODELIST or MASTER_ADDR")
    if env.get("MASTER_PORT"):
        master_port = int(env["MASTER_PORT"])
    else:
        # Every task of the job must agree on the port without talking to each other, so derive
        # it from the job id; the range stays clear of the ephemeral ports (32768+).
        master_port = 20000 + int(env.get("SLURM_JOB_ID", "9500")) % 20000
    return WorldInfo(rank, world_size, local_rank, local_world_size, master_addr, master_port,
                     "slurm")


def detect_external_world(env: Mapping[str, str] = os.environ) -> WorldInfo | None:
    """The world a launcher already set up for this process, or None when there is none.

    torchrun's variables win over SLURM's (torchrun inside an srun step sets both, and its own
    are the ones describing this process). SLURM counts only with more than one task.
    """
    if env.get("RANK") and env.get("WORLD_SIZE") and not all(env.get(k) for k in _TORCHRUN_VARS):
        missing = [k for k in _TORCHRUN_VARS if not env.get(k)]
        raise ConfigError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} are not: "
                          "launch with torchrun (or set them all) rather than guess the world")
    if all(env.get(k) for k in _TORCHRUN_VARS):
        source = env.get(_SOURCE_VAR, "torchrun")
        return WorldInfo(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]), local_world_size=int(env["LOCAL_WORLD_SIZE"]),
            master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]),
            source=source if source in _SOURCES else "torchrun",
        )
    return _slurm_world(env)


def export_env(info: WorldInfo, env: MutableMapping[str, str] = os.environ) -> None:
    """Write ``info`` as torch's env vars so ``init_process_group("env://")`` finds the world."""
    env.update({
        "RANK": str(info.rank), "WORLD_SIZE": str(info.world_size),
        "LOCAL_RANK": str(info.local_rank), "LOCAL_WORLD_SIZE": str(info.local_world_size),
        "MASTER_ADDR": info.master_addr, "MASTER_PORT": str(info.master_port),
        _SOURCE_VAR: info.source,
    })
