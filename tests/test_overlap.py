"""DualPipeV's overlapped pairs run as two lanes taking turns (``parallel/overlap.py``).

- the turn-taking itself, with stand-in handles: a lane runs until it waits for an issued
  collective, the other lane runs meanwhile, the order is the same every time, a finished lane
  hands the turn over for good, a failing lane's error reaches the caller;
- the frontier MoE (MLA, multi-token prediction, sigmoid group-limited routing, document
  masking) under DualPipeV with pp 2 x dp 2 x ep 2 (world 4, NCCL-semantics mode; also with
  full recomputation, with ZeRO-3, and with tp 2 + sp in world 8; and with compiled
  blocks): the pairs
  overlap on every rank (the timeline's forward and backward spans intersect, and a backward's
  expert all-to-all is issued while the forward of the pair is still running), and the run
  matches one process (losses, MTP losses, gradient norms and final weights within 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_schedules_v import FRONTIER, assert_matches, schedule_args

from meshlm.config import load_config
from meshlm.distributed import nccl_semantics
from meshlm.parallel import overlap
from meshlm.testing import run_world, train_runs
from meshlm.train.trainer import train


class _Handle:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def _lanes(log: list[str], f_waits: int, b_waits: int) -> tuple:
    def forward() -> None:
        for i in range(f_waits):
            log.append(f"F compute {i}")
            overlap.wait(_Handle(log, f"F{i}"))
        log.append("F end")

    def backward() -> None:
        for i in range(b_waits):
            log.append(f"B compute {i}")
            overlap.wait(_Handle(log, f"B{i}"))
        log.append("B end")
    return forward, backward


def test_lanes_take_turns_at_their_waits() -> None:
    log: list[str] = []
    overlap.EXPOSED.reset()
    overlap.run_pair(*_lanes(log, 2, 3))
    assert log == ["F compute 0",  # F issues its first collective and hands the turn over
                   "B compute 0",  # B computes while F0 is in flight, then issues B0
                   "wait F0", "F compute 1", "wait B0", "B compute 1", "wait F1", "F end",
                   "wait B1", "B compute 2", "wait B2", "B end"]  # (F finished: B alone)
    # (exactly that order, every time: the order of the ranks' collectives)
    again: list[str] = []
    overlap.run_pair(*_lanes(again, 2, 3))
    assert again == log
    assert overlap.EXPOSED.count == 10 and not overlap.in_pair()


def test_a_lane_without_collectives_runs_whole() -> None:
    log: list[str] = []
    overlap.run_pair(*_lanes(log, 0, 2))
    assert log == ["F end", "B compute 0", "wait B0", "B compute 1", "wait B1", "B end"]


def test_a_failing_backward_reaches_the_caller() -> None:
    log: list[str] = []

    def backward() -> None:
        log.append("B")
        raise ValueError("broken backward")

    with pytest.raises(ValueError, match="broken backward") as info:
        overlap.run_pair(lambda: overlap.wait(_Handle(log, "F0")), backward)
    assert log == ["B", "wait F0"] and info.value.meshlm_phase == "backward"


def _base(short_docs: Path, cache_dir: Path) -> list[str]:
    return [f"--data.path={short_docs}", f"--data.cache_dir={cache_dir}",
            "--data.vocab_size=512", "--data.seq_len=64", "--train.steps=3",
            "--train.global_batch=8", "--train.micro_batch=4", "--train.warmup_steps=1",
            "--train.eval_every=0", "--run.sample_tokens=0", "--train.peak_flops=1e10",
            "--train.eps=1e-5", *FRONTIER]


def test_frontier_moe_dualpipev_overlaps_expert_all_to_alls(
        short_docs: Path, cache_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    base = _base(short_docs, cache_dir)
    train(load_config(None, [*base, f"--run.dir={tmp_path / 'ref'}"]), log=lambda _m: None,
          progress=False)
    layout = [*schedule_args("dualpipev", 2, 1), "--parallel.dp=2", "--parallel.ep=2"]
    named = {"dualpipev": [],  # (the backward lane recomputes, with its own all-to-alls)
             "dualpipev-recompute": ["--train.recompute=full"],
             "dualpipev-zero3": ["--parallel.zero=3"]}  # (dp gathers and reduce-scatters)
    monkeypatch.setenv(nccl_semantics.ENV, "1")
    run_world(4, train_runs, base, [[*layout, *args, f"--run.dir={tmp_path / name}"]
                                    for name, args in named.items()])
    # tp 2 + sp inside each ep rank (world 8): tp's collectives in both lanes, in turn
    named["dualpipev-tp2"] = ["--parallel.tp=2", "--parallel.sp=true"]
    run_world(8, train_runs, base, [[*layout, *named["dualpipev-tp2"],
                                     f"--run.dir={tmp_path / 'dualpipev-tp2'}"]])
    for name in named:
        assert_matches(tmp_path / name, tmp_path / "ref", keys=("loss", "mtp_loss",
                                                                "grad_norm"))
        for r in range(4):
            path = tmp_path / name / "timeline" / f"rank_{r:04d}.json"
            acts = json.loads(path.read_text())["actions"]
            pairs = [(f, b) for f, b in zip(acts, acts[1:], strict=False)
                     if f["op"] == "F" and b["op"] in ("B", "I") and b["start"] < f["end"]]
            assert pairs, f"{name}, rank {r}: no forward overlapped a backward"


def test_compiled_blocks_under_overlapped_dualpipev(short_docs: Path, cache_dir: Path,
                                                    tmp_path: Path) -> None:
    """``train.compile``: the compiled blocks run in both lanes (the backward lane's thread
    runs compiled backwards) and match the eager one-process run; so does ZB-V compiled (its
    I/W split through split linears)."""
    base = _base(short_docs, cache_dir)
    train(load_config(None, [*base, f"--run.dir={tmp_path / 'ref'}"]), log=lambda _m: None,
          progress=False)
    names = ("dualpipev", "zbv")
    run_world(4, train_runs, base, [[*schedule_args(s, 2, 1), "--parallel.dp=2",
                                     "--parallel.ep=2", "--train.compile=true",
                                     f"--run.dir={tmp_path / s}"] for s in names])
    for s in names:
        assert_matches(tmp_path / s, tmp_path / "ref", keys=("loss", "mtp_loss", "grad_norm"))
