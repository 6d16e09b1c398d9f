"""Pipeline timelines drawn with matplotlib: a schedule's ideal table or a measured step.

One row per pipeline rank, one box per compute action (F blue, B green, I light green,
W orange; deeper shades for later virtual chunks), labelled with its micro-batch; white is
bubble. The same drawing serves ``meshlm schedule --plot`` (unit costs from the simulator)
and a run's measured ``timeline/rank_*.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

COLORS = {"F": "#4c78a8", "B": "#54a24b", "I": "#88d27a", "W": "#f58518"}


def draw(rows: list[list[dict]], title: str, path: str | Path, unit: str = "time") -> None:
    """rows[r] = [{"op", "mb", "stage", "start", "end"}, ...] -> PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(rows)
    end = max((a["end"] for row in rows for a in row), default=1.0)
    fig, ax = plt.subplots(figsize=(min(18, 4 + 0.45 * sum(len(r) for r in rows) / max(n, 1)),
                                    0.6 * n + 1.4))
    n_stages = max((a["stage"] for row in rows for a in row), default=0) + 1
    for r, row in enumerate(rows):
        for a in row:
            chunk = a["stage"] // n if n_stages > n else 0
            ax.barh(r, a["end"] - a["start"], left=a["start"], height=0.8,
                    color=COLORS.get(a["op"], "grey"), edgecolor="black", linewidth=0.4,
                    alpha=1.0 if chunk == 0 else 0.6)
            if a["end"] - a["start"] > end / 120:
                ax.text((a["start"] + a["end"]) / 2, r, f"{a['op']}{a['mb']}", ha="center",
                        va="center", fontsize=7, color="white")
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(unit)
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, ["forward", "backward", "backward (inputs)", "backward (weights)"],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if n < 4 else -0.18), fontsize=7,
              ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def schedule_rows(sim: dict) -> list[list[dict]]:
    """Rows from :func:`meshlm.parallel.schedules.simulate`."""
    return [[{"op": a.op, "mb": a.mb, "stage": a.stage, "start": s, "end": e}
             for a, s, e in intervals] for intervals in sim["intervals"]]


def timeline_rows(run_dir: str | Path) -> tuple[list[list[dict]], dict]:
    """Measured rows of a run (one rank per pipeline position) and the first file's header."""
    files = sorted(Path(run_dir, "timeline").glob("rank_*.json"))
    if not files:
        raise FileNotFoundError(f"{run_dir} has no timeline/rank_*.json (train with parallel.pp > 1)")
    by_pp: dict[int, dict] = {}
    for f in files:
        rec = json.loads(f.read_text())
        by_pp.setdefault(rec["pp_rank"], rec)  # lowest global rank of each pipeline position
    rows = [by_pp[r]["actions"] for r in sorted(by_pp)]
    return rows, by_pp[min(by_pp)]
