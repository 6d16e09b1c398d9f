"""Optimizer-state offload (``parallel.offload``) against the in-memory optimizer.

``disk`` keeps the AdamW moments in a file per rank and streams them through the step: it
must give the losses and final weights of ``none`` (fp32: bit for bit, asserted < 1e-6) on one
process and under DDP, ZeRO-1/2 and ZeRO-3 (one spawned world), resume exactly from its own
checkpoints (which load with ``none`` as well), report no resident optimizer bytes, and lower
the measured peak RSS of a step by (at least three quarters of) the moments' size. The staged
step of GPU runs (two host slots, copies overlapping the host's AdamW) is driven on CPU with
copies that complete as late as a CUDA stream would let them, and stays bit for bit.
"""

from __future__ import annotations

import mmap
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshlm.config import load_config
from meshlm.layout import Layout
from meshlm.parallel.offload import OffloadedAdamW, SyncCopies, plan_chunks
from meshlm.testing import (
    HANG_GUARD_S,
    final_weights,
    max_relative_difference,
    run_world,
    train_runs,
)
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import Trainer, train

STEPS = 5


def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
        "--train.global_batch=8", "--train.warmup_steps=2", "--train.eval_every=0",
        "--run.sample_tokens=0", "--train.peak_flops=1e10", "--train.grad_clip=0.5",
        "--parallel.bucket_mb=0.05", "--train.checkpoint_every=3",
    ]


def run_dir(args: list[str]) -> Path:
    return Path(next(a for a in args if a.startswith("--run.dir=")).split("=", 1)[1])


def check_same(got: Path, got_losses: dict, ref: Path, ref_losses: dict) -> None:
    assert sorted(got_losses) == sorted(ref_losses)
    for step, loss in ref_losses.items():
        assert abs(got_losses[step] - loss) / abs(loss) < 1e-6, (got.name, step)
    worst, name = max_relative_difference(final_weights(got), final_weights(ref))
    assert worst < 1e-6, (got.name, name, worst)


