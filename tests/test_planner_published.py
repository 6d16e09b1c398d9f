"""``benchmarks/planner_vs_published.py``: any CSV with the published-runs columns, and the
planner's accuracy on the shipped one (a regression guard for docs/planner.md's claim)."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "benchmarks" / "data" / "published_runs.csv"


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location(
        "planner_vs_published", ROOT / "benchmarks" / "planner_vs_published.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _write(path: Path, rows: list[dict[str, str]]) -> None:
    with SHIPPED.open(newline="") as f:
        columns = next(csv.reader(f))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in columns})


def test_any_csv_json_rows_and_reasons(bench, tmp_path: Path) -> None:  # noqa: ANN001
    gpt = {"model_name": "GPT-1.3B", "params_B": "1.3", "layers": "24", "hidden": "2048",
           "heads": "16", "vocab": "50257", "seq_len": "2048", "num_gpus": "16",
           "global_batch_seqs": "256", "source": "a test", "year": "2024", "precision": "bf16"}
    _write(tmp_path / "runs.csv", [
        {**gpt, "hardware": "A100-SXM-80GB", "dp": "16", "micro_batch": "4",
         "reported_tflops_per_gpu": "150"},
        {**gpt, "hardware": "A100-SXM-80GB", "reported_mfu_pct": "40"},  # no layout
        {**gpt, "hardware": "TPU v5p", "dp": "16", "reported_mfu_pct": "40"},
        {**gpt, "hardware": "H100 SXM @350W", "tp": "2", "dp": "8", "micro_batch": "4",
         "reported_tokens_per_sec_per_gpu": "20000"},
        {**gpt, "hardware": "B200 180GB (8x power-limited B200)", "dp": "16",
         "micro_batch": "4", "reported_tokens_per_sec_per_gpu": "20000"},
    ])
    out = io.StringIO()
    with redirect_stdout(out):
        assert bench.main([str(tmp_path / "runs.csv"), "--json", "--no-search"]) == 0
    rows = json.loads(out.getvalue())
    predicted = [r for r in rows if r["predicted"] is not None]
    skipped = {r["row"]: r["reason"] for r in rows if r["predicted"] is None}
    assert [r["row"] for r in predicted] == [0, 1, 3]
    for r in predicted:
        assert {"source", "model_name", "num_gpus", "metric", "reported", "predicted"} <= set(r)
        assert r["error"] == pytest.approx(r["predicted"] / r["reported"] - 1)
    assert predicted[0]["metric"] == "tflops" and predicted[2]["metric"] == "tokens_per_s_per_gpu"
    assert "layout" in predicted[1]["completed"]  # nothing published: the search's layout
    assert predicted[1]["layout"] and predicted[1]["fits"]
    assert "not in the catalogue" in skipped[2]
    assert "power-limited, the limit not stated" in skipped[4]  # its clocks are unknown
    # the power cap in the hardware text slows the H100 row down
    capped = bench.build_row(3, {**gpt, "hardware": "H100 SXM @350W", "tp": "2", "dp": "8",
                                 "micro_batch": "4", "reported_mfu_pct": "40"})
    full = bench.build_row(3, {**gpt, "hardware": "H100 SXM", "tp": "2", "dp": "8",
                               "micro_batch": "4", "reported_mfu_pct": "40"})
    assert capped.hw.power == 350
    assert bench.predict(capped).tokens_per_s < bench.predict(full).tokens_per_s


def test_shipped_runs_accuracy_and_search(bench) -> None:  # noqa: ANN001
    """docs/planner.md's result, as a regression guard: at least 180 rows predicted (231 of
    the 253 on 2026-11-29; the rest for reasons naming a model cannot fix: no reported figure,
    no GPU count, TPUs, power-limited GPUs whose limit is not given,
    or a layout meshlm cannot express -- expert parallelism folded over tensor parallelism);
    on the 101 rows the model was built on, at least 80 % within 20 % of the reported MFU and
    55 % within 10 % (one set of constants); over all rows, the 94 added on 2026-11-28
    included (FP8 and MoE runs the model was not built on), at least 65 % within 20 % and
    45 % within 10 % (76 % and 47 % over the 253 rows on 2026-11-29); and,
    on the 8-GPU rows (the search is minutes on the large ones; the benchmark checks all),
    the search's first layout fits and is at least as fast as the published one."""
    report = bench.run(SHIPPED, do_search=False)
    s = report["summary"]
    assert s["predicted"] >= 180, report["skipped"]
    for r in report["skipped"]:
        assert any(k in r["reason"] for k in ("no reported", "not in the catalogue",
                                               "number of GPUs", "must divide",
                                               "exceed n_layers", "power-limited")), r
    built_on = [r for r in report["rows"] if r["row"] <= 100]
    assert len(built_on) >= 95
    assert sum(r["within"] for r in built_on) >= 0.80 * len(built_on)
    assert sum(abs(r["mfu_error"]) <= 0.10 for r in built_on) >= 0.55 * len(built_on)
    assert s["within_20pct"] >= 0.65 * s["predicted"], s
    assert s["within_10pct"] >= 0.45 * s["predicted"], s
    assert s["published_rows"] >= 100 and s["completed_rows"] >= 25
    small = [r for r in report["rows"] if r["num_gpus"] == 8]
    assert len(small) >= 8
    with SHIPPED.open(newline="") as f:
        raws = list(csv.DictReader(f))
    for r in small:
        row = bench.build_row(r["row"], raws[r["row"]])
        plan = bench.predict(row)
        best = bench.search(row.work, plan.layout.world_size, row.hw, top=1,
                            tp_overlap=plan.layout.tp_overlap)[0]
        assert best.fits
        assert best.tokens_per_s >= plan.tokens_per_s * (1 - 1e-9), (r["row"], best.layout)


