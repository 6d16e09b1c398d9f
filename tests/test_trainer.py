"""Trainer tests: loss falls, accumulation is exact, resume continues the same loss curve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from meshlm import load_model
from meshlm.checkpoint.state import find_latest
from meshlm.config import ConfigError, load_config
from meshlm.optim import lr_at
from meshlm.testing import assert_weights_close
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

CONTRACT_FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s",
                   "mem_peak_bytes"}


def _train(args: list[str], *extra: str):
    return train(load_config(None, args + list(extra)), log=lambda _m: None, progress=False)


def test_metrics_contract_and_loss_decreases(tiny_args: list[str]) -> None:
    result = _train(tiny_args, "--train.steps=20", "--train.eval_every=10", "--train.lr=1e-2")
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 21))
    for r in records:
        assert CONTRACT_FIELDS <= set(r), set(r)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["mem_peak_bytes"] > 0
    assert {r["step"] for r in records if "val_loss" in r} == {1, 10, 20}
    assert records[-1]["val_loss"] < records[0]["val_loss"] - 0.5
    assert sum(r["loss"] for r in records[-5:]) < sum(r["loss"] for r in records[:5])
    # saved alongside: resolved config, tokenizer, environment, final checkpoint
    for name in ("config.toml", "tokenizer.json", "env.json"):
        assert (result.run_dir / name).is_file(), name
    assert find_latest(result.run_dir / "checkpoints").name == "step_0000020"
    assert json.loads((result.run_dir / "env.json").read_text())["peak_flops"] == 1e10


def test_gradient_accumulation_is_exact(tiny_args: list[str], tmp_path: Path) -> None:
    """micro-batch 8 (no accumulation) vs 4 x 2 vs 2 x 4: the same global-batch mean in fp32."""
    runs = {}
    for micro in (8, 4, 2):
        res = _train(tiny_args, f"--train.micro_batch={micro}", f"--run.dir={tmp_path / str(micro)}")
        runs[micro] = res
    for micro in (4, 2):
        for step, loss in runs[8].losses.items():
            assert runs[micro].losses[step] == pytest.approx(loss, rel=1e-5)
    ref = dict(load_model(runs[8].run_dir).named_parameters())
    for micro in (4, 2):
        assert_weights_close(dict(load_model(runs[micro].run_dir).named_parameters()), ref)


def test_resume_continues_the_same_loss_curve(tiny_args: list[str], tmp_path: Path) -> None:
    full = _train(tiny_args, "--train.checkpoint_every=3")
    assert sorted(p.name for p in (full.run_dir / "checkpoints").iterdir()) == [
        "step_0000003", "step_0000006"]
    # A run interrupted after step 3: its directory holds only what existed then.
    cut = tmp_path / "cut"
    shutil.copytree(full.run_dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step_0000006")
    resumed = _train(tiny_args, "--train.checkpoint_every=3", f"--run.dir={cut}",
                     "--run.resume=true")
    assert sorted(resumed.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.losses[step] == pytest.approx(full.losses[step], rel=1e-6)
    a, b = load_model(full.run_dir), load_model(cut)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    # metrics.jsonl holds each step exactly once
    assert [r["step"] for r in read_metrics(cut / "metrics.jsonl")] == list(range(1, 7))


def test_run_dir_is_never_overwritten(tiny_args: list[str]) -> None:
    result = _train(tiny_args, "--train.steps=2")
    before = (result.run_dir / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds files"):
        _train(tiny_args, "--train.steps=2")
    assert (result.run_dir / "metrics.jsonl").read_text() == before


def test_resume_rejects_a_different_model(tiny_args: list[str]) -> None:
    _train(tiny_args, "--train.steps=2")
    with pytest.raises(ConfigError, match=r"\[model\] differs"):
        _train(tiny_args, "--train.steps=4", "--run.resume=true", "--model.n_layers=3")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_trains(tiny_args: list[str], dtype: str) -> None:
    result = _train(tiny_args, f"--precision.dtype={dtype}", "--train.steps=8", "--train.lr=1e-2")
    losses = list(result.losses.values())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    # master weights stay fp32
    assert all(p.dtype == torch.float32 for p in load_model(result.run_dir).parameters())


def test_moe_model_trains(tiny_args: list[str]) -> None:
    result = _train(tiny_args, "--model.preset=tiny-moe", "--train.steps=8", "--train.lr=1e-2")
    losses = list(result.losses.values())
    assert losses[-1] < losses[0]


def test_lr_schedule_warmup_then_cosine() -> None:
    cfg = load_config(None, ["--train.steps=100", "--train.warmup_steps=10", "--train.lr=1.0",
                             "--train.min_lr=0.1"]).train
    assert lr_at(1, cfg) == pytest.approx(0.1)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_at(100, cfg) == pytest.approx(0.1)
    values = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


# glibc's allocator statistics (mallinfo2, bytes), for the scripts below
_MALLINFO = (
    "import ctypes, json, torch\n"
    "class Info(ctypes.Structure):\n"
    "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena ordblks smblks hblks hblkhd '\n"
    "                'usmblks fsmblks uordblks fordblks keepcost').split()]\n"
    "libc = ctypes.CDLL('libc.so.6')\n"
    "libc.mallinfo2.restype = Info\n"
)


def _fresh_process(code: str) -> dict:
    """The JSON ``code`` prints last, run after ``_MALLINFO`` in a fresh Python process."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MALLINFO + code], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _allocator_state(policy: str) -> dict[str, int]:
    """glibc's view (``mallinfo2``, bytes) of a 64 MiB buffer allocated, freed and allocated
    again, round after round (24), in a fresh process under ``policy`` ("default" or "keep");
    the last round's numbers, and the heap's size after each round (``arenas``).

    Under ``keep`` the heap takes some rounds to settle, a number that depends on what the
    imports left in glibc's bins: torch allocates with 64-byte alignment, and while the
    alignment's split-off remainder next to a freed buffer goes to a small allocation made
    between two rounds, the freed buffer is a few bytes short of the next request and the heap
    grows by one buffer (seen for 1 to 7 rounds here). Once the small bins are stocked, every
    round reuses the freed buffer: that steady state is what ``run.malloc_keep`` buys."""
    return _fresh_process(
        "from meshlm.train.trainer import keep_freed_memory\n"
        f"if {policy == 'keep'}: keep_freed_memory()\n"
        "arenas = []\n"
        "for _ in range(24):\n"
        "    t = torch.empty(16 << 20).fill_(1.0)\n"
        "    live = libc.mallinfo2()\n"
        "    del t\n"
        "    freed = libc.mallinfo2()\n"
        "    arenas.append(freed.arena)\n"
        "t = torch.empty(16 << 20).fill_(1.0)\n"
        "again = libc.mallinfo2()\n"
        "print(json.dumps({'mmapped_live': live.hblkhd, 'mmapped_freed': freed.hblkhd,\n"
        "                  'heap_free': freed.fordblks, 'heap_freed': freed.arena,\n"
        "                  'heap_again': again.arena, 'arenas': arenas}))\n"
    )


