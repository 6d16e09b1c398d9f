"""Figures drawn with matplotlib (Agg): pipeline timelines, and the plots of ``meshlm report``.

Pipeline timelines, a schedule's ideal table or a measured step: one row per pipeline rank,
one box per compute action (F blue, B green, I light green, W orange; deeper shades for later
virtual chunks), labelled with its micro-batch; white is bubble. The same drawing serves
``meshlm schedule --plot`` (unit costs from the simulator) and a run's measured
``timeline/rank_*.json``.

Run figures (``plot_loss``, ``plot_throughput``, ``plot_memory``, ``plot_comm``, ``plot_router``)
take plain lists that :mod:`meshlm.train.report` picks out of ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path

COLORS = {"F": "#4c78a8", "B": "#54a24b", "I": "#88d27a", "W": "#f58518"}
# what ``meshlm schedule --plot`` writes, by the file's suffix
PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg")


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
    try:
        _write_figure(fig, Path(path), 120)
    finally:
        plt.close(fig)


def _write_figure(fig, path: Path, dpi: int) -> None:  # noqa: ANN001
    """Save ``fig`` in the format of ``path``'s suffix, replacing an existing file only once
    the new one is complete."""
    from .paths import replace_atomically

    fmt = path.suffix.lstrip(".").lower() or "png"
    replace_atomically(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=fmt))


def schedule_rows(sim: dict) -> list[list[dict]]:
    """Rows from :func:`meshlm.parallel.schedules.simulate`."""
    return [[{"op": a.op, "mb": a.mb, "stage": a.stage, "start": s, "end": e}
             for a, s, e in intervals] for intervals in sim["intervals"]]


def timeline_rows(run_dir: str | Path) -> tuple[list[list[dict]], dict]:
    """Measured rows of a run (one rank per pipeline position) and the first file's header."""
    files = sorted(Path(run_dir, "timeline").glob("rank_*.json"))
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"--timeline {str(run_dir)!r} is not a run directory")
    if not files:
        raise FileNotFoundError(f"{run_dir} has no timeline/rank_*.json (train with parallel.pp > 1)")
    by_pp: dict[int, dict] = {}
    for f in files:
        try:
            rec = json.loads(f.read_text())
            by_pp.setdefault(rec["pp_rank"], rec)  # lowest global rank of each pipeline position
            if not rec["actions"]:
                raise ValueError("no actions")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FileNotFoundError(f"{f} is not a timeline meshlm wrote ({e})") from None
    rows = [by_pp[r]["actions"] for r in sorted(by_pp)]
    return rows, by_pp[min(by_pp)]


# ---------------------------------------------------------------------- run report figures
# Each draws one PNG of a run's metrics from plain lists (``meshlm.train.report`` picks them
# out of metrics.jsonl); bytes are shown in MiB.
MIB = 2**20


def _pyplot():  # noqa: ANN202
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> None:  # noqa: ANN001
    fig.tight_layout()
    try:
        _write_figure(fig, Path(path), 110)
    finally:
        _pyplot().close(fig)


def plot_loss(train: list[tuple[float, float]], val: list[tuple[float, float]],
              path: str | Path, xlabel: str = "tokens seen") -> None:
    """Training loss (line) and validation loss (markers), as (x, loss) pairs."""
    from matplotlib.ticker import EngFormatter

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), color="#4c78a8", lw=1.2, label="training loss")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", color="#f58518", ms=4, label="validation loss")
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("loss")
    _save(fig, path)


