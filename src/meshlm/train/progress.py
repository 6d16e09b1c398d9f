"""Live progress line (rich) on a terminal; plain log lines every ``log_every`` steps otherwise.

The line shows each extra training objective's loss by its registered name
(``parallel/objective.py``) after the main loss."""

from __future__ import annotations

import sys
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..parallel.objective import metric
from ..parallel.training_heads import registered


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def summary(rec: dict[str, Any]) -> str:
    text = (
        f"loss {rec['loss']:.4f} | "
        + "".join(f"{name} {rec[metric(name)]:.4f} | " for name in registered()
                  if rec.get(metric(name)) is not None)
        + f"lr {rec['lr']:.2e} | "
        + (f"gnorm {rec['grad_norm']:.3f} | " if rec.get("grad_norm") is not None else
           f"skipped (fp16 overflow, scale {rec.get('loss_scale', 0):g}) | ")
        + f"{rec['tokens_per_s']:,.0f} tok/s | MFU {100 * rec['mfu']:.1f}% | "
        f"mem {format_bytes(rec['mem_peak_bytes'])}"
    )
    if rec.get("val_loss") is not None:
        text += f" | val {rec['val_loss']:.4f}"
    return text


class ProgressLine:
    """Shows one line per step on a TTY, or prints every ``log_every`` steps (and evals)."""

    def __init__(self, total: int, start: int, log_every: int, enabled: bool = True) -> None:
        self.total, self.log_every, self.enabled = total, log_every, enabled
        self.live = enabled and sys.stdout.isatty()
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(bar_width=20),
                TextColumn("{task.fields[info]}"), TextColumn("ETA"), TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=total, completed=start, info="")
            self._progress.start()

    def update(self, rec: dict[str, Any], eta_s: float) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=rec["step"], info=summary(rec))
            if rec.get("val_loss") is not None:
                self._progress.console.print(f"step {rec['step']}: val_loss {rec['val_loss']:.4f}")
            return
        step = rec["step"]
        if step % self.log_every == 0 or step == self.total or rec.get("val_loss") is not None:
            print(f"step {step}/{self.total} | {summary(rec)} | ETA {eta_s:.0f}s", flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