def cut_copy(src: Path, dst: Path, keep_step: int) -> None:
    """``dst``: the run ``src`` as it was after checkpoint ``keep_step``."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").iterdir():
        if int(ckpt.name.split("_")[1]) > keep_step:
            shutil.rmtree(ckpt)


# ---------------------------------------------------------------------- the optimizer alone
@pytest.mark.parametrize("kernels", ["fused", "foreach"])
@pytest.mark.parametrize("store", ["disk", "cpu"])
def test_chunked_steps_equal_torch_adamw_bit_for_bit(store: str, kernels: str,
                                                     tmp_path: Path) -> None:
    """Parameters cut across chunks (chunk = 256 elements), a parameter without gradient on
    one step, two weight-decay groups: weights and moments equal torch's AdamW with the same
    kernels (fused or foreach) exactly. With ``cpu`` the step goes through the host staging
    buffer of GPU runs (here CPU to CPU)."""
    shapes = [(300, 7), (1000,), (64, 64), (5,), (3000,)]

    def params() -> list[torch.nn.Parameter]:
        g = torch.Generator().manual_seed(1)
        return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]

    def groups(ps: list) -> list[dict]:  # noqa: ANN001
        return [{"params": ps[:3], "weight_decay": 0.1}, {"params": ps[3:], "weight_decay": 0.0}]

    a, b = params(), params()
    kw = {kernels: True}
    ref = torch.optim.AdamW(groups(a), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **kw)
    fresh = torch.optim.AdamW(groups(b), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **kw)
    off = OffloadedAdamW.like(fresh, store, tmp_path / "rank_00000.adam", chunk=256,
                              staged=store == "cpu")
    assert off.fused == (kernels == "fused")
    size = 8 * sum(p.numel() for p in b)
    if store == "disk":
        assert (tmp_path / "rank_00000.adam").stat().st_size == size
    _, chunks, n = plan_chunks([b[:3], b[3:]], 256)
    assert n == sum(p.numel() for p in b) and all(c.hi - c.lo <= 256 for c in chunks)
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)
        for x, y in zip(a, b, strict=True):
            x.grad = torch.randn(x.shape, generator=g)
            y.grad = x.grad.clone()
        if step == 2:
            a[1].grad = b[1].grad = None
        ref.step()
        off.step()
        # disk: every page dropped after the step; cpu: the host copy of the moments
        assert off.resident_bytes() == (0 if store == "disk" else size)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), step
    for x, y in zip(a, b, strict=True):
        s, t = ref.state[x], off.state[y]
        assert float(s["step"]) == float(t["step"])
        assert torch.equal(s["exp_avg"], t["exp_avg"])
        assert torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])
    if store == "disk":  # reading the state leaves nothing resident; the count is measured
        assert off.resident_bytes() == 0
        off.store.flat.sum()  # pages the file in
        assert 0 < off.resident_bytes() <= size + mmap.PAGESIZE  # (whole pages)
        off.step()
        assert off.resident_bytes() == 0


class LazyCopies(SyncCopies):
    """Copies as a side stream would run them, at the latest moment it may: queued in issue
    order and done only when the host waits on a slot (everything queued up to that slot's
    last copy to the host) or at the end of the step. A host that read a slot before its
    wait, or wrote one whose copy back had not run yet, would see other numbers."""

    def __init__(self) -> None:
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0  # copies of the queue run so far
        self.mark = [0, 0]  # per slot: the queue length after its last copy to the host
        self.calls: list[tuple[str, int]] = []

    def begin(self) -> None:
        self.calls.append(("begin", -1))

    def _run(self, upto: int) -> None:
        for dst, src in self.queue[self.done:upto]:
            dst.copy_(src)
        self.done = max(self.done, upto)

    def to_host(self, slot: int, pairs: list) -> None:  # noqa: ANN001
        self.queue += pairs
        self.mark[slot] = len(self.queue)
        self.calls.append(("to_host", slot))

    def wait(self, slot: int) -> None:
        self._run(self.mark[slot])
        self.calls.append(("wait", slot))

    def to_device(self, slot: int, pairs: list) -> None:  # noqa: ANN001
        self.queue += pairs
        self.calls.append(("to_device", slot))

    def end(self) -> None:
        self._run(len(self.queue))
        self.calls.append(("end", -1))


@pytest.mark.parametrize("chunk", [64, 128, 192])
def test_double_buffered_chunks_equal_torch_adamw(chunk: int, tmp_path: Path) -> None:
    """Staged steps through two slots with copies that complete as late as a stream lets them
    (:class:`LazyCopies`): parameter sizes that are not multiples of the chunk (chunks stay
    multiples of 64, the vector lanes of the fused kernel), a parameter cut across several
    chunks, one without gradient on a step -- weights and moments equal torch's AdamW bit for
    bit; chunk i + 1 is sent to the host before the host waits for chunk i."""
    shapes = [(37,), (250,), (1,), (9, 57), (129,)]

    def params() -> list[torch.nn.Parameter]:
        g = torch.Generator().manual_seed(2)
        return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]

    a, b = params(), params()
    ref = torch.optim.AdamW(a, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=True)
    fresh = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                              fused=True)
    off = OffloadedAdamW.like(fresh, "cpu", chunk=chunk, staged=True)
    off.copies = copies = LazyCopies()
    n_chunks = len(off.chunks)
    assert n_chunks >= 3 and sum(p.numel() for p in b) % chunk  # a partial last chunk
    for step in range(3):
        g = torch.Generator().manual_seed(200 + step)
        for x, y in zip(a, b, strict=True):
            x.grad = torch.randn(x.shape, generator=g)
            y.grad = x.grad.clone()
        if step == 1:
            a[3].grad = b[3].grad = None
        copies.calls.clear()
        ref.step()
        off.step()
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), (chunk, step)
        n = len([c for c in off.chunks if any(b[pc.index].grad is not None for pc in c.pieces)])
        slots = [i % 2 for i in range(n)]
        expected = [("begin", -1), ("to_host", 0)]
        for i in range(n):  # the next chunk's copy is issued before this chunk's wait
            expected += ([("to_host", slots[i + 1])] if i + 1 < n else []) + [
                ("wait", slots[i]), ("to_device", slots[i])]
        assert copies.calls == expected + [("end", -1)], (chunk, step)
    for x, y in zip(a, b, strict=True):
        s, t = ref.state[x], off.state[y]
        assert float(s["step"]) == float(t["step"])
        assert torch.equal(s["exp_avg"], t["exp_avg"])
        assert torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])
    assert off.staging.shape == (2, 2, chunk)  # two slots of weights and gradients


# ---------------------------------------------------------------------- training parity
def test_disk_offload_matches_in_memory_one_process(corpus_dir: Path, cache_dir: Path,
                                                    tmp_path: Path) -> None:
    """One process: same losses and weights, one file of 8 bytes per parameter, no resident
    optimizer bytes; resuming either way from a disk run's checkpoint is exact."""
    base = base_args(corpus_dir, cache_dir) + ["--train.micro_batch=4"]
    none = train(load_config(None, base + [f"--run.dir={tmp_path / 'none'}"]),
                 log=lambda _m: None, progress=False).losses
    trainer = Trainer(load_config(None, base + ["--parallel.offload=disk",
                                                f"--run.dir={tmp_path / 'disk'}"]),
                      log=lambda _m: None, progress=False)
    n_params = sum(p.numel() for p in trainer.model_part.model.parameters())
    assert (tmp_path / "disk" / "offload" / "rank_00000.adam").stat().st_size == 8 * n_params
    assert trainer.model_part.engine.optimizer.fused  # the host step: torch's fused CPU AdamW
    disk = trainer.fit().losses
    del trainer
    check_same(tmp_path / "disk", disk, tmp_path / "none", none)
    assert all(r["optim_bytes"] == 0 for r in read_metrics(tmp_path / "disk" / "metrics.jsonl"))
    assert all(r["optim_bytes"] == 8 * n_params
               for r in read_metrics(tmp_path / "none" / "metrics.jsonl"))
    # resume from the disk run's step-3 checkpoint, with disk and with none
    for kind in ("disk", "none"):
        cut = tmp_path / f"cut-{kind}"
        cut_copy(tmp_path / "disk", cut, 3)
        resumed = train(load_config(None, base + [f"--parallel.offload={kind}",
                                                  f"--run.dir={cut}", "--run.resume=true"]),
                        log=lambda _m: None, progress=False).losses
        check_same(cut, resumed, tmp_path / "disk", {s: disk[s] for s in (4, 5)})