# published totals (billions) the catalogue's shapes must count to within 3 %
TOTALS = {"gpt3-125m": 0.125, "gpt3-350m": 0.35, "gpt3-760m": 0.76, "gpt3-1.3b": 1.3,
          "gpt3-2.7b": 2.7, "gpt3-6.7b": 6.7, "gpt3-13b": 13.0, "gpt3-175b": 175.0,
          "mt-nlg-530b": 530.0, "gpt-neox-20b": 20.6, "bloom-176b": 176.0, "opt-175b": 175.0,
          "llama1-7b": 6.7, "llama1-13b": 13.0, "llama1-33b": 32.5, "llama1-65b": 65.2,
          "llama2-7b": 6.7, "llama2-13b": 13.0, "llama2-70b": 69.0, "llama3-8b": 8.03,
          "llama3-70b": 70.6, "llama3-405b": 405.9, "mixtral-8x7b": 46.7,
          "nemotron-4-340b": 340.0, "olmo-1b": 1.18, "olmo-7b": 6.9, "mpt-7b": 6.7,
          "mpt-30b": 30.0, "nanotron-llama-80b": 80.0}


def test_published_shapes_count_their_totals() -> None:
    from meshlm.models.published import CATALOGUE, match
    from meshlm.planner.workload import ModelSpec, load_model_spec

    for name, total in TOTALS.items():
        entry = CATALOGUE[name]
        count = ModelSpec(entry.config, gated_mlp=entry.gated_mlp).num_params() / 1e9
        assert abs(count / total - 1) < 0.03, (name, count, total)
        assert entry.source
        assert load_model_spec(name).num_params() == round(count * 1e9)  # plan --model NAME
    assert match("GPT-3 175B") == "gpt3-175b" and match("MT-NLG 530B") == "mt-nlg-530b"
    assert match("Llama 3.1 405B [1F1B, compile]") == "llama3-405b"
    assert match("Llama-like 8B (nanotron)") == "nanotron-llama-8b"
    assert match("Llama 2 70B") == "llama2-70b" and match("LLaMA 65B") == "llama1-65b"
    assert match("GPT-3 177B (vocab 131072)") is None and match("a model") is None