def test_malloc_keep_reuses_pages_instead_of_faulting_them_in() -> None:
    """What meshlm sets, read back from glibc rather than counted in page faults (which depend
    on the kernel: transparent huge pages, memory pressure). By default glibc mmaps a 64 MiB
    buffer on its own and unmaps it when freed, so every re-allocation faults in fresh pages;
    with ``run.malloc_keep`` the buffer comes from the heap, stays there once freed, and once
    the heap has settled (see ``_allocator_state``) every re-allocation reuses it: the heap
    does not grow round after round."""
    mib = 1 << 20
    default, keep = _allocator_state("default"), _allocator_state("keep")
    assert default["mmapped_live"] - default["mmapped_freed"] >= 64 * mib, default
    assert keep["mmapped_live"] - keep["mmapped_freed"] < mib, keep
    assert keep["heap_free"] >= 64 * mib, keep
    assert keep["heap_again"] == keep["heap_freed"], keep
    assert len(set(keep["arenas"][-8:])) == 1, keep["arenas"]  # steady: no growth per round


def _heap_rounds(policy: str) -> dict[str, list[int]]:
    """glibc's view (``mallinfo2``) in a fresh process under ``policy`` ("cache":
    ``run.malloc_cache_mb``'s; "pin": ``run.malloc_mmap_kb=128``'s), round after round of a
    micro-batch's worth of buffers (3 x 8 MiB) allocated, then freed: the heap's size with them
    live and freed, the bytes mmapped with them live and freed, the heap's free bytes after."""
    return _fresh_process(
        "from meshlm.train.process import cache_freed_memory, pin_malloc_mmap_threshold\n"
        f"if {policy == 'cache'}: cache_freed_memory()\n"
        f"if {policy == 'pin'}: pin_malloc_mmap_threshold(128 << 10)\n"
        "out = {k: [] for k in ('live', 'freed', 'mmapped_live', 'mmapped_freed', 'free')}\n"
        "for _ in range(24):\n"
        "    ts = [torch.empty(2 << 20).fill_(1.0) for _ in range(3)]\n"
        "    live = libc.mallinfo2()\n"
        "    del ts\n"
        "    freed = libc.mallinfo2()\n"
        "    for k, v in (('live', live.arena), ('freed', freed.arena),\n"
        "                 ('mmapped_live', live.hblkhd), ('mmapped_freed', freed.hblkhd),\n"
        "                 ('free', freed.fordblks)):\n"
        "        out[k].append(v)\n"
        "print(json.dumps(out))\n"
    )


def test_malloc_cache_keeps_a_micro_batch_of_freed_memory_for_the_next() -> None:
    """The default policy (``run.malloc_cache_mb``): a micro-batch's worth of buffers freed
    (what a pipeline stage frees after each backward) stays in the heap, free, and the next
    micro-batch gets the same pages back: the heap neither shrinks nor grows round after round.
    The contrast is the policy that returns every buffer (``run.malloc_mmap_kb``): mmapped
    while live, unmapped when freed. glibc's own dynamic policy sits between the two, and
    where it lands depends on the process's history: its trim threshold settles at twice the
    largest buffer freed, and the heap's top is given back whenever more than that is free
    there (``benchmarks/pipeline.py``'s JSON counts the page faults that follow)."""
    mib = 1 << 20
    cache, pin = _heap_rounds("cache"), _heap_rounds("pin")
    assert cache["freed"] == cache["live"], cache  # kept: nothing given back, ever
    # reused: once the heap has settled (``_allocator_state`` says why it may take some rounds)
    # it does not grow round after round, and holds the freed micro-batch free for the next
    steady = slice(-8, None)
    assert len(set(cache["live"][steady])) == 1, cache
    assert all(f >= 24 * mib for f in cache["free"][steady]), cache
    assert all(m_live - m_freed == 0 for m_live, m_freed in zip(
        cache["mmapped_live"], cache["mmapped_freed"], strict=True)), cache  # from the heap
    assert all(m_live - m_freed >= 24 * mib for m_live, m_freed in zip(
        pin["mmapped_live"], pin["mmapped_freed"], strict=True)), pin  # returned on free
    assert len(set(cache["live"][steady])) == 1, cache  # and the heap does not grow
