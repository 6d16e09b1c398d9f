"""Seeing where time and memory go: profiler traces of a dp=2 run, `meshlm report` (PNGs and an
HTML page rendered by headless chromium), and the bf16-on-AVX2 start-up warning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshlm.cli import main
from meshlm.config import load_config
from meshlm.testing import HANG_GUARD_S, final_weights, run_world, train_runs
from meshlm.train import peak
from meshlm.train.report import write_report
from meshlm.train.trainer import train

MESHLM = Path(sys.executable).parent / "meshlm"  # the installed console script
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_png(path: Path, min_size: tuple[int, int] = (200, 150)) -> None:
    """A valid, non-empty PNG of at least ``min_size`` pixels that is not one flat colour."""
    from PIL import Image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.size[0] >= min_size[0] and im.size[1] >= min_size[1], (path, im.size)
        lo, hi = im.convert("L").getextrema()
        assert hi - lo > 50, f"{path} is blank"


def trace_names(path: Path) -> set[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("meshlm.")}


# ---------------------------------------------------------------------- a profiled run
def test_profiled_dp2_run_traces_and_report(tiny_args: list[str], tmp_path: Path) -> None:
    """dp=2, steps 2-3 profiled (step 2 saves a checkpoint): a trace per rank naming every
    layer's forward and backward, the gradient all-reduce over dp, the optimizer step and the
    save; the same losses and weights as the run without profiling; then `meshlm report`."""
    base = [a for a in tiny_args if not a.startswith("--run.dir")] + [
        "--train.steps=3", "--train.eval_every=2", "--train.checkpoint_every=2",
        "--parallel.dp=2"]
    profiled, plain = tmp_path / "profiled", tmp_path / "plain"
    losses = run_world(2, train_runs, base, [[f"--run.dir={profiled}", "--profile.steps=2-3"],
                                              [f"--run.dir={plain}"]])[0]
    assert losses[0] == losses[1]  # the instrumentation changes nothing
    got, ref = final_weights(profiled), final_weights(plain)
    assert all(torch.equal(got[n], ref[n]) for n in ref)

    traces = sorted((profiled / "profile").glob("*.pt.trace.json"))
    assert [t.name for t in traces] == ["rank_0000.pt.trace.json", "rank_0001.pt.trace.json"]
    assert not (plain / "profile").exists()
    for trace in traces:
        names = trace_names(trace)
        for layer in (0, 1):  # `tiny` has 2 layers
            assert f"meshlm.forward.layer{layer}" in names, names
            assert f"meshlm.backward.layer{layer}" in names, names
        assert "meshlm.all_reduce[dp]" in names, names  # DDP's gradient buckets
        assert "meshlm.all_reduce[world]" in names, names  # the metrics reduction
        assert {"meshlm.optimizer_step", "meshlm.checkpoint_save"} <= names, names
        assert {"meshlm.step[2]", "meshlm.step[3]"} <= names and "meshlm.step[1]" not in names

    out = subprocess.run([str(MESHLM), "report", str(profiled)], capture_output=True, text=True,
                         timeout=HANG_GUARD_S, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    report = profiled / "report"
    assert f"report: {report / 'index.html'}" in out.stdout
    for name in ("loss", "throughput", "memory", "comm"):
        check_png(report / f"{name}.png")
    page = (report / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 4
    assert 'preset = "tiny"' in page and "rank_0001.pt.trace.json" in page
    render_in_chromium(report / "index.html", tmp_path / "screenshot.png")


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome",
                                               "chrome")) if p), None)


def render_in_chromium(page: Path, shot: Path) -> None:
    """Headless chromium takes a screenshot of ``page``: a PNG that is not blank."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium binary (Debian: apt-get install chromium; .ci/run installs it)"
                    " -- the HTML page was checked, not rendered")
    out = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={shot.parent / 'chromium-profile'}", "--window-size=1100,1400",
         f"--screenshot={shot}", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    check_png(shot, (1000, 1000))
    from PIL import Image

    with Image.open(shot) as im:  # text and figures, not a white page
        dark = sum(im.convert("L").point(lambda v: 255 if v < 128 else 0).histogram()[255:])
        assert dark > 0.005 * im.size[0] * im.size[1], dark