def test_blank_fields_are_completed_and_flagged(bench) -> None:  # noqa: ANN001
    base = {"source": "a test", "year": "2025", "hardware": "H100-80GB", "num_gpus": "8",
            "reported_mfu_pct": "40", "precision": "bf16"}
    # the whole shape from the architecture the row names, with its source
    row = bench.build_row(0, {**base, "architecture": "nanotron-llama-8b", "seq_len": "4096",
                              "dp": "8", "micro_batch": "1", "global_batch_seqs": "64"})
    assert not row.reason
    assert set(row.filled) == {"layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab"}
    assert all(v.startswith("nanotron-llama-8b (huggingface/nanotron") for v in row.filled.values())
    c = row.work.model.config
    assert (c.n_layers, c.dim, c.ffn_hidden, c.n_heads, c.n_kv_heads, c.vocab_size) == (
        32, 4096, 14336, 32, 32, 131072)
    # known nowhere: the documented default, flagged
    gpt = {**base, "model_name": "GPT-xyz", "layers": "4", "hidden": "256", "heads": "4",
           "dp": "8", "micro_batch": "1", "global_batch_seqs": "8"}
    row = bench.build_row(1, gpt)
    assert row.work.model.config.vocab_size == 50257 and row.work.seq_len == 2048
    assert row.filled["vocab"].startswith("default") and row.filled["seq_len"].startswith("default")
    # a model's published training batch when the row gives neither batch nor micro-batch
    nlg = {**base, "architecture": "mt-nlg-530b", "num_gpus": "2240", "tp": "8", "pp": "35",
           "dp": "8", "seq_len": "2048", "hardware": "A100-SXM-80GB"}
    row = bench.build_row(2, nlg)
    assert row.work.global_batch == 1920 and "global_batch_seqs" in row.filled
    # a pipeline whose published micro-batch is the rank's whole batch: split into pp
    pipe = {**gpt, "num_gpus": "16", "pp": "4", "dp": "4", "micro_batch": "8",
            "global_batch_seqs": "32"}
    row = bench.build_row(3, pipe)
    assert row.layout.micro_batch == 2 and row.rules
    assert not bench.predict(row).problems


def test_pipeline_that_cannot_fill_splits_the_local_batch_for_every_source(
        bench) -> None:  # noqa: ANN001
    """Fewer published micro-batches than stages: the published micro-batch is read as the
    replica's batch, split into pp micro-batches -- from the row's numbers, whatever the
    source and under every rule setting; a batch that pp does not divide stays a miss."""
    row = {"layers": "16", "hidden": "2048", "heads": "16", "vocab": "50257",
           "seq_len": "2048", "hardware": "H100-80GB", "num_gpus": "16", "tp": "2", "pp": "4",
           "dp": "2", "micro_batch": "8", "global_batch_seqs": "16", "reported_mfu_pct": "40",
           "source": "Some lab", "year": "2024", "precision": "bf16"}
    for rules in (bench.Rules(), bench.Rules(**{t: False for t in bench.TOGGLES})):
        built = bench.build_row(0, row, rules=rules)
        assert built.layout.micro_batch == 2 and built.rules
        assert not bench.predict(built).problems
    filled = bench.build_row(0, {**row, "micro_batch": "2", "global_batch_seqs": "16"})
    assert filled.layout.micro_batch == 2 and not filled.rules  # 4 micro-batches: as published
    odd = bench.build_row(0, {**row, "micro_batch": "6", "global_batch_seqs": "12"})
    assert odd.layout.micro_batch == 6 and bench.predict(odd).problems


