"""Stragglers: the rank that is persistently slower than its peers, by how much, and where.

Every step each rank measures its step time and the seconds it spent waiting in collectives
(:class:`WaitClock`). The trainer's one metrics all-reduce per step (``Trainer.record``) carries
both numbers of every rank to every rank -- 2 float64 per rank more in a reduction that already
runs, no collective of its own -- and rank 0 feeds them to a :class:`StragglerDetector`. Memory:
``straggler_steps`` x 3 floats per rank on rank 0.

A rank's *own work* of a step is its step time minus its wait: the time its peers could not
proceed without it. A straggler's own work is long and its wait short; its peers' the reverse,
while all step times agree (every step ends in a collective). Rank r is *slow* in a step when
its own work exceeds the median own work m of its peers by more than ``threshold`` x m
(``distributed.straggler_threshold``, 0.2) and by more than :data:`FLOOR_S` (5 ms: below that,
timer resolution and the scheduling of a busy host decide, not the rank). Its peers are the
ranks of its pipeline stage, which do the same work, or every rank when the stage has no
other (a pure pipeline: then a stage that does more work than the others is named too -- the
others do wait for it). The first :data:`WARMUP_STEPS` steps after start or resume are ignored
(allocation, caches: a CPU run's second step still differs between ranks by up to 40 %); a
compiled run ignores one more. Time a rank spends between steps (rank 0 writing the metrics)
shows as its peers' wait in the next step: it counts against that rank, as it should (they do
wait for it).

Rank 0 names a rank after ``distributed.straggler_steps`` slow steps in a row, once::

    straggler: rank 3 (pp 0, dp 1, cp 0, tp 1) is 1.8x slower than the median rank: 0.42 s of
    its own work per step vs 0.23 s; its peers wait 0.19 s per step for it (last 5 steps)

(one line), then says nothing more of it unless its ratio grows or shrinks by half (at most
every tenth of :data:`REPEAT_STEPS`, and ``straggler_steps``, steps), every :data:`REPEAT_STEPS`
steps while it lasts, and once when it has been within the threshold for ``straggler_steps``
steps in a row. While a rank is named, the metrics record carries ``straggler`` (the slowest
named rank: rank, ratio, seconds).

Wait times. On CPU (gloo) a collective blocks the host until its peers arrive, so
``Comm.wait_s`` -- the host's time blocked in collectives and in waits on their handles -- is the
wait. GPU-only path: NCCL calls return once the kernel is queued, so the host blocks in none of
them and ``Comm.wait_s`` is ~0 (the step time is still right: a step ends by reading its loss
back, which waits for the device). There the wait is the time NCCL's kernels ran, measured by
c10d itself with CUDA events (``ProcessGroup._enable_collectives_timing``) and reported per
completed collective to a hook (``_register_on_completion_hook``, on c10d's watchdog thread):
transfer plus waiting for the peers, the same quantity as gloo's. Collectives issued during a
step are counted (start times inside the step's window); the watchdog reports a completion up
to ~0.1 s late, so a step's last collectives may land in the next step's reading: over the
``straggler_steps`` window this shifts nothing. Collectives that overlap computation (DDP's
bucketed all-reduce during backward) count whole, so own work is a lower bound on every rank
alike. Where c10d refuses timing or hooks, the wait stays the host's, the own work of every
rank is its whole step, and nothing is named (rank 0 says so at start-up). Untested: the CPU
suite has no NCCL.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..distributed.comm import Comm
from ..distributed.flight import coords_text
from ..distributed.mesh import Mesh

FLOOR_S = 0.005  # a rank is slow only when its own work exceeds its peers' by more than this
WARMUP_STEPS = 2  # the first steps after start, ignored
REPEAT_STEPS = 100  # a lasting straggler is named again after this many steps
CHANGE = 1.5  # ... or when its ratio has grown or shrunk by this factor since it was named

Log = Callable[[str], None]


def seconds(x: float) -> str:
    """``0.42 s`` or, below 0.1 s, ``42 ms``."""
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.0f} ms"


@dataclass(frozen=True)
class Straggler:
    """A slow rank over the last steps: mean own work, the peers' median, their wait."""

    rank: int
    own_s: float
    median_s: float
    peers_wait_s: float
    steps: int

    @property
    def ratio(self) -> float:
        return self.own_s / max(self.median_s, 1e-9)

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "ratio": round(self.ratio, 3), "own_s": round(self.own_s, 6),
                "median_s": round(self.median_s, 6),
                "peers_wait_s": round(self.peers_wait_s, 6)}