def plot_throughput(steps: list[int], tokens_per_s: list[float], mfu: list[float],
                    path: str | Path) -> None:
    """Tokens/s and MFU (%) per optimizer step, one panel each."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(steps, tokens_per_s, color="#54a24b", lw=1.2)
    top.set_ylabel("tokens/s")
    top.set_title("throughput")
    bottom.plot(steps, [100 * m for m in mfu], color="#e45756", lw=1.2)
    bottom.set_ylabel("MFU (%)")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    _save(fig, path)


def plot_memory(states: dict[str, list[float]], peaks: list[float], path: str | Path,
                title: str = "memory per rank") -> None:
    """Per rank: parameter, gradient and optimizer-state bytes (stacked) beside the measured
    peak (``states[name][rank]``, ``peaks[rank]``)."""
    plt = _pyplot()
    n = len(peaks)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 + 0.7 * n), 4))
    x = list(range(n))
    w = 0.38
    bottom = [0.0] * n
    for (name, values), color in zip(states.items(), ("#4c78a8", "#54a24b", "#f58518"),
                                     strict=False):
        mib = [v / MIB for v in values]
        ax.bar([i - w / 2 for i in x], mib, w, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, mib, strict=True)]
    ax.bar([i + w / 2 for i in x], [p / MIB for p in peaks], w, color="#9d9d9d",
           label="measured peak")
    for i in x:  # the states are often a sliver of the peak: say both
        ax.text(i - w / 2, bottom[i], f"{bottom[i]:,.1f}", ha="center", va="bottom", fontsize=7)
        ax.text(i + w / 2, peaks[i] / MIB, f"{peaks[i] / MIB:,.0f}", ha="center", va="bottom",
                fontsize=7)
    ax.set_xticks(x, [f"rank {i}" for i in x], rotation=45 if n > 8 else 0)
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_comm(bytes_per_step: dict[str, float], path: str | Path) -> None:
    """Mean bytes per step of each collective, stacked per mesh axis ({"op/axis": bytes})."""
    plt = _pyplot()
    axes = sorted({k.split("/", 1)[1] for k in bytes_per_step})
    ops = sorted({k.split("/", 1)[0] for k in bytes_per_step})
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 1.1 * len(axes)), 4))
    bottom = [0.0] * len(axes)
    for op in ops:
        mib = [bytes_per_step.get(f"{op}/{a}", 0.0) / MIB for a in axes]
        ax.bar(axes, mib, 0.6, bottom=bottom, label=op)
        bottom = [b + v for b, v in zip(bottom, mib, strict=True)]
    for i, total in enumerate(bottom):  # small axes are slivers beside the gradient reduction
        ax.text(i, total, _human_bytes(total * MIB), ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("mesh axis")
    ax.set_ylabel("MiB per step (buffer size, this rank)")
    ax.set_title("communication per step")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    _save(fig, path)


def _human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def plot_router(steps: list[int], max_over_mean: dict[str, list[float]],
                last_load: dict[str, list[int]], path: str | Path) -> None:
    """MoE routing: a heat map of each layer's max/mean expert load per step (layers x
    steps), the same as lines, and the last step's tokens per expert (layers x experts, as a
    multiple of the layer's mean)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig = plt.figure(figsize=(11, 7.5))
    grid = fig.add_gridspec(2, 2, height_ratios=(1, 1))
    heat, left, right = (fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]),
                         fig.add_subplot(grid[1, 1]))
    layers = list(max_over_mean)
    n = len(steps)
    grid_rows = [[float("nan")] * (n - len(s)) + list(s) for s in max_over_mean.values()]
    first, last = (steps[0], steps[-1]) if steps else (0, 0)
    im = heat.imshow(grid_rows, aspect="auto", cmap="magma", vmin=1.0, interpolation="nearest",
                     extent=(first - 0.5, last + 0.5, len(layers) - 0.5, -0.5))
    heat.set_yticks(range(len(layers)), [f"layer {k}" for k in layers])
    heat.xaxis.set_major_locator(MaxNLocator(integer=True))
    heat.set_xlabel("step")
    heat.set_title("max / mean tokens per expert, per layer and step")
    fig.colorbar(im, ax=heat)
    for layer, series in max_over_mean.items():
        left.plot(steps[-len(series):], series, lw=1.0, label=f"layer {layer}")
    left.axhline(1.0, color="black", lw=0.6, ls="--")
    left.set_xlabel("step")
    left.set_ylabel("max / mean tokens per expert")
    left.set_title("router load imbalance")
    left.grid(alpha=0.3)
    if len(max_over_mean) <= 12:
        left.legend(fontsize=7)
    rows = [[v / (sum(load) / len(load)) if sum(load) else 0.0 for v in load]
            for load in last_load.values()]
    im = right.imshow(rows, aspect="auto", cmap="viridis", vmin=0)
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_yticks(range(len(last_load)), [f"layer {k}" for k in last_load])
    right.set_xlabel("expert")
    right.set_title("last step: tokens per expert / mean")
    fig.colorbar(im, ax=right)
    _save(fig, path)
