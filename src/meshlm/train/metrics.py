"""Per-step metrics: ``metrics.jsonl`` in the run directory, optional TensorBoard, memory peak.

One JSON object per line with at least ``step, loss, lr, grad_norm, tokens_per_s, mfu,
step_time_s, mem_peak_bytes`` and ``val_loss`` on evaluation steps (the README contract);
``{name}_loss`` for each extra training objective the model has (``parallel/objective.py``: its
mean over the global batch; ``loss`` stays the main model's).
Writes are line-buffered and flushed, so a crash loses at most the current line.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, peak RSS on CPU.

    On Linux the kernel's ``VmHWM`` (what ``/proc/self/clear_refs`` resets), not
    ``getrusage``'s ``ru_maxrss``: that one also keeps the high-water mark of the moment any
    thread of the process exited (a tokenizer, compiler or collective thread), which no reset
    clears -- a start-up peak would then hide every later step's."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


class PhasePeaks:
    """Peak memory of this process per phase (construction, load, steps, save).

    :meth:`measure` reads the peak since the previous call and resets it -- the CUDA
    allocator's peak on GPU; on Linux the kernel's peak RSS (``VmHWM``, reset through
    ``/proc/self/clear_refs``). Where that reset is not available the peaks are cumulative.
    With ``comm`` every rank's value is gathered (a collective: every rank must call):
    ``phases`` keeps the largest, ``per_rank`` all of them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, int] = {}
        self.per_rank: dict[str, list[int]] = {}
        self.reset()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def measure(self, phase: str, comm: Any = None) -> int:
        peaks = [peak_memory_bytes(self.device)]
        if comm is not None and comm.mesh.world_size > 1:
            mine = torch.tensor([float(peaks[0])], dtype=torch.float64,
                                device=comm.mesh.device())
            every = torch.empty(comm.mesh.world_size, dtype=torch.float64, device=mine.device)
            comm.all_gather(every, mine, "world")
            peaks = [int(x) for x in every.tolist()]
        self.per_rank[phase] = peaks
        self.phases[phase] = max(self.phases.get(phase, 0), max(peaks))
        self.reset()
        return max(peaks)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (empty list if it does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def tensorboard_scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A record's numbers as TensorBoard scalars: top-level ones by their key (not ``step``),
    those of nested objects by their path -- ``router/<layer>/max_over_mean`` for the MoE
    statistics of each layer; lists and text are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(tensorboard_scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, int | float) and (prefix or key != "step"):
            out[f"{prefix}{key}"] = value
    return out


class MetricsWriter:
    """Appends records to metrics.jsonl (and TensorBoard scalars when enabled)."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, keep_until: int | None = None):
        self.path = run_dir / "metrics.jsonl"
        if keep_until is not None and self.path.exists():
            self._keep(keep_until)  # resuming: the steps after the checkpoint are redone
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is an optional dependency
                raise RuntimeError("run.tensorboard=true needs `pip install tensorboard`") from e
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def _keep(self, until: int) -> None:
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= until]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def rewind(self, step: int) -> None:
        """Drop the records after ``step`` (a rollback redoes those steps)."""
        self._file.close()
        self._keep(step)
        self._file = self.path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in tensorboard_scalars(record).items():
                self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
