"""``meshlm report RUN_DIR``: PNG plots and one self-contained HTML page of a training run.

Reads only what the run wrote -- ``metrics.jsonl``, ``config.toml``, ``env.json``,
``timeline/rank_*.json``, ``profile/`` -- and draws (matplotlib, Agg; :mod:`meshlm.viz`) each
figure whose data exist, skipping the rest:

    loss.png        training and validation loss vs tokens seen
    throughput.png  tokens/s and MFU vs step
    memory.png      per rank: parameters + gradients + optimizer states vs the measured peak
                    (the last record with ``mem_peak_per_rank``; older runs: the largest rank)
    comm.png        bytes per step of each collective, per mesh axis (``comm_bytes``)
    timeline.png    the measured pipeline step (pp > 1)
    router.png      MoE routing: a heat map of each layer's max/mean expert load over the
                    steps, the same as lines, and the last step's load of every expert

``index.html`` holds the run's summary table, the figures as base64 data URIs and the resolved
``config.toml``: one file that can be mailed or archived. Nothing is executed or unpickled; a
metrics line that does not parse (a crash mid-write) is skipped and counted.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import viz
from ..parallel.expert import router_summary

FIGURES = ("loss", "throughput", "memory", "comm", "timeline", "router")


class ReportError(ValueError):
    """The run directory cannot be reported on (missing, or no metrics)."""


@dataclass
class Run:
    """What a run directory holds, as the report reads it."""

    path: Path
    records: list[dict[str, Any]]
    skipped_lines: int = 0
    config_text: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)


def load_run(run_dir: str | Path) -> Run:
    """Read a run directory; :class:`ReportError` when there is nothing to report."""
    path = Path(run_dir).expanduser()
    if not path.is_dir():
        raise ReportError(f"{path}: no such run directory")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{path} has no metrics.jsonl (not a meshlm run dir, or no step "
                          "finished yet)")
    records, skipped = [], 0
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            records.append(rec)
        else:
            skipped += 1
    if not records:
        raise ReportError(f"{metrics} holds no step records")
    run = Run(path, sorted(records, key=lambda r: r["step"]), skipped)
    if (path / "config.toml").is_file():
        run.config_text = (path / "config.toml").read_text()
        try:
            run.config = tomllib.loads(run.config_text)
        except tomllib.TOMLDecodeError:
            pass  # shown as text all the same
    if (path / "env.json").is_file():
        try:
            run.env = json.loads((path / "env.json").read_text())
        except json.JSONDecodeError:
            pass
    return run


# ---------------------------------------------------------------------- summary
def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _last(records: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    return next((r for r in reversed(records) if key in r), None)


def summary(run: Run) -> list[tuple[str, str]]:
    """(label, value) rows of the run: model, layout, steps, losses, speed, memory."""
    recs, cfg = run.records, run.config
    rows: list[tuple[str, str]] = []
    model = cfg.get("model", {})
    if model:
        rows.append(("model", str(model.get("preset", "?"))
                     + (f", {model['n_layers']} layers" if model.get("n_layers") else "")))
    if "layout" in run.env:
        rows.append(("layout", str(run.env["layout"])))
    par, prec = cfg.get("parallel", {}), cfg.get("precision", {})
    if par or prec:
        rows.append(("zero / precision", f"{par.get('zero', 0)} / {prec.get('dtype', '?')}"))
    last = recs[-1]
    rows.append(("steps", f"{recs[0]['step']} - {last['step']} ({len(recs)} records)"))
    if "tokens_seen" in last:
        rows.append(("tokens seen", f"{last['tokens_seen']:,}"))
    rows.append(("final loss", f"{last['loss']:.4f}"))
    if (val := _last(recs, "val_loss")) is not None:
        rows.append(("final validation loss", f"{val['val_loss']:.4f} (step {val['step']})"))
    steady = recs[1:] or recs  # the first step includes warm-up (allocations, caches)
    if all("tokens_per_s" in r for r in steady):
        rows.append(("tokens/s (median, after step 1)",
                     f"{statistics.median(r['tokens_per_s'] for r in steady):,.0f}"))
    if all("mfu" in r for r in steady):
        rows.append(("MFU (median)", f"{100 * statistics.median(r['mfu'] for r in steady):.2f} %"
                     + (f" of {run.env['peak_flops'] / 1e9:,.1f} GFLOP/s per rank"
                        if run.env.get("peak_flops") else "")))
    if all("step_time_s" in r for r in recs):
        rows.append(("training time (sum of steps)", f"{sum(r['step_time_s'] for r in recs):,.1f} s"))
    peaks = [(r["mem_peak_bytes"], r["step"]) for r in recs if "mem_peak_bytes" in r]
    if peaks:
        top, at = max(peaks)
        rows.append(("peak memory (largest rank, whole run)", f"{_mib(top)} (step {at})"))
        if peaks[-1][0] != top:  # (the memory figure shows the last step's)
            rows.append(("peak memory (largest rank, last step)",
                         f"{_mib(peaks[-1][0])} (step {peaks[-1][1]})"))
    if "params_bytes" in last:
        rows.append(("states on rank 0 (params / grads / optimizer)",
                     " / ".join(_mib(last.get(k, 0)) for k in
                                ("params_bytes", "grads_bytes", "optim_bytes"))))
    bubbles = [r["pp_bubble"] for r in recs if "pp_bubble" in r]
    if bubbles:
        rows.append(("pipeline bubble (measured, last step)", f"{bubbles[-1]:.3f}"))
    traces = sorted((run.path / "profile").glob("*.pt.trace.json"))
    if traces:
        rows.append(("profiler traces", ", ".join(f"profile/{t.name}" for t in traces)))
    if run.skipped_lines:
        rows.append(("unreadable metrics lines (skipped)", str(run.skipped_lines)))
    return rows


# ---------------------------------------------------------------------- figures
def comm_per_step(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean bytes per step of each "op/axis" over the records that report communication."""
    rows = [r["comm_bytes"] for r in records if isinstance(r.get("comm_bytes"), dict)]
    total: dict[str, float] = {}
    for row in rows:
        for key, n in row.items():
            if "/" in key:
                total[key] = total.get(key, 0.0) + n
    return {k: v / len(rows) for k, v in total.items() if v > 0}


