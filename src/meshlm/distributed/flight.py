"""Flight recorder: each rank's last collectives, readable after the rank froze or died.

Every collective :class:`~meshlm.distributed.comm.Comm` issues is one fixed-size record (its
sequence number on this rank and on its axis, op, axis, bytes, when it was entered and when it
completed) in a ring of ``distributed.flight_records`` slots. The ring lives in a shared
memory-mapped file, ``run.dir/flight/rank_NNNNN.ring``: writing a record is a few stores to
memory, and the page cache keeps them when the process is stopped (SIGSTOP) or killed
(SIGKILL), so the surviving ranks and the launcher read a frozen or dead rank's last
collectives too. torch's own Flight Recorder covers NCCL only; this one covers every backend.

On a timeout or a lost peer a rank writes its ring as ``rank_NNNNN.json`` (:meth:`dump`) and
:func:`diagnose` names the laggard: a rank that is stopped or gone (same host: ``/proc``), else
the end of the chain "rank a waits in collective #s of axis x, which rank b has not reached",
else the rank whose last collective is the oldest -- with its mesh coordinates and the last
collective it entered.

Communication: none. Memory: 64 bytes per slot per rank, plus one small JSON file per rank.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..layout import AXES as LAYOUT_AXES
from .mesh import AXIS_NAMES

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv",
       "barrier", "broadcast_object")
# axes a record can name (index = code); "world" covers barriers and object broadcasts
AXES = AXIS_NAMES

RECORD = np.dtype([("seq", "<i8"), ("axis_seq", "<i8"), ("bytes", "<i8"), ("t_enter", "<f8"),
                   ("t_done", "<f8"), ("op", "<i2"), ("axis", "<i2"), ("async_op", "<i2"),
                   ("pad", "<i2"), ("pad2", "<i8"), ("pad3", "<i8")])
assert RECORD.itemsize == 64
# slot 0 is the header: seq = records written so far; axis_seq[i] lives in slots 1..len(AXES)
_HEADER = 1 + len(AXES)

# messages of a collective that gave up on a peer (gloo, NCCL, the c10d store)
_COMM_MARKERS = ("Timed out", "timed out", "closed by peer", "reset by peer", "Broken pipe",
                 "Connection refused", "remote worker crashing", "NCCL communicator was aborted",
                 "Watchdog caught collective operation timeout")
_COMM_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost its peer; the message names the laggard (one line)."""


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that timed out or lost a peer (not a bug of its own)."""
    text = f"{type(exc).__name__}: {exc}"
    return type(exc).__name__ in _COMM_TYPES or any(m in text for m in _COMM_MARKERS)


def ring_path(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank:05d}.ring"


class FlightRecorder:
    """This rank's ring of collective records (see the module docstring)."""

    def __init__(self, folder: Path, rank: int, world: int, slots: int,
                 coords: Mapping[str, int], groups: Mapping[str, list[int]]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.rank, self.slots = folder, rank, slots
        path = ring_path(folder, rank)
        size = (_HEADER + slots) * RECORD.itemsize
        with path.open("wb") as f:  # a fresh ring (a restart or resume starts its own)
            f.truncate(size)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._ring = np.frombuffer(self._map, dtype=RECORD)
        self._counts = np.zeros(len(AXES), dtype=np.int64)  # per-axis collectives so far
        self.seq = 0
        self._meta = {"rank": rank, "world": world, "slots": slots, "pid": os.getpid(),
                      "host": socket.gethostname(), "coords": dict(coords),
                      "groups": {a: list(r) for a, r in groups.items()}, "ops": OPS,
                      "axes": AXES, "started": time.time()}
        self._write_meta()

    def set_groups(self, groups: Mapping[str, list[int]]) -> None:
        """The world ranks of this rank's group on every axis, again (a group made after the
        recorder opened: the pipeline's embedding group)."""
        self._meta["groups"] = {a: list(r) for a, r in groups.items()}
        self._write_meta()

    def _write_meta(self) -> None:
        tmp = self.folder / f"rank_{self.rank:05d}.meta.json.tmp"
        tmp.write_text(json.dumps(self._meta))
        tmp.replace(self.folder / f"rank_{self.rank:05d}.meta.json")

    def enter(self, op: str, axis: str, nbytes: int, async_op: bool = False) -> int:
        """Record that this rank enters a collective; returns its slot (for :meth:`done`)."""
        a = AXES.index(axis) if axis in AXES else 0
        self.seq += 1
        self._counts[a] += 1
        slot = _HEADER + (self.seq - 1) % self.slots
        rec = self._ring[slot:slot + 1]
        rec["seq"], rec["axis_seq"], rec["bytes"] = self.seq, self._counts[a], nbytes
        rec["t_enter"], rec["t_done"] = time.time(), 0.0
        rec["op"], rec["axis"], rec["async_op"] = OPS.index(op), a, int(async_op)
        self._ring["seq"][0] = self.seq
        self._ring["axis_seq"][1 + a] = self._counts[a]
        return slot

    def done(self, slot: int, seq: int | None = None) -> None:
        """Record completion of the collective in ``slot`` (unless ``seq`` says the slot has
        been reused for a later one since)."""
        if seq is None or int(self._ring["seq"][slot]) == seq:
            self._ring["t_done"][slot] = time.time()

    def dump(self, reason: str) -> Path:
        """Write this rank's ring as ``rank_NNNNN.json`` (readable; oldest record first)."""
        data = read_ring(self.folder, self.rank)
        data["reason"] = reason
        data["dumped"] = time.time()
        out = self.folder / f"rank_{self.rank:05d}.json"
        out.write_text(json.dumps(data, indent=1))
        return out

    def close(self) -> None:
        self._ring = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass


def read_ring(folder: Path, rank: int) -> dict[str, Any]:
    """A rank's meta data and records (oldest first), read from its files; {} when absent."""
    meta_path = folder / f"rank_{rank:05d}.meta.json"
    path = ring_path(folder, rank)
    if not meta_path.is_file() or not path.is_file():
        return {}
    meta = json.loads(meta_path.read_text())
    raw = np.fromfile(path, dtype=RECORD)
    if len(raw) < _HEADER:
        return {}
    total = int(raw["seq"][0])
    counts = {AXES[i]: int(raw["axis_seq"][1 + i]) for i in range(len(AXES))}
    body = raw[_HEADER:]
    recs = sorted((r for r in body if r["seq"] > 0), key=lambda r: int(r["seq"]))
    meta.update(collectives=total, per_axis=counts, records=[{
        "seq": int(r["seq"]), "op": OPS[int(r["op"])], "axis": AXES[int(r["axis"])],
        "axis_seq": int(r["axis_seq"]), "bytes": int(r["bytes"]), "t_enter": float(r["t_enter"]),
        "t_done": float(r["t_done"]) or None, "async": bool(r["async_op"])} for r in recs])
    return meta


def _process_state(meta: Mapping[str, Any]) -> str | None:
    """"stopped", "gone" or None (running, or on another host: unknown)."""
    if meta.get("host") != socket.gethostname():
        return None
    pid = int(meta.get("pid", 0))
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    state = stat.rsplit(")", 1)[-1].split()[0]
    return "stopped" if state in ("T", "t") else ("gone" if state in ("Z", "X") else None)


def _gave_up(folder: Path, rank: int, meta: Mapping[str, Any]) -> bool:
    """Whether ``rank`` dumped its ring (:meth:`FlightRecorder.dump`: it gave up on a
    collective) in this run, i.e. after its ring was started."""
    try:
        dumped = json.loads((folder / f"rank_{rank:05d}.json").read_text()).get("dumped", 0.0)
    except (OSError, ValueError):
        return False
    return float(dumped) >= float(meta.get("started", 0.0))


def describe_record(r: Mapping[str, Any] | None) -> str:
    if r is None:
        return "none recorded"
    state = "completed" if r["t_done"] else ("issued" if r["async"] else "not completed")
    return f"{r['op']}[{r['axis']}] #{r['axis_seq']} ({state})"


def coords_text(meta: Mapping[str, Any]) -> str:
    c = meta.get("coords", {})
    return ", ".join(f"{a} {c[a]}" for a in ("island", *LAYOUT_AXES) if a in c)


def diagnose(folder: Path, world: int, me: int | None = None) -> str:
    """One line naming the rank(s) the others waited for and their last collectives."""
    ranks = {r: read_ring(folder, r) for r in range(world)}
    missing = [r for r, m in ranks.items() if not m]
    ranks = {r: m for r, m in ranks.items() if m}
    if not ranks:
        return f"no flight records in {folder}"

    def last(m: Mapping[str, Any]) -> dict[str, Any] | None:
        return m["records"][-1] if m["records"] else None

    def waiting(m: Mapping[str, Any]) -> dict[str, Any] | None:
        """The oldest collective not completed: where the rank waits. On NCCL a rank goes on
        entering collectives after the one that stalls (they return once queued)."""
        return next((r for r in m["records"] if not r["t_done"]), None)

    # 1. frozen or dead processes (this host); a process gone after dumping its ring is a
    # survivor that gave up before this one (its own timeout ran out first), not a laggard
    states = {r: _process_state(m) for r, m in ranks.items()}
    culprits = [r for r, s in states.items() if s == "stopped"
                or (s == "gone" and not _gave_up(folder, r, ranks[r]))]
    why = {r: f"process {states[r]}" for r in culprits}
    # 2. the ends of "waits for" chains
    if not culprits:
        behind: dict[int, set[int]] = {}
        for r, m in ranks.items():
            w = waiting(m)
            if w is None or w["op"] in ("send", "recv"):  # pairwise: counts differ by stage
                continue
            for peer in m["groups"].get(w["axis"], []):
                pm = ranks.get(peer)
                if peer != r and pm is not None and pm["per_axis"].get(w["axis"], 0) < w["axis_seq"]:
                    behind.setdefault(r, set()).add(peer)
        lagging = {p for peers in behind.values() for p in peers}
        culprits = sorted(p for p in lagging if p not in behind)
        why = {r: "never reached the collective its peers wait in" for r in culprits}
    # 3. the oldest last collective
    if not culprits:
        entered = {r: (last(m) or {}).get("t_enter", 0.0) for r, m in ranks.items()}
        oldest = min(entered, key=lambda r: entered[r])
        culprits, why = [oldest], {oldest: "its last collective is the oldest"}
    parts = []
    for r in culprits:
        m = ranks[r]
        rec = last(m)
        age = f", entered {time.time() - rec['t_enter']:.1f} s ago" if rec else ""
        parts.append(f"rank {r} ({coords_text(m)}; {why[r]}): last collective "
                     f"{describe_record(rec)}{age}")
    waits: dict[str, list[int]] = {}
    for r, m in sorted(ranks.items()):
        if (w := waiting(m)) is not None and r not in culprits:
            waits.setdefault(f"{w['op']}[{w['axis']}] #{w['axis_seq']}", []).append(r)
    tail = "".join(f"; rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} waited in {c}"
                   for c, rs in list(waits.items())[:3])
    if missing:
        tail += f"; no records from rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))}"
    return "stalled " + "; ".join(parts) + tail + f" (flight records: {folder})"
