"""``benchmarks/multi_gpu.py`` on CPU (gloo workers started by ``launch_local``).

Every layout a world of 2 allows, and a subset of a world of 4 in NCCL-semantics mode, match
the one-process run (losses, gradient norms and final weights within 1e-5, fp32) in the JSON
and the printed table; the layouts a world cannot hold are listed as skipped with a reason.
The comparison itself flags a run that differs, and a layout whose world fails is recorded
while the next one still runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from meshlm.testing import HANG_GUARD_S, command_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "multi_gpu.py"
RTOL = 1e-5  # the CPU parity tests' bound

WORLD2_RUN = ["ddp", "zero1", "zero2", "zero3", "tp", "tp-sp", "cp-ring", "cp-zigzag",
              "cp-ulysses", "pp-afab", "pp-1f1b", "pp-interleaved", "pp-zb", "ep", "diloco"]
WORLD2_SKIPPED = ["dp-tp", "pp-dp", "cp-tp", "ep-tp", "3d", "4d-moe", "diloco-tp"]
WORLD4_SUBSET = ["pp-dp", "cp-tp"]


@pytest.fixture(scope="module")
def mg(import_benchmark) -> ModuleType:  # noqa: ANN001
    return import_benchmark("multi_gpu")


def run_script(out: Path, cache: Path, *args: str) -> tuple[str, dict[str, Any]]:
    """The script's stdout and JSON; it must exit 0 (every layout it ran matched)."""
    env = command_env({"PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])})
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--json", str(out),
                           "--cache-dir", str(cache), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"wrote {out}" in proc.stdout
    return proc.stdout, json.loads(out.read_text())


def check_matched(row: dict[str, Any], steps: int) -> None:
    """A layout that ran: it matched, and its numbers say so."""
    name = row["layout"]
    assert row["status"] == "ok" and row["match"] is True, (name, row.get("error"))
    assert 0 <= row["max_loss_diff"] < RTOL, (name, row["max_loss_diff"])
    assert 0 <= row["max_weight_diff"] < RTOL, (name, row["worst_weight"])
    if name.startswith("diloco"):  # islands report their own gradient norms
        assert row["max_grad_norm_diff"] is None
    else:
        assert 0 <= row["max_grad_norm_diff"] < RTOL, (name, row["max_grad_norm_diff"])
    assert len(row["losses"]) == len(row["ref_losses"]) == steps
    for got, ref in zip(row["losses"], row["ref_losses"], strict=True):
        assert abs(got - ref) / ref < RTOL, name
    assert row["step_time_s"] > 0 and row["ref_step_time_s"] > 0


def table_line(stdout: str, layout: str) -> list[str]:
    """The cells of ``layout``'s row in the printed markdown table."""
    line = next(ln for ln in stdout.splitlines() if ln.startswith(f"| {layout} "))
    return [c.strip() for c in line.strip("|").split("|")]


def test_world_of_two_every_layout_matches(tmp_path: Path, cache_dir: Path) -> None:
    stdout, data = run_script(tmp_path / "w2.json", cache_dir, "--world", "2")
    assert data["backend"] == "gloo" and data["world"] == 2 and data["rtol"] == RTOL
    assert data["all_matched"] is True and data["nccl_semantics"] is False
    assert [w["backend"] for w in data["workers"]] == ["gloo", "gloo"]
    rows = {r["layout"]: r for r in data["rows"]}
    assert list(rows) == WORLD2_RUN[:14] + WORLD2_SKIPPED[:6] + ["diloco", "diloco-tp"]
    for name in WORLD2_RUN:
        check_matched(rows[name], data["steps"])
        assert rows[name]["world"] == 2
        cells = table_line(stdout, name)
        assert cells[2:4] == ["2", "y"], cells
        assert float(cells[4]) < RTOL and float(cells[5]) < RTOL, cells
    for name in WORLD2_SKIPPED:
        assert rows[name]["status"] == "skipped" and rows[name]["match"] is None
        assert "needs" in rows[name]["reason"], rows[name]
        assert table_line(stdout, name)[3] == "skipped"
    # the MoE layout compares with the MoE reference, DiLoCo with SGD's
    assert rows["ep"]["reference"].startswith("ref-moe")
    assert rows["diloco"]["reference"].startswith("ref-dense-sgd")
    assert {r["layout"] for r in data["references"]} == {r["reference"] for r in rows.values()
                                                         if r["status"] == "ok"}


def test_world_of_four_subset_in_nccl_semantics_mode(tmp_path: Path, cache_dir: Path) -> None:
    _, data = run_script(tmp_path / "w4.json", cache_dir, "--world", "4", "--only",
                         ",".join(WORLD4_SUBSET), "--nccl-semantics")
    assert data["nccl_semantics"] is True and data["all_matched"] is True
    assert [w["nccl_semantics_env"] for w in data["workers"]] == ["1"] * 4
    assert [r["layout"] for r in data["rows"]] == WORLD4_SUBSET
    for row in data["rows"]:
        check_matched(row, data["steps"])
        assert row["world"] == 4


def test_skips_follow_the_world(mg: ModuleType) -> None:
    """Odd worlds skip what does not divide (with meshlm's own reason); 8 has every layout."""
    def skipped(world: int) -> dict[str, str]:
        plan = mg.Plan(world, mg.make_shape("tiny", world), 5, Path("corpus"), Path("cache"),
                       Path("work"), 60.0)
        return {c.name: c.skip for c in mg.resolve_skips(plan, mg.all_cases(world,
                                                                            plan.shape))
                if c.skip}

    assert skipped(8) == {}
    three = skipped(3)
    assert "tp=3 does not divide" in three["tp"] and "ep=3" in three["ep"]
    assert "seq_len" in three["cp-zigzag"] and "ddp" not in three and "pp-zb" not in three
    assert set(mg.case_names()) == set(WORLD2_RUN + WORLD2_SKIPPED)


def test_comparison_flags_a_run_that_differs(mg: ModuleType, tmp_path: Path,
                                             cache_dir: Path) -> None:
    from meshlm.config import load_config
    from meshlm.train.trainer import train

    plan = mg.Plan(2, mg.make_shape("tiny", 2), 3, mg.corpus_dir(cache_dir), cache_dir,
                   tmp_path, 60.0)
    case = mg.Case("ddp")
    ref_dir = tmp_path / plan.ref_key(case)
    for extra in ([], [f"--run.dir={tmp_path / 'same'}"],
                  ["--train.lr=0.0123", f"--run.dir={tmp_path / 'other-lr'}"]):
        train(load_config(None, plan.ref_args(case) + extra), log=lambda _m: None,
              progress=False)
    same = mg.compare(tmp_path / "same", ref_dir, False, 3)
    assert same["match"] is True and same["max_loss_diff"] == same["max_weight_diff"] == 0
    other = mg.compare(tmp_path / "other-lr", ref_dir, False, 3)
    assert other["status"] == "mismatch" and other["match"] is False
    assert other["max_weight_diff"] > RTOL
    assert mg.compare(tmp_path / "missing", ref_dir, False, 3)["status"] == "failed"


def test_a_failing_layout_is_recorded_and_the_next_runs(
        mg: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that fails in its second run records that run's error and launches again
    with the runs after it (a stand-in launcher: ``launch_local``'s failures are
    test_launch.py's)."""
    launches: list[list[str]] = []

    def launch(world: int, fn: object, runs: list[list[str]], timeout_s: float) -> dict:
        launches.append([Path(r[-1].split("=", 1)[1]).name for r in runs])
        for args in runs:
            run_dir = Path(args[-1].split("=", 1)[1])
            if run_dir.name == "bad":
                raise mg.WorkerFailure("worker rank 1 failed: ValueError: boom", 1)
            (run_dir / "checkpoints" / "step_0000002").mkdir(parents=True)
            (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
        return {r: {"rank": r} for r in range(world)}

    monkeypatch.setattr(mg, "launch_local", launch)
    runs = {name: [f"--run.dir={tmp_path / name}"] for name in ("a", "bad", "c", "d")}
    errors, workers = mg.run_in_world(2, runs, 2, 60.0)
    assert errors == {"bad": "worker rank 1 failed: ValueError: boom"}
    assert launches == [["a", "bad", "c", "d"], ["c", "d"]]
    assert workers == [{"rank": 0}, {"rank": 1}]
    assert all(mg.finished(tmp_path / n, 2) for n in ("a", "c", "d"))
    assert not mg.finished(tmp_path / "bad", 2)
