"""From ``meshlm plan`` to ``meshlm train`` (issue 52): each planned layout comes with the
``meshlm train`` arguments that run it, and ``meshlm train <args> --dry-run --gpu KIND`` resolves
the plan's layout and prints the plan's memory. Both sides read one memory model
(``planner/memory.py``) with the same workload, layout and accelerator, so the memory is compared
for equality, byte for byte -- no tolerance. Also: the plan's and the dry run's first lines state
the vocabulary and precision they assume, and where the two differ. Single process, no torch
run; a few seconds."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from meshlm.cli import main
from meshlm.config import load_config
from meshlm.layout import RECOMPUTE, Layout
from meshlm.planner import (
    Accelerator,
    ModelSpec,
    Plan,
    Workload,
    evaluate,
    get_accelerator,
    memory,
    search,
)
from meshlm.planner.cli import build_workload, config_vocab, config_workload
from meshlm.planner.train_args import declared_keys, train_args, train_gaps
from meshlm.planner.workload import load_model_spec, parse_layout

GIB = 2**30


def _size(x: float) -> str:
    """As the dry run prints a size (planner/cli.py's ``_size``)."""
    return f"{x / GIB:.2f} GiB" if x >= GIB else f"{x / 2**20:.1f} MiB"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, (argv, out.err[-2000:])
    return out.out


def _plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(_run(["plan", *argv, "--json"], capsys))


def _layout_of(entry: dict) -> Layout:
    return Layout(**{k: entry[k] for k in Layout().as_dict()})


def _check_dry_run(plan: dict, entry: dict, gpu: str, tmp_path: Path,
                   capsys: pytest.CaptureFixture[str]) -> None:
    """``meshlm train <entry's train_args> --dry-run --gpu GPU``: its output is TOML and
    comments only; the config it resolved has the plan's layout, and the planner's memory of it
    is the plan's, item by item; the printed peak is the plan's total; the model line counts the
    plan's parameters."""
    assert entry["train_gaps"] == [], entry["train_gaps"]
    assert {a[2:].partition("=")[0] for a in entry["train_args"]} <= declared_keys()
    out = _run(["train", *entry["train_args"], "--dry-run", "--gpu", gpu], capsys)
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(out)
    tomllib.loads(out)  # (the model line and the memory lines are comments)
    cfg = load_config(resolved)
    assert cfg.layout() == _layout_of(entry), (entry["layout"], cfg.layout().describe())
    want = {**entry["memory_bytes"]}
    total = want.pop("total")
    got = memory(config_workload(cfg, config_vocab(cfg)), cfg.layout(), get_accelerator(gpu))
    assert got.items == want and got.total == total
    peak = next(ln for ln in out.splitlines() if ln.startswith("#   peak"))
    assert f": {_size(total)} of " in peak, (peak, _size(total))
    n = plan["params"]
    count = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else \
        f"{n / 1e3:.2f} K"
    model_line = out.splitlines()[0]
    assert f"{count} parameters at vocabulary {plan['vocab_size']:,} (the model's own)" in \
        model_line, model_line


@pytest.mark.parametrize("argv,gpu", [
    (["--model", "small", "--gpus", "8", "--gpu", "cpu", "--top", "4"], "cpu"),
    (["--model", "tiny-moe", "--gpus", "8", "--gpu", "h100-sxm", "--seq-len", "256",
      "--global-batch-tokens", "8192", "--top", "4"], "h100-sxm"),
    # the case: the plan counts 8.03 B parameters, and now so does the dry run
    (["--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-sxm", "--top", "1"], "h100-sxm"),
    # pipeline, sequence parallelism, recomputation, ZeRO-1: the breakdown of one layout
    (["--model", "small", "--gpus", "8", "--gpu", "h100-sxm", "--layout",
      "tp=2,sp,pp=2,dp=2,zero=1,mbs=2,recompute=selective,schedule=interleaved,vpp=2"],
     "h100-sxm"),
    (["--model", "tiny-moe", "--gpus", "8", "--gpu", "a100-80gb", "--seq-len", "128",
      "--global-batch-tokens", "4096", "--layout", "dp=4,cp=2,ep=4,zero=2,mbs=4,recompute=full"],
     "a100-80gb"),
])
def test_a_planned_layout_dry_runs_to_the_plans_layout_and_memory(
        argv: list[str], gpu: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(argv, capsys)
    for entry in plan.get("plans", [plan]):
        _check_dry_run(plan, entry, gpu, tmp_path, capsys)


FEATURES = {
    "pp": lambda lo: lo.pp > 1, "interleaved": lambda lo: lo.pp_schedule == "interleaved",
    "zb": lambda lo: lo.pp_schedule == "zb", "tp": lambda lo: lo.tp > 1, "sp": lambda lo: lo.sp,
    "cp": lambda lo: lo.cp > 1, "ep": lambda lo: lo.ep > 1, "hybrid": lambda lo: lo.hybrid,
    "zero3": lambda lo: lo.zero == 3, "recompute": lambda lo: lo.recompute != "none",
}


def _variants(work: Workload, plan: Plan, gpus: int, hw: Accelerator) -> list[Plan]:
    """The layouts one change away from ``plan``'s in what the search sets after the split:
    each recomputation mode, each ZeRO stage with each hybrid shard group (those that are
    valid; whether they fit plays no part here)."""
    lo = plan.layout
    out = [dataclasses.replace(lo, recompute=r) for r in RECOMPUTE if r != lo.recompute]
    if lo.dp > 1:
        out += [dataclasses.replace(lo, zero=z, dp_shard=d) for z in (1, 2, 3)
                if lo.pp == 1 or z == 1 for d in range(lo.dp) if d == 0 or lo.dp % d == 0]
    return [q for q in (evaluate(work, v, hw, gpus) for v in out) if not q.problems]


@pytest.mark.parametrize("model,gpus,gpu,seq,tokens,features", [
    ("small", 8, "h100-sxm", 256, 2**14, ("tp", "sp", "cp")),
    ("small", 8, "cpu", 256, 2**13, ("pp", "interleaved", "zb")),
    ("tiny-moe", 8, "h100-sxm", 128, 2**12, ("ep", "cp", "pp")),
    ("deepseek-v2-lite", 16, "h100-sxm", 4096, 2**21, ("ep",)),
])
def test_every_listed_layout_is_a_valid_config_of_the_same_layout_and_memory(
        model: str, gpus: int, gpu: str, seq: int, tokens: int,
        features: tuple[str, ...]) -> None:
    """The layouts of a ranking, the best few with each of ``features`` and their variants in
    recomputation, ZeRO stage and hybrid shard group: each one's words load, as the config of
    the same layout and the same memory."""
    hw = get_accelerator(gpu)
    work = build_workload(load_model_spec(model), hw, seq, tokens, None, "fp32")
    plans = search(work, gpus, hw, top=10)
    assert len(plans) == 10
    for name in features:
        found = search(work, gpus, hw, top=2, allowed=FEATURES[name])
        assert found, name
        plans += found
    plans += [v for p in plans for v in _variants(work, p, gpus, hw)]
    for name in ("recompute", "hybrid", "zero3"):
        assert any(FEATURES[name](p.layout) for p in plans), name
    for p in plans:
        assert train_gaps(work, p.layout) == []
        cfg = load_config(None, train_args(work, p.layout))
        assert cfg.layout() == p.layout, p.layout.describe()
        assert memory(config_workload(cfg, config_vocab(cfg)), cfg.layout(), hw).items == \
            p.memory.items, p.layout.describe()


def test_a_published_model_is_written_as_the_nearest_preset_and_its_changes(
        capsys: pytest.CaptureFixture[str]) -> None:
    """llama2-7b is not a preset: a preset and the shape fields that differ from it, with the
    model's vocabulary, give the plan's model (its parameter count and memory)."""
    plan = _plan(["--model", "llama2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--top", "1"],
                 capsys)
    entry = plan["plans"][0]
    assert any(a.startswith("--model.ffn_hidden=") for a in entry["train_args"])
    assert "--data.vocab_size=32000" in entry["train_args"]
    cfg = load_config(None, entry["train_args"])
    assert ModelSpec(cfg.model_config(config_vocab(cfg))).num_params() == plan["params"]
    assert memory(config_workload(cfg, config_vocab(cfg)), cfg.layout(),
                  get_accelerator("a100-80gb")).total == entry["memory_bytes"]["total"]


def test_what_meshlm_train_cannot_do_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """The ZeRO paper's 16-bit states, a fused cross-entropy, a GELU MLP: the words still load
    (meshlm's nearest run), and the plan says they are not the plan's."""
    argv = ["--model", "gpt3-1.3b", "--gpus", "8", "--gpu", "a100-80gb", "--states", "mixed",
            "--loss", "fused", "--top", "2"]
    plan = _plan(argv, capsys)
    for entry in plan["plans"]:
        gaps = " | ".join(entry["train_gaps"])
        assert "--states mixed" in gaps and "--loss fused" in gaps and "GELU" in gaps, gaps
        load_config(None, entry["train_args"])
    text = _run(["plan", *argv], capsys)
    assert "these run meshlm's nearest equivalent, not the plan: --states mixed" in text
    # what the config can give is given: chunked loss, compiled kernels, foreach AdamW, fp8
    hw = get_accelerator("h100-sxm")
    work = build_workload(load_model_spec("small"), hw, 256, 4096, "fp8", "fp32",
                          loss="chunked", kernels="fused", optimizer="foreach")
    lo = parse_layout("dp=4,zero=1,mbs=4")
    words = train_args(work, lo)
    assert {"--train.loss=chunked", "--train.compile=true", "--train.adamw_impl=foreach",
            "--precision.dtype=fp8"} <= set(words)
    assert train_gaps(work, lo) == []


def test_the_first_lines_state_vocabulary_batch_and_precision(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The plan's first line: the vocabulary it counts, the batch in tokens, the precision and
    where meshlm train's defaults differ; the dry run's first line: its own vocabulary and
    precision against what meshlm plan counts. Each train line carries the plan's."""
    text = _run(["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-sxm",
                 "--top", "2"], capsys)
    first = text.splitlines()[0]
    for part in ("8.03 B params at vocabulary 128,256", "512 seqs (1,048,576 tokens)", "bf16",
                 "meshlm train's defaults differ (fp32, seq 256, 16 seqs, a 4,096-entry BPE "
                 "vocabulary)"):
        assert part in first, first
    lines = [ln.split(None, 1)[1] for ln in text.splitlines()
             if ln.strip()[:1].isdigit() and "meshlm train" in ln]
    assert len(lines) == 2
    assert all("--data.vocab_size=128256" in ln and "--precision.dtype=bf16" in ln
               and "--data.seq_len=2048" in ln and "--train.global_batch=512" in ln
               for ln in lines), lines
    # the cpu plan's defaults are train's: nothing to say
    text = _run(["plan", "--model", "small", "--gpus", "2", "--gpu", "cpu", "--top", "1"], capsys)
    assert "defaults differ" not in text.splitlines()[0]
    # the dry run of the preset with train's defaults: 7.01 B at the BPE's 4,096 ids, fp32
    out = _run(["train", "--dry-run", "--model.preset=llama3-8b"], capsys)
    line = next(ln for ln in out.splitlines() if ln.startswith("# model"))
    for part in ("7.01 B parameters at vocabulary 4,096", "publishes 128,256",
                 "meshlm plan counts: 8.03 B", "set data.vocab_size=128256",
                 "precision fp32 (meshlm train's default; meshlm plan's on GPUs: bf16)"):
        assert part in line, line


def test_gpu_needs_dry_run_and_a_known_accelerator(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
            (["train", "--gpu", "h100-sxm", "--model.preset=tiny"], "it needs --dry-run"),
            (["train", "--dry-run", "--gpu", "x100", "--model.preset=tiny"],
             "is not in the catalogue")):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("meshlm: error:") and message in err[0], err



def test_the_docs_example_is_what_plan_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/planner.md's "From a plan to a run": its train line is the one its plan line
    prints."""
    text = (Path(__file__).parents[1] / "docs" / "planner.md").read_text()
    section = text.split("## From a plan to a run", 1)[1].split("\n## ", 1)[0]
    plan_line, train_line = re.findall(r"```bash\n(.*?)\n```", section, re.S)[:2]
    out = _run(shlex.split(plan_line)[1:], capsys)
    assert out.splitlines()[-1].strip() == train_line