def world_body(base: list[str], runs: list[list[str]], cut: Path) -> dict:
    """Every run, then a resume of the ZeRO-3 disk run (the last) from its step-3 checkpoint."""
    import torch.distributed as dist

    losses = train_runs(base, runs)
    if dist.get_rank() == 0:
        cut_copy(run_dir(runs[-1]), cut, 3)
    dist.barrier()
    resumed = train_runs(base, [runs[-1][:-1] + [f"--run.dir={cut}", "--run.resume=true"]])[0]
    return {"losses": losses, "resumed": resumed}


def test_disk_offload_matches_in_memory_data_parallel(corpus_dir: Path, cache_dir: Path,
                                                      tmp_path: Path) -> None:
    """dp=2: DDP, ZeRO-1, ZeRO-2, ZeRO-3 (accumulation 2), each with none and disk."""
    base = base_args(corpus_dir, cache_dir) + ["--parallel.dp=2", "--train.micro_batch=2"]
    runs = [[f"--parallel.zero={zero}", f"--parallel.offload={kind}",
             f"--run.dir={tmp_path / f'zero{zero}-{kind}'}"]
            for zero in (0, 1, 2, 3) for kind in ("none", "disk")]
    res = run_world(2, world_body, base, runs, tmp_path / "cut")
    losses = res[0]["losses"]
    for i in range(0, len(runs), 2):
        ref, got = run_dir(runs[i]), run_dir(runs[i + 1])
        check_same(got, losses[i + 1], ref, losses[i])
        assert all(r["optim_bytes"] == 0 for r in read_metrics(got / "metrics.jsonl"))
        assert all(r["optim_bytes"] > 0 for r in read_metrics(ref / "metrics.jsonl"))
    check_same(tmp_path / "cut", res[0]["resumed"], run_dir(runs[-1]),
               {s: losses[-1][s] for s in (4, 5)})


