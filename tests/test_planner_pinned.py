"""The planner's output, pinned: every prediction it makes for the shipped published runs and
for meshlm's measured H200 rows, field by field, as ``tests/data/planner_pinned.json`` holds it.

A change to how the planner is organised (the techniques' costs moving beside the techniques)
must leave every number where it was; a change that means to move a number rewrites the file on
purpose (``python tests/test_planner_pinned.py --write``) and says why in its commit. Floats are
compared to 1e-12 relative: the same arithmetic in another order may round differently in the
last bits, anything more is a different prediction.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
PINNED = Path(__file__).resolve().parent / "data" / "planner_pinned.json"
SHIPPED = ROOT / "benchmarks" / "data" / "published_runs.csv"
# meshlm's measured H200 rows (tests/test_planner.py, ../shared/data/gpu_h200_2026-11.md)
H200_820M = {"n_layers": 16, "dim": 2048, "n_heads": 16, "n_kv_heads": 8, "ffn_hidden": 5632,
             "max_seq_len": 2048, "vocab_size": 32000}
H200_ROWS = {
    "eager": ({}, "recompute=none"),
    "compiled": ({"kernels": "fused"}, "recompute=none"),
    "recompute-full-chunked-loss": ({"loss": "chunked"}, "recompute=full"),
    "offload-cpu": ({}, "recompute=none,offload=cpu"),
}


def current() -> dict[str, Any]:
    """Every pinned prediction, as plain JSON values."""
    from meshlm.models.presets import PRESETS
    from meshlm.planner import CATALOGUE, ModelSpec, Workload, evaluate, parse_layout

    bench = load_benchmark("planner_vs_published")
    out: dict[str, Any] = {"published": {}, "h200": {}}
    with SHIPPED.open(newline="") as f:
        raws = list(csv.DictReader(f))
    for i, raw in enumerate(raws):
        row = bench.build_row(i, raw)
        if row.reason:
            out["published"][str(i)] = {"reason": row.reason}
            continue
        out["published"][str(i)] = bench.predict(row).to_dict()
    spec = ModelSpec(dataclasses.replace(PRESETS["small"], **H200_820M))
    for name, (options, items) in H200_ROWS.items():
        work = Workload(spec, 2048, 8, dtype="bf16", states="fp32", optimizer="foreach",
                        **options)
        lo = parse_layout(f"tp=1,pp=1,dp=1,zero=0,mbs=8,{items}")
        out["h200"][name] = evaluate(work, lo, CATALOGUE["h200"]).to_dict()
    return json.loads(json.dumps(out))  # tuples -> lists, keys -> strings, as the file holds


def _differences(got: Any, want: Any, where: str) -> list[str]:
    if isinstance(want, dict) and isinstance(got, dict):
        found = [f"{where}.{k}: missing" for k in want if k not in got]
        found += [f"{where}.{k}: new" for k in got if k not in want]
        for k in want.keys() & got.keys():
            found += _differences(got[k], want[k], f"{where}.{k}")
        return found
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True))
                for d in _differences(g, w, f"{where}[{i}]")]
    if (isinstance(want, float) and isinstance(got, (int, float))
            and not isinstance(got, bool)):
        same = math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-300) or got == want
        return [] if same else [f"{where}: {got!r} != {want!r}"]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def test_planner_output_is_pinned() -> None:
    want = json.loads(PINNED.read_text())
    got = current()
    # every shipped row (the 101 pinned before the techniques' costs moved and DeepSeek-V3's,
    # and the 94 FP8 / MoE / scale rows added on 2026-11-28) and the four H200 rows
    with SHIPPED.open(newline="") as f:
        rows = sum(1 for _ in csv.DictReader(f))
    assert len(want["published"]) == rows >= 195 and len(want["h200"]) == 4
    predicted = [r for r in want["published"].values() if "reason" not in r]
    assert len(predicted) >= 180  # the file pins predictions, not only reasons
    diffs = _differences(got, want, "planner")
    assert not diffs, f"{len(diffs)} pinned planner numbers moved, first ones:\n" + "\n".join(
        diffs[:20])


def test_the_comparison_sees_a_moved_number() -> None:
    want = {"a": {"b": [1.0, 2.0], "c": "x"}}
    assert not _differences({"a": {"b": [1.0, 2.0 * (1 + 1e-14)], "c": "x"}}, want, "p")
    assert _differences({"a": {"b": [1.0, 2.0 * (1 + 1e-9)], "c": "x"}}, want, "p")
    assert _differences({"a": {"b": [1.0], "c": "x"}}, want, "p")
    assert _differences({"a": {"b": [1.0, 2.0], "c": "y"}}, want, "p")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_planner_pinned.py --write")
    PINNED.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED}")