# ---------------------------------------------------------------------- synthesized runs
def synthetic_run(root: Path) -> Path:
    """metrics.jsonl of a pp=2 x ep=2 MoE run (router records), its timeline, config, env."""
    run = root / "moe-run"
    (run / "timeline").mkdir(parents=True)
    records = []
    for step in range(1, 9):
        rec = {"step": step, "loss": 6.0 - 0.3 * step, "lr": 1e-3, "grad_norm": 1.0,
               "tokens_per_s": 1000.0 + step, "mfu": 0.1, "step_time_s": 0.5,
               "mem_peak_bytes": 400 * 2**20, "tokens_seen": 512 * step,
               "params_bytes": 2**20, "grads_bytes": 2**20, "optim_bytes": 2**21,
               "comm_bytes": {"p2p/pp": 4096, "all_to_all/ep": 8192, "all_reduce/dp_cp": 2**20},
               "pp_bubble": 0.25,
               "router": {str(k): {"tokens_per_expert": [10 + step, 20, 30, 40 - step],
                                   "max_over_mean": 1.6 - 0.05 * step, "dropped": 0,
                                   "aux_loss": 0.01} for k in (0, 1)}}
        if step % 4 == 0:
            rec["val_loss"] = rec["loss"] + 0.1
            rec |= {"mem_peak_per_rank": [400 * 2**20, 380 * 2**20, 390 * 2**20, 370 * 2**20],
                    "params_bytes_per_rank": [2**20] * 4, "grads_bytes_per_rank": [2**20] * 4,
                    "optim_bytes_per_rank": [2**21] * 4}
        records.append(json.dumps(rec))
    # a crash mid-write leaves half a line: skipped and counted
    (run / "metrics.jsonl").write_text("\n".join(records) + '\n{"step": 9, "lo')
    for rank in range(2):
        actions = [{"op": op, "mb": mb, "stage": rank, "start": 0.1 * (i + rank),
                    "end": 0.1 * (i + rank) + 0.08}
                   for i, (op, mb) in enumerate([("F", 0), ("F", 1), ("B", 0), ("B", 1)])]
        (run / "timeline" / f"rank_{rank:04d}.json").write_text(json.dumps(
            {"rank": rank, "pp_rank": rank, "pp": 2, "schedule": "1f1b", "step_time": 0.6,
             "actions": actions}))
    (run / "config.toml").write_text('[model]\npreset = "tiny-moe"\n\n[parallel]\npp = 2\n'
                                     'ep = 2\nzero = 1\n\n[precision]\ndtype = "fp32"\n')
    (run / "env.json").write_text(json.dumps({"layout": "world 4 (pp=2 dp=2 cp=1 tp=1, ep=2)",
                                              "peak_flops": 1e10}))
    return run


def test_report_of_a_pipeline_moe_run(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path)
    files = write_report(run, tmp_path / "out")
    assert [f.name for f in files] == ["loss.png", "throughput.png", "memory.png", "comm.png",
                                       "timeline.png", "router.png", "index.html"]
    for f in files[:-1]:
        check_png(f)
    page = files[-1].read_text()
    assert page.count("data:image/png;base64,") == 6
    for text in ("world 4 (pp=2 dp=2 cp=1 tp=1, ep=2)", "tiny-moe", "pipeline bubble",
                 "<h2>Router</h2>", "unreadable metrics lines (skipped)</td><td>1", "1 - 8"):
        assert text in page, text


def test_report_skips_what_a_run_lacks(tmp_path: Path) -> None:
    """A one-process run without config or validation: loss, throughput and memory only."""
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": 5.0 / s, "tokens_per_s": 10.0, "mfu": 0.01,
         "mem_peak_bytes": 2**25}) + "\n" for s in (1, 2, 3)))
    assert main(["report", str(run)]) == 0
    assert sorted(p.name for p in (run / "report").iterdir()) == [
        "index.html", "loss.png", "memory.png", "throughput.png"]
    assert "(no config.toml)" in (run / "report" / "index.html").read_text()