def test_framework_rules_read_from_the_row(bench) -> None:  # noqa: ANN001
    """Which rows the stack rules touch (``meshlm.planner.stacks``, by the ``stack`` column):
    torchtitan's interleaved default (2 stages per rank when the split is not given),
    Megatron's pipeline scatter/gather, the fp32 gradient reduction (Megatron bf16, nanotron,
    torchtitan; not Megatron fp16, not llm-foundry) and nanotron's separate accumulation pass,
    llm-foundry's fused loss; every rule off restores meshlm's own behaviour."""
    gpt = {"layers": "16", "hidden": "2048", "heads": "16", "vocab": "50257",
           "seq_len": "2048", "hardware": "H100-80GB", "num_gpus": "16", "tp": "2", "pp": "4",
           "dp": "2", "micro_batch": "1", "global_batch_seqs": "64", "reported_mfu_pct": "40"}
    titan = {**gpt, "stack": "torchtitan-compile", "year": "2024", "precision": "bf16",
             "pp_schedule": "interleaved"}
    row = bench.build_row(0, titan)
    assert (row.layout.pp_schedule, row.layout.pp_virtual) == ("interleaved", 2)
    assert row.work.fp32_grad_reduce and not row.work.grad_accum_pass
    assert row.work.p2p_dtype == "compute" and not row.work.p2p_split
    assert bench.build_row(0, {**titan, "vpp": "4"}).layout.pp_virtual == 4
    assert bench.build_row(0, {**titan, "pp_schedule": "1f1b"}).layout.pp_virtual == 1
    assert bench.build_row(0, {**titan, "stack": "nanotron"}).layout.pp_virtual == 1
    off = bench.Rules(interleaved_default=False, p2p_16bit=False, fp32_grad_reduce=False)
    row = bench.build_row(0, titan, rules=off)
    assert row.layout.pp_virtual == 1 and row.work.p2p_dtype == "fp32"
    assert not row.work.fp32_grad_reduce
    mega = {**gpt, "stack": "megatron", "year": "2021", "precision": "fp16 mixed"}
    row = bench.build_row(0, mega)
    assert row.work.p2p_split and not row.work.fp32_grad_reduce  # fp16 reduces in fp16
    assert bench.build_row(0, {**mega, "precision": "bf16"}).work.fp32_grad_reduce
    assert not bench.build_row(0, mega, rules=bench.Rules(p2p_scatter_gather=False)
                               ).work.p2p_split
    nlg = {**mega, "stack": "megatron-deepspeed"}
    assert not bench.build_row(0, nlg).work.p2p_split  # DeepSpeed's pipeline engine
    nano = {**gpt, "stack": "nanotron", "year": "2025"}
    row = bench.build_row(0, nano)
    assert row.work.fp32_grad_reduce and row.work.grad_accum_pass and not row.work.p2p_split
    foundry = {**gpt, "stack": "llm-foundry", "precision": "amp_bf16"}
    row = bench.build_row(0, foundry)
    assert not row.work.fp32_grad_reduce and row.work.loss == "fused"
    assert bench.build_row(0, foundry, rules=bench.Rules(stack_loss=False)).work.loss == "torch"
    assert bench.build_row(0, {**foundry, "loss_kernel": "torch"}).work.loss == "torch"
    # the flash kernel's generation: FlashAttention-2-class unless the row names an older one
    assert row.work.flash_kernel == "flash2"
    old = bench.build_row(0, {**foundry, "attention_kernel": "flash1"})
    assert old.work.flash_kernel == "flash1"
    assert bench.predict(old).tokens_per_s < bench.predict(row).tokens_per_s
    # float8 parameter all-gathers: the row's column, else the stack's FP8 primary weights
    fp8 = {**titan, "precision": "bf16 + float8 linears", "zero_stage_or_fsdp": "FSDP2"}
    assert not bench.build_row(0, fp8).work.fp8_param_gather
    assert bench.build_row(0, {**fp8, "fp8_param_gather": "yes"}).work.fp8_param_gather
    te = {**gpt, "stack": "megatron-te", "year": "2025", "precision": "fp8 mixed"}
    assert bench.build_row(0, te).work.fp8_param_gather
    assert not bench.build_row(0, {**te, "fp8_param_gather": "no"}).work.fp8_param_gather
    # the kernel family by stack ("family"), or one for every row
    fam = bench.Rules(kernels="family")
    assert bench.build_row(0, mega, rules=fam).work.kernels == "fused"
    assert bench.build_row(0, {**titan, "stack": "torchtitan"}, rules=fam).work.kernels == "eager"
    assert bench.build_row(0, mega).work.kernels == "eager"  # the default: eager everywhere
    with pytest.raises(ValueError, match="stack 'megatron-xl' is not one of"):
        bench.build_row(0, {**gpt, "stack": "megatron-xl"})