def draw_figures(run: Run, out: Path) -> dict[str, Path]:
    """Every figure the run has data for -> its PNG in ``out`` (name -> path)."""
    recs, done = run.records, {}
    out.mkdir(parents=True, exist_ok=True)
    x_key = "tokens_seen" if all("tokens_seen" in r for r in recs) else "step"
    train = [(r[x_key], r["loss"]) for r in recs if "loss" in r]
    val = [(r[x_key], r["val_loss"]) for r in recs if "val_loss" in r]
    if train or val:
        viz.plot_loss(train, val, out / "loss.png",
                      "tokens seen" if x_key == "tokens_seen" else "step")
        done["loss"] = out / "loss.png"
    speed = [r for r in recs if "tokens_per_s" in r and "mfu" in r]
    if speed:
        viz.plot_throughput([r["step"] for r in speed], [r["tokens_per_s"] for r in speed],
                            [r["mfu"] for r in speed], out / "throughput.png")
        done["throughput"] = out / "throughput.png"
    if (mem := memory_per_rank(recs)) is not None:
        states, peaks, title = mem
        viz.plot_memory(states, peaks, out / "memory.png", title)
        done["memory"] = out / "memory.png"
    if comm := comm_per_step(recs):
        viz.plot_comm(comm, out / "comm.png")
        done["comm"] = out / "comm.png"
    if sorted((run.path / "timeline").glob("rank_*.json")):
        try:
            rows, head = viz.timeline_rows(run.path)
            viz.draw(rows, f"measured {head.get('schedule', '')} step (pp={len(rows)})",
                     out / "timeline.png", "seconds")
            done["timeline"] = out / "timeline.png"
        except (OSError, ValueError, KeyError, TypeError):
            pass  # an unreadable timeline is skipped like a missing one
    if (router := router_series(recs)) is not None:
        viz.plot_router(*router, out / "router.png")
        done["router"] = out / "router.png"
    return done


def memory_per_rank(records: list[dict[str, Any]]
                    ) -> tuple[dict[str, list[float]], list[float], str] | None:
    """(states per rank, peak per rank, title) from the last record that lists every rank's
    memory; a run without those lists: rank 0's states beside the largest rank's peak."""
    names = {"parameters": "params_bytes", "gradients": "grads_bytes", "optimizer": "optim_bytes"}
    rec = _last(records, "mem_peak_per_rank")
    if rec is not None:
        n = len(rec["mem_peak_per_rank"])
        states = {label: rec.get(f"{key}_per_rank", [0] * n) for label, key in names.items()}
        return states, rec["mem_peak_per_rank"], f"memory per rank (step {rec['step']})"
    rec = _last(records, "mem_peak_bytes")
    if rec is None:
        return None
    states = {label: [rec.get(key, 0)] for label, key in names.items()}
    return states, [rec["mem_peak_bytes"]], f"rank 0 states vs largest peak (step {rec['step']})"