@pytest.mark.parametrize("setup", ["missing", "empty", "no-records"])
def test_report_errors_are_one_line(setup: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    if setup != "missing":
        run.mkdir()
    if setup == "no-records":
        (run / "metrics.jsonl").write_text("\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshlm: error: ") and len(err.strip().splitlines()) == 1, err
    assert not (run / "report").exists()


# ---------------------------------------------------------------------- bf16 on AVX2
def test_bf16_warning_logic() -> None:
    slow = peak.bf16_warning({"fp32": 100e9, "bf16": 1.5e9})
    assert slow is not None and "1.5 GFLOP/s bf16 vs 100.0 GFLOP/s fp32 (67x slower" in slow
    # an AVX-512 CPU with native bf16, 1.35x below fp32: the ratio as measured, no claim
    # that the CPU lacks bf16
    native = peak.bf16_warning({"fp32": 292e9, "bf16": 217e9})
    assert native is not None and "(1.35x slower, 128x128 matmul)" in native, native
    assert "without native" not in native and "217.0 GFLOP/s bf16 vs 292.0" in native
    assert "(4.2x slower" in peak.bf16_warning({"fp32": 42e9, "bf16": 10e9})
    assert "precision.dtype=fp32" in slow
    assert peak.bf16_warning({"fp32": 100e9, "bf16": 200e9}) is None  # native bf16 (AMX ...)
    assert peak.bf16_warning({"fp32": 100e9, "bf16": 90e9}) is None  # within timing noise
    assert peak.bf16_warning({"fp32": 100e9, "bf16": 0.0}) is not None
    assert peak.check_bf16(torch.device("cpu"), "fp32") is None  # nothing measured


def test_cpu_peak_is_measured_once_per_process_dtype_and_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.dtype] = []
    monkeypatch.setattr(peak, "_MEASURED", {})
    monkeypatch.setattr(peak, "peak_matmul_size", lambda dtype: 1024)
    monkeypatch.setattr(peak, "measure_matmul_flops",
                        lambda dtype, n: calls.append(dtype) or 5e10 + len(calls))
    cpu = torch.device("cpu")
    first = peak.peak_flops(cpu, "fp32")
    assert first == (5e10 + 1, f"measured CPU matmul fp32, {torch.get_num_threads()} thread(s)")
    assert peak.peak_flops(cpu, "fp32") == first and calls == [torch.float32]
    assert peak.peak_flops(cpu, "bf16")[0] == 5e10 + 2  # another dtype: measured
    assert peak.peak_flops(cpu, "fp32", override=1e9) == (1e9, "train.peak_flops")
    assert len(calls) == 2


@pytest.mark.parametrize(("probe_s", "size"), [(0.001, 1024), (0.01, 512), (0.05, 256),
                                               (2.0, 256)])
def test_the_cpu_peak_matmul_shrinks_for_a_slow_dtype(probe_s: float, size: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """1024 x 1024 unless a 256 probe says one call takes over 0.1 s (x8 per doubling), down to
    256: an emulated bf16 matmul is not timed for seconds at every start."""
    clock = iter([0.0, probe_s])
    monkeypatch.setattr(peak.time, "perf_counter", lambda: next(clock))
    assert peak.peak_matmul_size(torch.float32) == size


def test_bf16_run_warns_at_startup(tiny_args: list[str], monkeypatch: pytest.MonkeyPatch,
                                   tmp_path: Path) -> None:
    monkeypatch.setattr(peak, "quick_matmul_rates", lambda: {"fp32": 80e9, "bf16": 2e9})
    lines: list[str] = []
    train(load_config(None, tiny_args + ["--precision.dtype=bf16", "--train.steps=1"]),
          log=lines.append, progress=False)
    warning = [x for x in lines if x.startswith("warning: precision.dtype=bf16")]
    assert len(warning) == 1 and "2.0 GFLOP/s bf16 vs 80.0 GFLOP/s fp32 (40x" in warning[0]
    lines.clear()
    train(load_config(None, tiny_args + ["--train.steps=1", f"--run.dir={tmp_path / 'fp32'}"]),
          log=lines.append, progress=False)
    assert not any(x.startswith("warning") for x in lines)  # fp32: nothing measured


def test_summary_says_which_step_each_memory_figure_is() -> None:
    """The run's peak and the last step's (what the memory figure shows) are labelled apart."""
    from meshlm.train.report import Run, summary

    recs = [{"step": s, "loss": 1.0, "mem_peak_bytes": b * 2**20}
            for s, b in ((1, 900), (2, 1424), (3, 1095))]
    rows = dict(summary(Run(Path("r"), recs)))
    assert rows["peak memory (largest rank, whole run)"] == "1,424.0 MiB (step 2)"
    assert rows["peak memory (largest rank, last step)"] == "1,095.0 MiB (step 3)"
    flat = dict(summary(Run(Path("r"), recs[:2])))
    assert "peak memory (largest rank, last step)" not in flat  # (the same figure)


def test_one_validation_point_is_not_shown_as_a_change() -> None:
    from meshlm.train.parts.recorder import Recorder

    lines: list[str] = []
    fake = type("R", (), {"log": lambda self, m: lines.append(m), "run_dir": Path("r"),
                          "mesh": type("M", (), {"is_logging_rank": False})()})()
    Recorder.log_end(fake, {1: 8.3117}, 1, moe=False)
    Recorder.log_end(fake, {1: 8.3117, 5: 7.0}, 5, moe=False)
    assert lines[0] == "validation loss: 8.3117 (step 1)"
    assert lines[2] == "validation loss: 8.3117 (step 1) -> 7.0000 (step 5)"