# ---------------------------------------------------------------------- measured memory
def test_disk_offload_drops_the_moments_from_resident_memory(corpus_dir: Path, cache_dir: Path,
                                                             tmp_path: Path) -> None:
    """A 13 M-parameter model (105 MB of moments), one process each for none and disk: the
    peak RSS of steps 2-3 (kernel VmHWM, reset every step) falls by >= 75 % of the moments."""
    from meshlm.data import build_data

    args = [
        "--model.preset=tiny", "--model.dim=512", "--model.n_layers=4",
        "--model.ffn_hidden=1536", f"--data.path={corpus_dir}", f"--data.cache_dir={cache_dir}",
        "--data.vocab_size=512", "--data.seq_len=32", "--train.steps=3",
        "--train.global_batch=4", "--train.micro_batch=4", "--train.eval_every=0",
        "--run.sample_tokens=0", "--train.peak_flops=1e10",
        "--run.malloc_mmap_kb=128",  # freed buffers go back to the OS: RSS = live memory
    ]
    build_data(load_config(None, args).data, log=lambda _m: None)  # cached before the runs
    procs = {kind: subprocess.Popen(
        [sys.executable, "-m", "meshlm.cli", "train", *args, f"--parallel.offload={kind}",
         f"--run.dir={tmp_path / kind}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for kind in ("none", "disk")}
    for kind, proc in procs.items():
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
        assert proc.returncode == 0, (kind, out[-2000:])
    recs = {kind: read_metrics(tmp_path / kind / "metrics.jsonl") for kind in procs}
    moments = recs["none"][-1]["optim_bytes"]
    assert moments > 100e6  # 8 bytes per parameter
    assert all(r["optim_bytes"] == 0 for r in recs["disk"])
    peak = {kind: max(r["mem_peak_bytes"] for r in rs[1:]) for kind, rs in recs.items()}
    drop = peak["none"] - peak["disk"]
    print(f"\nstep peak RSS: none {peak['none'] / 2**20:.0f} MiB, disk "
          f"{peak['disk'] / 2**20:.0f} MiB; moments {moments / 2**20:.0f} MiB")
    assert drop >= 0.75 * moments, (peak, moments)


# ---------------------------------------------------------------------- config and planner
def test_unwritable_offload_dir_is_one_clear_line(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from meshlm.cli import main

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for folder, message in ((blocker / "offload", "is not a directory"),
                            (blocker, "exists and is not a directory")):
        rc = main(["train", "--model.preset=tiny", "--parallel.offload=disk",
                   f"--parallel.offload_dir={folder}", f"--run.dir={tmp_path / 'r'}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith("meshlm: error: parallel.offload_dir=") and message in err[0]
        assert not (tmp_path / "r").exists()


def test_layout_and_planner_know_offload() -> None:
    from meshlm.models import get_preset
    from meshlm.planner.hardware import get_accelerator
    from meshlm.planner.memory import memory
    from meshlm.planner.workload import ModelSpec, Workload, parse_layout

    cfg = load_config(None, ["--model.preset=tiny", "--parallel.offload=disk"])
    lo = cfg.layout()
    assert lo.offload == "disk" and lo.describe().endswith(",offload=disk")
    assert parse_layout(lo.describe()) == lo
    assert Layout().describe() == Layout(offload="none").describe()
    assert "offload" not in Layout().describe()
    work = Workload(ModelSpec(get_preset("small")), 1024, 8)
    hw = get_accelerator("h100-sxm")
    for zero in (0, 1, 3):
        plain = memory(work, Layout(dp=2, zero=zero), hw)
        moved = memory(work, Layout(dp=2, zero=zero, offload="cpu"), hw)
        assert plain.items["optim"] > 0 and moved.items["optim"] == 0
        assert moved.host == {"optim": plain.items["optim"]}
        assert plain.allocated - moved.allocated == pytest.approx(plain.items["optim"])
    assert Layout(offload="tape").problems()[0].startswith("offload='tape' is not one of")
