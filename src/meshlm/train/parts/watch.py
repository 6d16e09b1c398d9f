"""The watch part: this rank's flight recorder, the stall monitor and the collective timeouts.

With several ranks every collective is entered into a ring in ``run.dir/flight`` (see
distributed/flight.py); a collective that fails (a peer froze or died) is then explained from
every rank's ring. In CUDA / NCCL-semantics mode a returning collective says nothing about its
completion and a timeout aborts the process, so a stall monitor reads completion from the
handles and names a stalled rank before the process group's (doubled) timeout. Start-up and
the first step wait ``distributed.init_timeout_s``, later steps ``distributed.timeout_s``.
No communication of its own; memory: ``distributed.flight_records`` records per rank.
"""

from __future__ import annotations

import re
from pathlib import Path

from ...config import DistributedSection
from ...distributed.comm import Comm
from ...distributed.flight import CollectiveFailure, FlightRecorder, diagnose, is_comm_failure
from ...distributed.stall import StallMonitor


def _first_line(exc: BaseException, limit: int = 160) -> str:
    line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)  # gloo's "[.../unbound_buffer.cc:78] "
    return line if len(line) <= limit else line[:limit - 3] + "..."


class CollectiveWatch:
    """The flight recorder (None alone) and stall monitor of this rank's communicator."""

    SECTION = "distributed"

    def __init__(self, section: DistributedSection, comm: Comm, run_dir: Path) -> None:
        self.section, self.comm, self.mesh = section, comm, comm.mesh
        self.flight = self.open_flight(run_dir)

    def open_flight(self, run_dir: Path) -> FlightRecorder | None:
        """This rank's flight recorder in ``run.dir/flight`` (several ranks only)."""
        if self.mesh.world_size == 1:
            return None
        rec = FlightRecorder(run_dir / "flight", self.mesh.rank, self.mesh.world_size,
                             self.section.flight_records, self.mesh.coords,
                             self.mesh.group_ranks())
        self.comm.flight = rec
        if not self.comm.completes_on_return:
            # CUDA / NCCL-semantics mode: a collective returning says nothing about completion,
            # and a timeout aborts the process; the stall monitor reads completion from the
            # handles and names a stalled rank before the process group's (doubled) timeout
            timeout = self.comm.collective_timeout_s()
            self.comm.monitor = StallMonitor(rec, self.mesh.world_size, timeout)
            self.mesh.set_timeout(2 * timeout)
        return rec

    def set_timeout(self, seconds: float) -> None:
        """From now on a collective waits ``seconds`` (with a stall monitor: the monitor
        speaks after ``seconds``, the process group gives up after twice as long)."""
        if self.comm.monitor is not None:
            self.comm.monitor.timeout_s = seconds
            seconds *= 2
        self.mesh.set_timeout(seconds)

    def close(self) -> None:
        """Stop the stall monitor and the point-to-point stream (a run's end, or its failure)."""
        if self.comm.monitor is not None:
            self.comm.monitor.close()
            self.comm.monitor = None
        self.comm.close()

    def failure(self, exc: Exception) -> CollectiveFailure | None:
        """A failed collective (a peer froze or died) named from every rank's flight records
        (distributed/flight.py); None for any other error, or alone."""
        if self.flight is None or not is_comm_failure(exc):
            return None
        self.flight.dump(f"{type(exc).__name__}: {exc}")
        return CollectiveFailure(
            f"rank {self.mesh.rank} gave up on a collective ({_first_line(exc)}); "
            + diagnose(self.flight.folder, self.mesh.world_size))
