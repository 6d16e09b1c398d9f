"""``benchmarks/gpu.py``: its ``--tiny`` CPU run gives every row with measured and predicted
columns (the fp8 rows with their ratios to bf16 and the loss check); the plain loop's model
has meshlm's shapes; failures, time limits and a missing torchao are rows."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from meshlm.models import build_model
from meshlm.models.config import ModelConfig
from meshlm.testing import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
HAS_CXX = any(shutil.which(n) for n in ([os.environ["CXX"]] if os.environ.get("CXX")
                                         else ["g++", "c++", "clang++"]))


@pytest.fixture(scope="module")
def gpu(import_benchmark) -> ModuleType:  # noqa: ANN001
    return import_benchmark("gpu")


def finite_positive(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def run_tiny(rows: list[str], out: Path, cache: Path) -> tuple[str, dict]:
    """``gpu.py --tiny --rows ROWS``: its stdout and JSON. Its data and compile caches in
    ``cache`` (not the user's); a budget that a loaded machine does not spend (a row skipped
    for want of time would fail the checks, not the script)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--json", str(out), "--rows", ",".join(rows),
         "--cache-dir", str(cache), "--budget-s", str(HANG_GUARD_S)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "plan step s" in proc.stdout and f"wrote {out}" in proc.stdout
    data = json.loads(out.read_text())
    assert data["tiny"] is True and data["device"] == "cpu"
    assert [r["row"] for r in data["rows"]] == rows
    return proc.stdout, data