def test_no_rule_reads_the_source_or_the_model_name(bench) -> None:  # noqa: ANN001
    """Every rule is a property of the run stated in its columns: with the source, the model
    name, the table reference and the notes of every shipped row replaced by text that names
    nothing, every row is the same question -- model, workload, layout, hardware, the knobs
    the planner completes, the metric and its value -- and the same predicted figure for a
    plan (the FLOP convention and the MFU's peak are columns too)."""
    with SHIPPED.open(newline="") as f:
        raws = list(csv.DictReader(f))
    names = ("source", "table_ref", "model_name", "notes")
    keyed = 0
    for i, raw in enumerate(raws):
        blind = {**raw, **{k: f"run {i} of an unknown publisher" for k in names}}
        a, b = bench.build_row(i, raw), bench.build_row(i, blind)
        assert a.reason == b.reason, i
        if a.reason:
            continue
        assert (a.work, a.layout, a.hw, a.free, a.metric, a.reported, a.rules) == (
            b.work, b.layout, b.hw, b.free, b.metric, b.reported, b.rules), i
        assert set(a.filled) == set(b.filled), i
        plan = bench.evaluate(a.work, a.layout, a.hw, a.layout.world_size)
        if plan.time:
            assert bench.predicted_metric(a, plan) == bench.predicted_metric(b, plan), i
        keyed += bool(raw.get("stack"))
    assert keyed >= 95  # the shipped rows state their stack
    # and the names the old rules read are gone from the script's rules
    text = (ROOT / "benchmarks" / "planner_vs_published.py").read_text()
    for needle in ('"torchtitan" in', '"nanotron" in', '"llm-foundry" in', '"megatron" in',
                   "match_model("):
        assert needle not in text, needle