class _RankState:
    """One rank's recent steps (own work, peers' median own work, peers' median wait)."""

    def __init__(self, steps: int) -> None:
        self.window: deque[tuple[float, float, float]] = deque(maxlen=steps)
        self.slow = 0  # slow steps in a row
        self.calm = 0  # steps within the threshold in a row
        self.named_at = 0  # step it was last named at (0: not named)
        self.named_ratio = 0.0

    def summary(self, rank: int) -> Straggler:
        n = len(self.window)
        own, median, wait = (sum(w[i] for w in self.window) / n for i in range(3))
        return Straggler(rank, own, median, wait, n)


class StragglerDetector:
    """Names the ranks whose own work per step stays above their peers' (module docstring).

    ``stage``: a label per rank, peers share it (default: one for all); ``coords``: a rank's
    mesh coordinates, for the log line; ``warmup``: the first updates, ignored."""

    def __init__(self, threshold: float, steps: int, coords: Callable[[int], Mapping[str, int]],
                 stage: Sequence[int] | None = None, warmup: int = WARMUP_STEPS,
                 floor_s: float = FLOOR_S, repeat: int = REPEAT_STEPS) -> None:
        self.threshold, self.steps, self.coords = threshold, steps, coords
        self.stage, self.warmup, self.floor_s, self.repeat = stage, warmup, floor_s, repeat
        self.seen = 0
        self.ranks: dict[int, _RankState] = {}

    def peers(self, rank: int, world: int) -> list[int]:
        """The ranks ``rank`` is compared with: its stage's, or all others if it is alone."""
        others = [j for j in range(world) if j != rank]
        if self.stage is None:
            return others
        same = [j for j in others if self.stage[j] == self.stage[rank]]
        return same or others

    def update(self, step: int, step_s: Sequence[float], wait_s: Sequence[float]) -> list[str]:
        """Feed one step's times (one entry per rank); the lines to log."""
        self.seen += 1
        world = len(step_s)
        if self.threshold <= 0 or world < 2 or self.seen <= self.warmup:
            return []
        own = [max(s - w, 0.0) for s, w in zip(step_s, wait_s, strict=True)]
        lines = []
        for r in range(world):
            peers = self.peers(r, world)
            median = statistics.median(own[j] for j in peers)
            wait = statistics.median(wait_s[j] for j in peers)
            state = self.ranks.setdefault(r, _RankState(self.steps))
            state.window.append((own[r], median, wait))
            slow = own[r] - median > max(self.threshold * median, self.floor_s)
            state.slow, state.calm = (state.slow + 1, 0) if slow else (0, state.calm + 1)
            if line := self.decide(step, r, state):
                lines.append(line)
        return lines

    def decide(self, step: int, rank: int, state: _RankState) -> str | None:
        """Name ``rank`` now, say it recovered, or stay quiet."""
        if not state.named_at:
            return self.name(step, rank, state) if state.slow >= self.steps else None
        if state.calm >= self.steps:
            state.named_at = 0
            s = state.summary(rank)
            return (f"straggler: rank {rank} ({self.where(rank)}) has caught up: "
                    f"{seconds(s.own_s)} of its own work per step vs {seconds(s.median_s)} "
                    f"(last {s.steps} steps)")
        if state.slow < self.steps:
            return None
        since = step - state.named_at
        change = state.summary(rank).ratio / state.named_ratio
        changed = max(change, 1 / change) >= CHANGE and since >= max(self.steps, self.repeat // 10)
        if since >= self.repeat or changed:
            return self.name(step, rank, state)
        return None

    def name(self, step: int, rank: int, state: _RankState) -> str:
        s = state.summary(rank)
        state.named_at, state.named_ratio = step, s.ratio
        return (f"straggler: rank {rank} ({self.where(rank)}) is {s.ratio:.1f}x slower than "
                f"the median rank: {seconds(s.own_s)} of its own work per step vs "
                f"{seconds(s.median_s)}; its peers wait {seconds(s.peers_wait_s)} per step for "
                f"it (last {s.steps} steps)")

    def where(self, rank: int) -> str:
        return coords_text({"coords": self.coords(rank)})

    @property
    def current(self) -> Straggler | None:
        """The slowest rank named now (None: none)."""
        named = [st.summary(r) for r, st in self.ranks.items() if st.named_at]
        return max(named, key=lambda s: s.ratio) if named else None


def detector_for(mesh: Mesh, threshold: float, steps: int, warmup: int = WARMUP_STEPS
                 ) -> StragglerDetector | None:
    """Rank 0's detector over the ranks of its island (None elsewhere, or alone)."""
    n = mesh.layout.inner_size
    if not mesh.is_logging_rank or n < 2:
        return None
    island = {"island": mesh.island} if mesh.islands > 1 else {}
    return StragglerDetector(threshold, steps, lambda r: {**island, **mesh.layout.coords(r)},
                             stage=[mesh.layout.coords(r)["pp"] for r in range(n)],
                             warmup=warmup)


# ---------------------------------------------------------------------- wait times
class NcclWait:
    """GPU-only path: seconds NCCL's kernels of the given groups ran for collectives issued
    in the current step window (c10d's CUDA-event timing, reported by its watchdog thread)."""

    def __init__(self, groups: Sequence[dist.ProcessGroup]) -> None:
        self.lock = threading.Lock()
        self.total = 0.0
        self.windows: deque[tuple[float, float]] = deque(maxlen=4)  # recent steps (wall time)
        self.opened: float | None = None
        for group in groups:
            group._enable_collectives_timing()
            group._register_on_completion_hook(self.done)

    def done(self, info: Any) -> None:  # noqa: ANN401 (c10d's WorkInfo)
        started = info.time_started.timestamp()
        with self.lock:
            if ((self.opened is not None and started >= self.opened)
                    or any(a <= started <= b for a, b in self.windows)):
                self.total += info.active_duration.total_seconds()

    def start(self) -> None:
        with self.lock:
            self.opened = time.time()

    def stop(self) -> float:
        with self.lock:
            self.windows.append((self.opened or 0.0, time.time()))
            self.opened = None
            total, self.total = self.total, 0.0
        return total


class WaitClock:
    """This rank's seconds waiting in collectives during a step: ``start()`` at the start of
    the step, ``stop()`` at its end. ``Comm.wait_s`` (host time blocked), or on CUDA the
    NCCL kernels' own timing when c10d provides it (:class:`NcclWait`)."""

    def __init__(self, comm: Comm, nccl: NcclWait | None = None) -> None:
        self.comm, self.nccl = comm, nccl

    def start(self) -> None:
        self.comm.wait_s = 0.0
        if self.nccl is not None:
            self.nccl.start()

    def stop(self) -> float:
        return self.nccl.stop() if self.nccl is not None else self.comm.wait_s


def wait_clock(comm: Comm, device_type: str, log: Log) -> WaitClock:
    """The clock of this run; on CUDA with several ranks, NCCL's timing (GPU-only path)."""
    mesh = comm.mesh
    if device_type != "cuda" or not mesh.distributed or mesh.world_size < 2:
        return WaitClock(comm)
    groups = {id(g): g for g in (mesh.group(a) for a in mesh.group_ranks()) if g is not None}
    try:
        return WaitClock(comm, NcclWait(list(groups.values())))
    except (AttributeError, NotImplementedError, RuntimeError, ValueError) as exc:
        log(f"stragglers: NCCL collective timing unavailable ({exc}); per-rank wait times are "
            "the host's, and no straggler can be told from its peers")
        return WaitClock(comm)