@pytest.fixture(scope="module")
def tiny(gpu: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """One ``--tiny`` run of every row (the compiled ones where there is a C++ compiler):
    its stdout and JSON."""
    folder = tmp_path_factory.mktemp("gpu_tiny")
    rows = [r.name for r in gpu.ROWS if HAS_CXX or not gpu.tiny_row(r).compiled]
    return run_tiny(rows, folder / "gpu_tiny.json", folder / "cache")


def check_measured_and_planned(gpu: ModuleType, name: str, r: dict) -> None:
    assert r["status"] == "ok", (name, r.get("error"), r.get("traceback_tail"))
    for key in ("tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes", "params"):
        assert finite_positive(r[key]), (name, key, r.get(key))
    assert r["steps"] >= 2 and len(r["step_times_s"]) == r["steps"]
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"])
    assert math.isfinite(r["final_loss"])
    # tiny for real: an AVX2-only CPU runs bf16 matmuls through a slow fallback
    assert r["params"] < 300_000 and r["tokens_per_step"] <= 128, name
    assert r["vocab"] == gpu.TINY_VOCAB
    plan = r["plan"]
    assert "error" not in plan, (name, plan)
    for key in ("step_time_s", "tokens_per_s", "mfu", "mem_alloc_bytes", "mem_total_bytes"):
        assert finite_positive(plan[key]), (name, key, plan.get(key))
    assert plan["fits"] is True and plan["hardware"] == "cpu"
    assert plan["kernels"] == ("fused" if r["compiled"] else "eager"), name


def test_tiny_run_has_every_row_measured_and_planned(gpu: ModuleType,
                                                    tiny: tuple[str, dict]) -> None:
    _, data = tiny
    got = {r["row"]: r for r in data["rows"] if r["row"] in gpu.DEFAULT_ROWS}
    assert set(got) == {r.name for r in gpu.ROWS if r.default and (HAS_CXX or not r.compiled)}
    for name, r in got.items():
        check_measured_and_planned(gpu, name, r)
    # the meshlm rows read the trainer's own metrics.jsonl back
    for name in ("meshlm-eager", "meshlm-fp32", "meshlm-fp16", "8b", "8b-offload"):
        assert finite_positive(got[name]["trainer_tokens_per_s"]), name
        assert got[name]["mem_phases_bytes"]["construction"] > 0
    assert got["meshlm-fp32"]["dtype"] == "fp32" and got["meshlm-fp16"]["dtype"] == "fp16"
    assert "offload=cpu" in got["8b-offload"]["config"]
    assert "recompute=full" in got["8b"]["config"] and "loss=chunked" in got["8b"]["config"]
    default_ratios = {"meshlm_eager_vs_plain_eager"}
    if HAS_CXX:
        for name in ("plain-compiled", "meshlm-compiled"):
            assert got[name]["compile"]["graphs"] >= 1, name
        default_ratios |= {"meshlm_compiled_vs_plain_compiled", "meshlm_compiled_vs_meshlm_eager"}
    assert set(data["ratios"]) - {k for k in data["ratios"] if k.startswith("fp8_")} == \
        default_ratios
    assert all(finite_positive(v) for v in data["ratios"].values())


def test_tiny_fp8_rows_measured_planned_and_loss_checked(gpu: ModuleType,
                                                         tiny: tuple[str, dict]) -> None:
    from meshlm.parallel.float8 import torchao_available

    stdout, data = tiny
    rows = list(gpu.FP8_ROW_NAMES)
    got = {r["row"]: r for r in data["rows"] if r["row"] in rows}
    assert list(got) == rows
    if not torchao_available():  # the bf16 baseline runs; the fp8 rows say why not
        assert got["8b-layers-bf16"]["status"] == "ok"
        for name in rows[1:]:
            assert got[name]["status"] == "skipped" and "torchao" in got[name]["error"]
        return
    for name, r in got.items():
        check_measured_and_planned(gpu, name, r)
        assert not r["compiled"], name  # (--tiny: eager, see gpu.py's docstring)
        assert r["warmup_steps"] + r["steps"] == gpu.TINY_LOSS_STEPS == len(r["losses"])
    assert got["8b-layers-bf16"]["dtype"] == "bf16"
    for recipe in ("tensorwise", "rowwise"):
        r = got[f"8b-layers-fp8-{recipe}"]
        assert r["dtype"] == "fp8" and f"fp8_recipe={recipe}" in r["config"]
    assert {k for k in data["ratios"] if k.startswith("fp8_")} == {
        "fp8_tensorwise_vs_bf16_eager", "fp8_rowwise_vs_bf16_eager"}
    check = data["fp8_loss"]
    assert check["steps"] == gpu.TINY_LOSS_STEPS and check["goal_rel_diff"] == 0.01
    assert check["8b-layers-bf16"]["final_loss"] == got["8b-layers-bf16"]["final_loss"]
    for name in rows[1:]:
        assert check[name]["rel_diff_vs_bf16"] >= 0 and "within_goal" in check[name]
        assert f"loss after {gpu.TINY_LOSS_STEPS} steps, {name}:" in stdout


def test_fp8_row_without_torchao_is_skipped(gpu: ModuleType, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import meshlm.parallel.float8 as f8

    monkeypatch.setattr(f8, "torchao_available", lambda: False)
    row = next(r for r in gpu.ROWS if r.name == "8b-layers-fp8-tensorwise")
    out = tmp_path / "row.json"
    assert gpu.RowRun(row, True, out, tmp_path, tmp_path / "cache", time.time() + 60,
                      False).run() == 0
    res = json.loads(out.read_text())
    assert res["status"] == "skipped" and "pip install --no-deps" in res["error"]
    assert gpu.fp8_unavailable(next(r for r in gpu.ROWS if r.name == "8b-layers-bf16")) is None


def test_fp8_loss_check_verdicts(gpu: ModuleType) -> None:
    n = gpu.LOSS_STEPS

    def row(name: str, final: float, steps: int = n, status: str = "ok") -> dict:
        return {"row": name, "status": status, "losses": [5.0] * (steps - 1) + [final]}

    check = gpu.fp8_loss_check([row("8b-layers-bf16", 4.0),
                                row("8b-layers-fp8-tensorwise", 4.02),
                                row("8b-layers-fp8-rowwise", 4.1)], tiny=False)
    assert check["8b-layers-fp8-tensorwise"]["rel_diff_vs_bf16"] == pytest.approx(0.005)
    assert check["8b-layers-fp8-tensorwise"]["within_goal"] is True
    assert check["8b-layers-fp8-rowwise"]["within_goal"] is False
    # a row cut short has no verdict
    check = gpu.fp8_loss_check([row("8b-layers-bf16", 4.0),
                                row("8b-layers-fp8-rowwise", 4.0, steps=40, status="timeout")],
                               tiny=False)
    assert "within_goal" not in check["8b-layers-fp8-rowwise"]
    assert "40 of 100" in check["8b-layers-fp8-rowwise"]["incomplete"]
    tps = [{"row": "8b-layers-bf16", "status": "ok", "tokens_per_s": 100.0},
           {"row": "8b-layers-fp8-rowwise", "status": "ok", "tokens_per_s": 125.0}]
    assert gpu.ratios(tps) == {"fp8_rowwise_vs_bf16_compiled": 1.25}
    for r in tps:  # rows that ran eager (--tiny's 8B-layer rows) name their ratio so
        r["compiled"] = False
    assert gpu.ratios(tps) == {"fp8_rowwise_vs_bf16_eager": 1.25}


def test_plain_model_has_meshlm_shapes(gpu: ModuleType) -> None:
    c = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                    max_seq_len=16, tie_embeddings=True)
    plain = gpu.PlainLlama(c, 16)
    ours = build_model(c, seed=0)
    assert plain.output.weight is plain.tok_embeddings.weight
    n = sum(p.numel() for p in plain.parameters())
    assert n == ours.cfg.num_params() == sum(p.numel() for p in ours.parameters())
    assert sorted(p.shape for p in plain.parameters()) == sorted(
        p.shape for p in ours.parameters())
    ids = torch.randint(0, 96, (2, 16))
    assert plain(ids).shape == ours(ids).shape == (2, 16, 96)


def test_rows_subset_and_failure_outcomes(gpu: ModuleType, tmp_path: Path) -> None:
    assert [r.name for r in gpu.parse_rows("8b,plain-eager")] == ["plain-eager", "8b"]
    assert not set(gpu.FP8_ROW_NAMES) & set(gpu.DEFAULT_ROWS)  # a dedicated run (--rows)
    assert set(gpu.ROW_NAMES) == {*gpu.DEFAULT_ROWS, *gpu.FP8_ROW_NAMES}
    with pytest.raises(SystemExit, match="unknown row"):
        gpu.parse_rows("plain-eager,nope")
    assert gpu.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 224 MiB"))
    assert not gpu.is_oom(ValueError("shapes do not match"))
    assert gpu.error_line(RuntimeError("first\nsecond")) == "RuntimeError: first"
    # a row still running at its time limit (here: reached as it starts) is killed with what
    # it started and recorded; the driver goes on
    args = argparse.Namespace(tiny=True, force=False)
    res = gpu.run_row(gpu.ROWS[0], args, tmp_path, tmp_path / "cache", time.time())
    assert res["status"] == "timeout" and "time limit" in res["error"], res