def router_series(records: list[dict[str, Any]]
                  ) -> tuple[list[int], dict[str, list[float]], dict[str, list[int]]] | None:
    """(steps, max/mean load per layer per step, last step's tokens per expert per layer)."""
    rows = [r for r in records if isinstance(r.get("router"), dict) and r["router"]]
    if not rows:
        return None
    layers = sorted(rows[-1]["router"], key=lambda k: int(k) if k.isdigit() else k)
    steps = [r["step"] for r in rows]
    imbalance = {k: [r["router"].get(k, {}).get("max_over_mean", float("nan")) for r in rows]
                 for k in layers}
    load = {k: rows[-1]["router"][k]["tokens_per_expert"] for k in layers}
    return steps, imbalance, load


# ---------------------------------------------------------------------- the page
CAPTIONS = {
    "loss": "Training loss per step and validation loss on evaluation steps, against tokens seen.",
    "throughput": "Tokens per second over all ranks, and model FLOPs utilisation against the "
                  "peak in the summary.",
    "memory": "Per rank: bytes of parameters, gradients and optimizer states held (stacked) "
              "beside the measured peak of the step in the title (CUDA allocator peak, or peak "
              "RSS on CPU); the summary's whole-run peak may come from another step.",
    "comm": "Mean bytes per optimizer step of each collective on each mesh axis (the full "
            "buffer each call is about, as counted by distributed.comm), training traffic only.",
    "timeline": "The last step's measured pipeline actions per stage (white: bubble).",
    "router": "MoE routing: max/mean tokens per expert of each layer over the steps (heat map: "
              "1 is a perfectly even load, E is every copy on one expert; and as lines), and "
              "the last step's load of every expert as a multiple of its layer's mean.",
}

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
td {{ border-bottom: 1px solid #ddd; padding: 0.25em 1em 0.25em 0; vertical-align: top; }}
td:first-child {{ color: #555; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #eee; }}
figcaption {{ color: #555; font-size: 0.9em; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }}
</style></head>
<body>
<h1>{title}</h1>
<h2>Summary</h2>
<table>
{rows}
</table>
{router}
<h2>Figures</h2>
{figures}
<h2>config.toml</h2>
<pre>{config}</pre>
</body></html>
"""


def render_html(run: Run, figures: dict[str, Path]) -> str:
    """The page: summary, router table, figures as data URIs, config.toml."""
    rows = "\n".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
                     for k, v in summary(run))
    figs = []
    for name in FIGURES:
        if name in figures:
            data = base64.b64encode(figures[name].read_bytes()).decode("ascii")
            figs.append(f'<figure id="{name}"><img alt="{name}" src="data:image/png;base64,'
                        f'{data}"><figcaption>{html.escape(CAPTIONS[name])}</figcaption></figure>')
    router = router_table(run.records)
    return PAGE.format(title=html.escape(f"meshlm report: {run.path.name}"), rows=rows,
                       router=router, figures="\n".join(figs) or "<p>(no figures)</p>",
                       config=html.escape(run.config_text or "(no config.toml)", quote=False))


def router_table(records: list[dict[str, Any]]) -> str:
    """The page's Router section: per MoE layer, max/mean load, experts that got no token,
    dropped copies, aux loss and the balancing bias's spread (empty without MoE records)."""
    table = router_summary(records)
    if not table:
        return ""
    head = ("layer", "max/mean load (mean, last)", "experts without tokens (mean, last)",
            "dropped", "aux loss (mean)", "bias spread (last)")
    rows = [(k, f"{v['max_over_mean_mean']:.2f}, {v['max_over_mean_last']:.2f}",
             f"{v['idle_experts_mean']:.1f}, {v['idle_experts_last']:.0f}",
             f"{100 * v['dropped_fraction']:.1f} %", f"{v['aux_loss_mean']:.4g}",
             f"{v['bias_spread_last']:.4g}") for k, v in table.items()]
    return "<h2>Router</h2>\n<table>\n" + "\n".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
        for row in (head, *rows)) + "\n</table>"


def write_report(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the figures and ``index.html`` into ``out`` (default ``RUN_DIR/report``);
    returns the files written, the page last."""
    run = load_run(run_dir)
    out_dir = Path(out).expanduser() if out else run.path / "report"
    if out_dir.exists() and not out_dir.is_dir():
        raise ReportError(f"--out {out_dir} is a file, not a directory")
    figures = draw_figures(run, out_dir)
    page = out_dir / "index.html"
    page.write_text(render_html(run, figures))
    return [*figures.values(), page]
