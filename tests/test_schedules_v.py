"""The newer pipeline schedules -- ZB-V, DualPipeV (two chunks per rank in a V), looped BFS and
interleaved zero bubble -- and AFAB's early receives.

Tables, checked without running a model (``simulate`` checks every pp and micro-batch count in
tests/test_schedules.py); then against the one-process reference (fp32; losses, gradient norms
and final weights within 1e-5, as every parity test):

- world 2, NCCL-semantics mode: every new schedule at pp 2; ZB-V with a tied head; DualPipeV
  under fp8 with full recomputation; a checkpoint saved under 1F1B resumed under ZB-V, and one
  saved under ZB-V resumed under 1F1B;
- world 4, NCCL-semantics mode: every new schedule and AFAB at pp 4;
- world 4: pp 2 under the new schedules with tp 2 + sp, dp 2 ZeRO-3, every cp mode (with full
  recomputation), dp 2 ZeRO-3 with offloaded optimizer states, and HSDP;
- the frontier MoE of tests/test_frontier_parity.py (MLA, multi-token prediction, sigmoid
  routing): pp 2 ZB-V with dp 2 x ep 2 (world 4) and pp 2 DualPipeV (world 2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from meshlm.config import ConfigError, load_config
from meshlm.distributed import nccl_semantics
from meshlm.parallel.schedules import (
    build_schedule,
    format_table,
    is_p2p,
    overlapped_pairs,
    rank_stages,
    simulate,
    stage_rank,
    tables_from_order,
)
from meshlm.testing import cli, final_weights, max_relative_difference, run_world, train_runs
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

NEW = ("zbv", "dualpipev", "bfs", "interleaved-zb")
STEPS, HALF = 4, 2


# ---------------------------------------------------------------------- tables
def test_placement_is_one_function_of_the_schedule() -> None:
    assert [stage_rank("zbv", s, 4) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert rank_stages("dualpipev", 0, 4, 2) == [0, 7]  # embedding and head on rank 0
    assert rank_stages("bfs", 1, 4, 3) == [1, 5, 9] == rank_stages("interleaved", 1, 4, 3)
    assert rank_stages("1f1b", 2, 4, 1) == [2]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_the_turn_of_the_v_stays_on_its_rank(schedule: str) -> None:
    """Stage p - 1 -> p is on rank p - 1: handed over in memory, never sent."""
    pp, m = 4, 8
    tables = build_schedule(schedule, pp, m, 2)
    for r, acts in enumerate(tables):
        for a in acts:
            if is_p2p(a):
                assert stage_rank(schedule, a.stage, pp) == r
                step = (1 if a.op[-1] == "F" else -1) * (1 if a.op.startswith("SEND") else -1)
                assert a.peer != r and {a.stage, a.stage + step} != {pp - 1, pp}, a
    # rank 0 runs the first and the last stage
    assert {a.stage for a in tables[0] if a.op == "F"} == {0, 2 * pp - 1}


def test_dualpipev_pairs_a_forward_with_another_backward() -> None:
    pp, m = 4, 10
    tables = build_schedule("dualpipev", pp, m, 2)
    for acts in tables:
        pairs = overlapped_pairs(acts)
        assert pairs, format_table([acts])
        for f, b in pairs:
            assert f.op == "F" and b.op == "B" and f.mb != b.mb and f.stage != b.stage
            i = acts.index(b)
            assert acts[i - 1] == f  # nothing between the two halves of a pair
    assert str(overlapped_pairs(tables[0])[0][1]).startswith("+B")


def test_bfs_runs_each_stage_s_backwards_back_to_back() -> None:
    """Each virtual stage's gradients are complete at its last backward: a stage's backwards
    are consecutive on its rank (all forwards of a chunk before the next chunk's)."""
    pp, m, v = 4, 6, 3
    for acts in build_schedule("bfs", pp, m, v):
        order = [(a.op, a.stage) for a in acts if a.op in ("F", "B")]
        runs = [x for i, x in enumerate(order) if i == 0 or order[i - 1] != x]
        assert len(runs) == 2 * v and len(set(runs)) == 2 * v, runs


def test_interleaved_zb_defers_weight_gradients() -> None:
    tables = build_schedule("interleaved-zb", 4, 8, 2)
    for r, acts in enumerate(tables):
        ops = [a.op for a in acts if not is_p2p(a)]
        assert "B" not in ops and ops.count("I") == ops.count("W") == 16
        # rank r runs r + 1 input-gradient passes before its first weight-gradient pass
        assert ops[: ops.index("W")].count("I") == r + 1
    one_f_one_b = simulate(build_schedule("interleaved", 4, 8, 2), 2)["bubble"]
    assert simulate(build_schedule("interleaved-zb", 4, 8, 2), 2)["bubble"] < one_f_one_b / 2


def test_afab_receives_early_each_in_a_group_of_its_own() -> None:
    """AFAB posts the next micro-batch's receive before the current compute, a group per
    message: with a transfer latency below a forward's time the stages run back to back
    (the last stage's forwards end at m + (p - 1)(1 + latency), the ideal), where receiving
    after the previous forward loses the latency per micro-batch."""
    pp, m, latency = 4, 8, 0.25
    early, late = build_schedule("afab", pp, m), tables_from_order("afab", pp, m)
    last = early[-1]
    assert [str(a) for a in last[:3]] == ["|RECV_F0s3<-2", "|RECV_F1s3<-2", "F0s3"]
    assert all(a.new_group for acts in early for a in acts if is_p2p(a))
    fast, slow = simulate(early, latency=latency), simulate(late, latency=latency)
    forwards_end = max(e for a, _, e in fast["intervals"][-1] if a.op == "F")
    assert forwards_end == pytest.approx(m + (pp - 1) * (1 + latency))
    assert fast["time"] == pytest.approx(3 * (m + pp - 1) + 2 * (pp - 1) * latency)
    assert fast["time"] < slow["time"]
    assert simulate(early)["time"] == 3 * (m + pp - 1)  # the ideal without latency


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("overrides, message", [
    (["--parallel.pp_schedule=zbv", "--parallel.pp_virtual=1", "--model.n_layers=4"],
     "parallel.pp_schedule=zbv places exactly 2 model chunks per rank in a V (rank r holds "
     "stages r and 2 * pp - 1 - r): it needs parallel.pp_virtual=2, not 1"),
    (["--parallel.pp_schedule=dualpipev", "--parallel.pp_virtual=2", "--model.n_layers=5"],
     "parallel.pp * pp_virtual = 4 stages do not divide model.n_layers=5 "
     "(parallel.pp_schedule=dualpipev places them in a V; give parallel.pp_layers for an "
     "uneven split)"),
    (["--parallel.pp_schedule=dualpipev", "--parallel.pp_virtual=2", "--model.n_layers=4",
      "--train.micro_batch=4"],
     "the dualpipev schedule needs at least 2 * parallel.pp (4) micro-batches per step, not 2"),
    (["--parallel.pp_schedule=bfs", "--parallel.pp_virtual=2", "--model.n_layers=4",
      "--train.micro_batch=8"],
     "the bfs schedule needs at least parallel.pp (2) micro-batches per step, not 1"),
    (["--parallel.pp_schedule=bfs", "--parallel.pp_virtual=1"],
     "the bfs schedule needs parallel.pp_virtual >= 2"),
    (["--parallel.pp_schedule=interleaved-zb", "--parallel.pp_virtual=2", "--model.n_layers=4",
      "--train.micro_batch=8", "--train.global_batch=24"],
     "the interleaved-zb schedule needs micro-batches (3) divisible by parallel.pp (2)"),
])
def test_bad_schedule_input_is_one_line(overrides: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model.preset=tiny", "--parallel.pp=2", "--train.global_batch=8", *overrides]
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, args)
    assert message in str(err.value), str(err.value)
    rc, lines = cli(["train", "--dry-run", *args], capsys)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("meshlm: error:"), lines
    assert message in lines[0]


def test_v_schedule_with_an_explicit_uneven_split_is_accepted() -> None:
    cfg = load_config(None, ["--model.preset=tiny", "--model.n_layers=5", "--parallel.pp=2",
                             "--parallel.pp_schedule=zbv", "--parallel.pp_virtual=2",
                             "--parallel.pp_layers=1,2,1,1", "--train.global_batch=8"])
    assert cfg.parallel.pp_schedule == "zbv"


@pytest.mark.parametrize("schedule", NEW)
def test_schedule_command_draws_the_new_schedules(schedule: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / f"{schedule}.png"
    rc, _ = cli(["schedule", "--schedule", schedule, "--pp", "4", "--microbatches", "8",
                 "--plot", str(png)], capsys)
    assert rc == 0 and png.stat().st_size > 0


# ---------------------------------------------------------------------- parity
def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
        "--train.global_batch=8", "--train.warmup_steps=2", "--train.eval_every=0",
        "--run.sample_tokens=0", "--train.peak_flops=1e10", "--train.grad_clip=0.5",
        "--train.eps=1e-6", f"--train.checkpoint_every={HALF}",  # (see tests/test_pipeline.py)
    ]


def schedule_args(schedule: str, pp: int, micro: int) -> list[str]:
    v = 1 if schedule in ("afab", "1f1b") else 2
    return [f"--parallel.pp={pp}", f"--parallel.pp_schedule={schedule}",
            f"--parallel.pp_virtual={v}", f"--train.micro_batch={micro}"]


def cut_copy(src: Path, dst: Path, keep_step: int) -> None:
    """``dst``: the run ``src`` as it was after checkpoint ``keep_step``."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").iterdir():
        if int(ckpt.name.split("_")[1]) > keep_step:
            shutil.rmtree(ckpt)


def runs_then_resumes(base: list[str], runs: list[list[str]],
                      resumes: list[tuple[Path, Path, list[str]]]) -> dict:
    """World body: the runs, then each (source run, copy, layout) resumed from the source's
    step-HALF checkpoint on another layout."""
    import time

    import torch.distributed as dist

    out: dict = {"runs": train_runs(base, runs), "resumed": []}
    for src, dst, layout in resumes:
        # (NCCL-semantics mode refuses a bare barrier: rank 0 copies, the others see it done)
        ready = dst.with_name(dst.name + ".ready")
        if dist.get_rank() == 0:
            cut_copy(src, dst, HALF)
            ready.touch()
        while not ready.exists():
            time.sleep(0.05)
        out["resumed"].append(train_runs(base, [[*layout, f"--run.dir={dst}",
                                                 "--run.resume=true"]])[0])
    return out


def _records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def assert_matches(run: Path, ref: Path, keys: tuple[str, ...] = ("loss", "grad_norm")) -> None:
    got, want = _records(run), _records(ref)
    assert sorted(got) == sorted(want), run.name
    for key in keys:
        worst = max(abs(got[s][key] - want[s][key]) / abs(want[s][key]) for s in want)
        assert worst < 1e-5, (run.name, key, worst)
    worst, name = max_relative_difference(final_weights(run), final_weights(ref))
    assert worst < 1e-5, (run.name, name, worst)


TIED = ["--model.n_layers=4", "--model.tie_embeddings=true"]
# (clipping off: a pipeline adds the squared gradient norm stage by stage, so its clip scale
# differs from one process's by fp32 rounding, which a float8 cast can turn into a whole
# float8 step of a weight -- tests/test_fp8.py, its ZeRO rows)
FP8 = ["--model.n_layers=4", "--precision.dtype=fp8", "--precision.fp8_rest=fp32",
       "--train.grad_clip=0"]
REFERENCES = {"ref4": ["--model.n_layers=4"], "ref8": ["--model.n_layers=8"], "ref4-tied": TIED,
              "ref4-fp8": [*FP8, "--train.micro_batch=2"]}


@pytest.fixture(scope="module")
def plain(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One-process references of the tiny model: 4 layers, 8 layers, 4 with a tied head, 4
    under fp8 (tensorwise, the rest fp32), in micro-batches of 2 as the pipeline (a float8
    scale is the amax of its micro-batch)."""
    root = tmp_path_factory.mktemp("schedules-v")
    base = base_args(corpus_dir, cache_dir)
    for name, extra in REFERENCES.items():
        train(load_config(None, [*base, "--train.micro_batch=8", *extra,
                                 f"--run.dir={root / name}"]),
              log=lambda _m: None, progress=False)
    return base, root


def test_pp2_schedules_and_reshard_between_schedules(plain, monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:  # noqa: ANN001
    """pp 2, 4 layers, NCCL-semantics mode: every new schedule (4 micro-batches; ZB-V also 2);
    ZB-V with a tied head (both ends on rank 0: one table, nothing summed across ranks) and
    under fp8 with recomputation; a 1F1B checkpoint resumed under ZB-V and a ZB-V one under
    1F1B continue the source run's losses."""
    base, root = plain
    layers = ["--model.n_layers=4"]
    named = {f"pp2-{s}": [*layers, *schedule_args(s, 2, 2)] for s in NEW}
    named["pp2-zbv-m2"] = [*layers, *schedule_args("zbv", 2, 4)]
    named["pp2-1f1b"] = [*layers, *schedule_args("1f1b", 2, 2)]
    refs = dict.fromkeys(named, "ref4")
    named["pp2-zbv-tied"], refs["pp2-zbv-tied"] = [*TIED, *schedule_args("zbv", 2, 2)], "ref4-tied"
    named["pp2-dualpipev-fp8"] = [*FP8, *schedule_args("dualpipev", 2, 2),
                                  "--train.recompute=full"]
    refs["pp2-dualpipev-fp8"] = "ref4-fp8"
    runs = [[*args, f"--run.dir={root / name}"] for name, args in named.items()]
    resumes = [(root / "pp2-1f1b", root / "1f1b-to-zbv", named["pp2-zbv"]),
               (root / "pp2-zbv", root / "zbv-to-1f1b", named["pp2-1f1b"])]
    monkeypatch.setenv(nccl_semantics.ENV, "1")
    out = run_world(2, runs_then_resumes, base, runs, resumes)[0]
    for name in named:
        assert_matches(root / name, root / refs[name])
    weights = final_weights(root / "pp2-zbv-tied")
    assert "output.weight" not in weights  # one table, saved once
    full = dict(zip(named, out["runs"], strict=True))
    for (src, _, _), resumed in zip(resumes, out["resumed"], strict=True):
        assert sorted(resumed) == list(range(HALF + 1, STEPS + 1)), src.name
        for step, loss in resumed.items():
            assert abs(loss - full[src.name][step]) / full[src.name][step] < 1e-5, (src.name, step)
    for _, dst, _ in resumes:
        worst, tensor = max_relative_difference(final_weights(dst), final_weights(root / "ref4"))
        assert worst < 1e-5, (dst.name, tensor, worst)


def test_pp4_schedules(plain, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """pp 4, 8 layers (8 stages), NCCL-semantics mode: every new schedule, and AFAB with its
    early receives; 8 micro-batches (DualPipeV's minimum), 4 for BFS."""
    base, root = plain
    named = {f"pp4-{s}": ["--model.n_layers=8", *schedule_args(s, 4, 1)] for s in NEW}
    named["pp4-bfs-m4"] = ["--model.n_layers=8", *schedule_args("bfs", 4, 2)]
    named["pp4-afab"] = ["--model.n_layers=8", *schedule_args("afab", 4, 1)]
    runs = [[*args, f"--run.dir={root / name}"] for name, args in named.items()]
    monkeypatch.setenv(nccl_semantics.ENV, "1")
    run_world(4, train_runs, base, runs)
    for name in named:
        assert_matches(root / name, root / "ref8")
    for name, stages, ops in (("pp4-zbv", {0, 7}, {"F", "I", "W"}),
                              ("pp4-dualpipev", {0, 7}, {"F", "B", "I", "W"}),
                              ("pp4-bfs", {0, 4}, {"F", "B"})):
        actions = json.loads((root / name / "timeline" / "rank_0000.json").read_text())["actions"]
        assert {a["stage"] for a in actions} == stages and {a["op"] for a in actions} == ops
    records = read_metrics(root / "pp4-afab" / "metrics.jsonl")
    assert records[-1]["pp_peak_live"] == 8  # AFAB: every micro-batch alive on stage 0


def test_schedules_compose_with_tp_dp_cp(plain) -> None:  # noqa: ANN001
    """World 4, pp 2, 4 layers: ZB-V with tp 2 + sp, DualPipeV with dp 2 ZeRO-3, ZB-V with
    cp 2 (zigzag) and full recomputation, interleaved zero bubble with cp 2 (ring), DualPipeV
    with cp 2 (Ulysses), looped BFS
    with dp 2 ZeRO-3 and the optimizer states offloaded to the host, and with HSDP (dp 2 of
    shard groups of 1)."""
    base, root = plain
    layers = ["--model.n_layers=4"]
    named = {
        "zbv-tp2-sp": [*schedule_args("zbv", 2, 2), "--parallel.tp=2", "--parallel.sp=true"],
        "dualpipev-zero3": [*schedule_args("dualpipev", 2, 1), "--parallel.dp=2",
                            "--parallel.zero=3"],
        "zbv-cp2-full": [*schedule_args("zbv", 2, 2), "--parallel.cp=2",
                         "--parallel.cp_attention=zigzag", "--train.recompute=full"],
        "interleaved-zb-ring": [*schedule_args("interleaved-zb", 2, 2), "--parallel.cp=2",
                                "--parallel.cp_attention=ring"],
        "dualpipev-ulysses": [*schedule_args("dualpipev", 2, 2), "--parallel.cp=2",
                              "--parallel.cp_attention=ulysses"],
        "bfs-zero3-offload": [*schedule_args("bfs", 2, 2), "--parallel.dp=2", "--parallel.zero=3",
                              "--parallel.offload=cpu"],
        "bfs-hsdp": [*schedule_args("bfs", 2, 2), "--parallel.dp=2", "--parallel.dp_shard=1",
                     "--parallel.zero=3"],
    }
    runs = [[*layers, *args, f"--run.dir={root / name}"] for name, args in named.items()]
    run_world(4, train_runs, base, runs)
    for name in named:
        assert_matches(root / name, root / "ref4")


FRONTIER = [
    "--model.preset=tiny-moe", "--model.n_layers=4", "--model.moe_first_dense=1",
    "--model.n_heads=4", "--model.n_kv_heads=4", "--model.q_lora_rank=32",
    "--model.kv_lora_rank=16", "--model.qk_nope_head_dim=16", "--model.qk_rope_head_dim=8",
    "--model.v_head_dim=16", "--model.moe_score=sigmoid", "--model.moe_n_group=2",
    "--model.moe_topk_group=1", "--model.moe_routed_scale=2.5", "--model.moe_balance=bias",
    "--model.moe_bias_rate=0.01", "--model.mtp_depth=1", "--model.mtp_loss_weight=0.3",
    "--data.doc_mask=true",
]


def test_frontier_moe_with_mtp_under_v_schedules(short_docs: Path, cache_dir: Path,
                                                 tmp_path: Path) -> None:
    """The frontier MoE (tests/test_frontier_parity.py, 4 layers): the head and multi-token
    prediction sit on rank 0 with the embedding. pp 2 x dp 2 x ep 2 under ZB-V (world 4) and
    pp 2 under DualPipeV (world 2) match one process: losses, MTP losses, weights."""
    base = [f"--data.path={short_docs}", f"--data.cache_dir={cache_dir}",
            "--data.vocab_size=512", "--data.seq_len=64", "--train.steps=3",
            "--train.global_batch=8", "--train.micro_batch=4", "--train.warmup_steps=1",
            "--train.eval_every=0", "--run.sample_tokens=0", "--train.peak_flops=1e10",
            "--train.eps=1e-5", *FRONTIER]
    train(load_config(None, [*base, f"--run.dir={tmp_path / 'ref'}"]), log=lambda _m: None,
          progress=False)
    ep = [*schedule_args("zbv", 2, 2), "--parallel.dp=2", "--parallel.ep=2",
          f"--run.dir={tmp_path / 'zbv-ep2'}"]
    run_world(4, train_runs, base, [ep])
    run_world(2, train_runs, base, [[*schedule_args("dualpipev", 2, 2),
                                     f"--run.dir={tmp_path / 'dualpipev'}"]])
    for name in ("zbv-ep2", "dualpipev"):
        assert_matches(tmp_path / name, tmp_path / "ref", keys=("loss", "mtp_loss"))