def test_leave_one_source_out_redecides_rules_without_the_held_out_source(
        bench, tmp_path: Path) -> None:  # noqa: ANN001
    """Hand-built case: two sources whose rows need the power cap (reported = the capped
    prediction) and one llm-foundry row (reported = its fused-loss prediction). Held out,
    each power-capped source keeps the cap (a universal fact of the hardware text, which the
    other source shows is needed too); the
    llm-foundry row loses its own rule (no other row gives evidence for it) and is scored
    with torch's cross-entropy."""
    gpt = {"model_name": "GPT-1.3B", "params_B": "1.3", "layers": "24", "hidden": "2048",
           "heads": "16", "vocab": "50257", "seq_len": "2048", "precision": "bf16",
           "global_batch_seqs": "256"}
    capped = {**gpt, "hardware": "H100 SXM @350W", "num_gpus": "16", "tp": "2", "dp": "8",
              "micro_batch": "4"}
    raws = [{**capped, "source": "alpha", "year": "2024"},
            {**capped, "source": "beta", "year": "2024"},
            {**gpt, "hardware": "A100-SXM-80GB", "num_gpus": "8", "dp": "8",
             "micro_batch": "8", "source": "mosaicml/llm-foundry README", "stack": "llm-foundry"},
            {**gpt, "hardware": "A100-SXM-80GB", "num_gpus": "8", "dp": "8",
             "micro_batch": "8", "source": "gamma", "year": "2021"}]

    def tokens(raw: dict[str, str], rules) -> float:  # noqa: ANN001
        row = bench.build_row(0, {**raw, "reported_tokens_per_sec_per_gpu": "1"}, rules=rules)
        return bench.predict(row).time.tokens_per_s / row.layout.world_size

    on = bench.Rules()
    for r in raws:
        r["reported_tokens_per_sec_per_gpu"] = f"{tokens(r, on):.6f}"
    uncapped = tokens(raws[0], bench.Rules(power_cap=False))
    assert uncapped / tokens(raws[0], on) - 1 > 0.2  # the cap matters beyond the tolerance
    torch_loss = tokens(raws[2], bench.Rules(stack_loss=False))
    flash_2021 = tokens(raws[3], bench.Rules(era=False))
    _write(tmp_path / "runs.csv", raws)
    loso = bench.leave_one_source_out(tmp_path / "runs.csv")
    by = {s["source"]: s for s in loso["sources"]}
    assert set(by) == {"alpha", "beta", "mosaicml/llm-foundry README", "gamma"}
    for name in ("alpha", "beta"):
        assert "power_cap" not in by[name]["rules"], by[name]
        assert by[name]["within_20pct"] == 1
        assert abs(by[name]["errors"][0]) < 1e-5
    foundry = by["mosaicml/llm-foundry README"]
    assert "stack_loss" in foundry["rules"].split("off: ")[1]
    expected = torch_loss / float(raws[2]["reported_tokens_per_sec_per_gpu"]) - 1
    assert abs(expected) > 1e-3  # the fused loss changes the prediction: the rule was off
    assert foundry["errors"][0] == pytest.approx(expected, rel=1e-6)
    assert loso["rows"] == 4 and loso["in_sample_within_20pct"] == 4
    # The universal fact (the row's date: no FlashAttention in 2021) stays on in the issue's
    # procedure; the strict one re-decides it too, and no other source needs the era rule.
    assert loso["universal_kept"] == list(bench.UNIVERSAL)
    assert "power_cap" in bench.UNIVERSAL and "hbm2e_part" in bench.UNIVERSAL
    def off(described: str) -> list[str]:
        return described.split("off: ")[1].split(", ") if "off: " in described else []

    assert abs(by["gamma"]["errors"][0]) < 1e-5 and "era" not in off(by["gamma"]["rules"])
    strict = {s["source"]: s for s in loso["strict"]["sources"]}
    assert "era" in off(strict["gamma"]["rules"])
    expected = flash_2021 / float(raws[3]["reported_tokens_per_sec_per_gpu"]) - 1
    assert abs(expected) > 1e-3
    assert strict["gamma"]["errors"][0] == pytest.approx(expected, rel=1e-6)
    assert loso["strict"]["combinations"] == 2 ** len(bench.UNIVERSAL) * loso["combinations"]


def test_fast_rule_choice_is_the_slow_one(bench) -> None:  # noqa: ANN001
    """``best_rules`` (counts over all rows less the held-out ones; the median only among the
    tied) picks exactly ``max(candidates, key=_fitness)`` -- the first of the best -- on
    random errors with ties and unpredicted rows."""
    import random
    from itertools import product

    rng = random.Random(0)
    combos = [bench.Rules(kernels=k, **dict(zip(bench.TOGGLES, bits, strict=True)))
              for k in bench.KERNEL_CHOICES
              for bits in product((True, False), repeat=len(bench.TOGGLES))][::7]
    n = 40
    errs = {c: [None if rng.random() < 0.1 else rng.choice((0.05, 0.15, 0.3, -0.12))
                for _ in range(n)] for c in combos}
    scored = list(range(n))
    counts = {}
    for c, e in errs.items():
        ok = [abs(x) for x in e if x is not None]
        counts[c] = (sum(x <= bench.TOLERANCE for x in ok), sum(x <= 0.10 for x in ok))
    for start in range(0, n, 5):
        held = scored[start:start + 5]
        rest = [i for i in scored if i not in held]
        slow = max(combos, key=lambda c, rest=rest: bench._fitness(errs[c], rest, c))
        assert bench.best_rules(combos, errs, rest, held, counts) == slow
