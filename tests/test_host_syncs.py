"""Host synchronisations per training step, counted on CPU (``distributed/host_sync.py``).

- the counter sees the reads of tensor values and the value-shaped operations, and not
  :func:`host_array`'s reads of host memory (which refuses a device tensor);
- in one spawned world of 4, the host synchronisations of one training step (after a first
  step) do not grow with the micro-batches of a pipeline (pp 2 x dp 2: 2 vs 4 micro-batches),
  with the blocks of a document-masked ring (cp 2 x dp 2 vs cp 4, ring and zigzag, one
  micro-batch) nor with the micro-batches of context parallelism (cp 4: 1 vs 4), and stay few;
- the host decision of which ring blocks documents mask entirely equals the dense mask's;
- GPU-only paths, driven with fake streams and events: the asynchronous checkpoint's copy runs
  on a side stream that the compute stream waits for only before the next optimizer step (once),
  and the offloaded optimizer keeps each copy's sources until the host has waited for its event.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from meshlm.checkpoint.async_save import HostCopy
from meshlm.checkpoint.sharded import RankContents
from meshlm.distributed.host_sync import count_host_syncs, host_array
from meshlm.models.attention import Mask
from meshlm.parallel.offload import OffloadedAdamW, StreamCopies
from meshlm.parallel.ring_attention import documents_meet
from meshlm.testing import run_world


# ---------------------------------------------------------------------- the counter
def test_counter_sees_reads_of_values_and_value_shaped_ops() -> None:
    t = torch.tensor([1.5, -2.0])
    with count_host_syncs() as syncs:
        float(t[0]), bool(t[0] > 0), int(t[1]), t.sum().item(), t.tolist()
        _ = t[t > 0]  # boolean indexing: the output's size is read
        torch.nonzero(t)
        _ = t * 2 + 1  # (device work only: not counted)
        host_array(t)  # (host memory: not counted)
    assert syncs.total == 7, syncs.report()
    assert all("test_host_syncs.py" in site for site in syncs.sites), syncs.report()
    with pytest.raises(ValueError, match="host memory"):
        host_array(torch.empty(2, device="meta"))


# ---------------------------------------------------------------------- a step
def step_syncs(base: list[str], runs: list[list[str]]) -> list[dict[str, int]]:
    """World body: for each run, the host synchronisations of its second training step, by
    call site (the first step builds what is built once)."""
    from meshlm.config import load_config
    from meshlm.train.trainer import Trainer

    out = []
    for run in runs:
        trainer = Trainer(load_config(None, base + run), log=lambda _m: None, progress=False)
        try:
            trainer.train_step(1)
            with count_host_syncs() as syncs:
                trainer.train_step(2)
        finally:
            trainer.watch.close()
        out.append(dict(syncs.sites))
    return out


PP = ["--parallel.pp=2", "--parallel.dp=2", "--parallel.pp_schedule=1f1b"]
RUNS = {  # name -> overrides
    "pp2-m2": [*PP, "--train.micro_batch=2"],
    "pp2-m4": [*PP, "--train.micro_batch=1"],
    "cp2-ring": ["--parallel.cp=2", "--parallel.dp=2", "--parallel.cp_attention=ring",
                 "--data.doc_mask=true"],
    "cp4-ring": ["--parallel.cp=4", "--parallel.cp_attention=ring", "--data.doc_mask=true",
                 "--train.micro_batch=8"],
    "cp2-zigzag": ["--parallel.cp=2", "--parallel.dp=2", "--parallel.cp_attention=zigzag",
                   "--data.doc_mask=true"],
    "cp4-zigzag": ["--parallel.cp=4", "--parallel.cp_attention=zigzag",
                   "--data.doc_mask=true", "--train.micro_batch=8"],
    "cp4-m1": ["--parallel.cp=4", "--train.micro_batch=8"],
    "cp4-m4": ["--parallel.cp=4", "--train.micro_batch=2"],
}
PAIRS = [("pp2-m2", "pp2-m4"), ("cp2-ring", "cp4-ring"), ("cp2-zigzag", "cp4-zigzag"),
         ("cp4-m1", "cp4-m4")]


def test_host_syncs_per_step_do_not_grow_with_micro_batches_or_ring_blocks(
        short_docs: Path, cache_dir: Path, tmp_path: Path) -> None:
    base = ["--model.preset=tiny", "--model.n_layers=2", f"--data.path={short_docs}",
            f"--data.cache_dir={cache_dir}", "--data.vocab_size=512", "--data.seq_len=64",
            "--train.steps=2", "--train.global_batch=8", "--train.micro_batch=4",
            "--run.sample_tokens=0", "--train.peak_flops=1e10"]
    runs = [[*args, f"--run.dir={tmp_path / name}"] for name, args in RUNS.items()]
    per_rank = run_world(4, step_syncs, base, runs)
    counts = {name: [sum(rank[i].values()) for rank in per_rank]
              for i, name in enumerate(RUNS)}
    print("host syncs per step, by rank:", counts)
    for few, more in PAIRS:
        i, j = list(RUNS).index(few), list(RUNS).index(more)
        for rank in per_rank:
            grown = {site: n for site, n in rank[j].items() if n > rank[i].get(site, 0)}
            assert sum(rank[j].values()) <= sum(rank[i].values()), (few, more, grown)
    assert max(max(c) for c in counts.values()) <= 8, counts


# ---------------------------------------------------------------------- ring blocks
def test_documents_meet_equals_the_dense_mask() -> None:
    """The host decision (no device read) is the dense mask's ``any()``, for contiguous and
    zigzag-like blocks, with and without a window, ids sorted or not."""
    rng = np.random.default_rng(0)
    s = 32
    for trial in range(300):
        b = int(rng.integers(1, 4))
        ids = (np.sort(rng.integers(0, 6, (b, s)), axis=1) if trial % 3
               else rng.integers(-2, 3, (b, s)))
        q_pos = np.sort(rng.choice(s, int(rng.integers(1, 12)), replace=False))
        k_pos = np.sort(rng.choice(s, int(rng.integers(1, 12)), replace=False))
        window = int(rng.choice([0, 1, 3, 7]))
        t = torch.from_numpy(ids)
        mask = Mask(q_pos, k_pos, window, t[:, q_pos], t[:, k_pos])
        want = bool(mask.dense(torch.device("cpu")).any())
        assert documents_meet(ids, q_pos, k_pos, window) == want, (ids, q_pos, k_pos, window)


# ---------------------------------------------------------------------- GPU-only paths
class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name
        self.on_sync: Any = None

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        if self.on_sync is not None:
            self.on_sync()
        self.log.append(("synchronize", self.name))


class FakeStream:
    def __init__(self, streams: FakeStreams, name: str) -> None:
        self.streams, self.name = streams, name

    def wait_stream(self, other: FakeStream) -> None:
        self.streams.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.streams.log.append(("wait_event", self.name, event.name))

    def record_event(self) -> FakeEvent:
        event = self.streams.Event()
        event.record(self)
        return event


class FakeStreams:
    """The part of ``torch.cuda``'s stream API the side-stream paths use, logging calls."""

    def __init__(self) -> None:
        self.log: list = []
        self.compute = FakeStream(self, "compute")
        self.events = 0

    def Stream(self, device: Any = None) -> FakeStream:  # noqa: N802
        return FakeStream(self, "side")

    def Event(self) -> FakeEvent:  # noqa: N802
        self.events += 1
        return FakeEvent(self.log, f"e{self.events}")

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.compute

    @contextmanager
    def stream(self, s: FakeStream):  # noqa: ANN201
        self.log.append(("enter", s.name))
        yield
        self.log.append(("exit", s.name))


def test_async_checkpoint_copy_waits_only_before_the_next_optimizer_step() -> None:
    streams = FakeStreams()
    w = torch.nn.Parameter(torch.arange(6.0))
    opt = torch.optim.AdamW([w], lr=0.1)
    host = HostCopy(pinned=False, streams=streams)

    def take() -> RankContents:
        return host.take(RankContents({"weight/w/0/0": w.detach()}, {}), opt)

    copied = take()
    assert torch.equal(copied.tensors["weight/w/0/0"], torch.arange(6.0))
    assert streams.log == [("wait_stream", "side", "compute"), ("enter", "side"),
                           ("exit", "side"), ("record", "e1", "side")]
    streams.log.clear()
    w.grad = torch.ones(6)
    opt.step()  # the first write of what was copied: the compute stream waits, on the device
    opt.step()
    assert streams.log == [("wait_event", "compute", "e1")]
    streams.log.clear()
    take()
    take()  # (no step between two saves: the later event covers both)
    opt.step()
    opt.step()
    assert [e for e in streams.log if e[0] == "wait_event"] == [("wait_event", "compute", "e3")]
    streams.log.clear()
    host.take(RankContents({"weight/w/0/0": w.detach()}, {}), None)  # no optimizer: at once
    assert streams.log[-1] == ("wait_event", "compute", "e4")


def test_offload_keeps_each_copy_source_until_the_host_waited_for_it() -> None:
    """A gradient that is not contiguous is copied flat before its device -> host copy: that
    temporary must outlive the copy (here: be alive when the host waits for the slot's
    event). The step still equals torch's AdamW."""
    torch.manual_seed(0)
    shapes = [(5, 3), (4, 6), (7,)]
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    grads = [torch.randn(tuple(reversed(s))).t() if len(s) == 2 else torch.randn(s)
             for s in shapes]
    assert not grads[0].is_contiguous()
    for p, q, g in zip(ref, mine, grads, strict=True):
        p.grad, q.grad = g.contiguous(), g
    base = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.0)
    opt = OffloadedAdamW.like(torch.optim.AdamW(mine, lr=0.1, weight_decay=0.0), "cpu",
                              chunk=16, staged=True)
    streams = FakeStreams()
    copies = opt.copies = StreamCopies(torch.device("cpu"), streams)
    alive: list[list[bool]] = []
    for slot, event in enumerate(copies.ready):
        def check(slot: int = slot) -> None:  # every source of the slot's copies still alive
            alive.append([r() is not None for r in refs[slot]])
        event.on_sync = check
    refs: list[list[weakref.ref]] = [[], []]
    issue = StreamCopies.to_host

    def to_host(self: StreamCopies, slot: int, pairs: list) -> None:
        refs[slot] = [weakref.ref(src) for _, src in pairs]
        issue(self, slot, pairs)

    StreamCopies.to_host = to_host  # type: ignore[method-assign]
    try:
        base.step()
        opt.step()
    finally:
        StreamCopies.to_host = issue  # type: ignore[method-assign]
    assert len(alive) >= 3 and all(all(a) for a in alive), alive
    assert copies.sources == [[], []]  # (released once waited for)
    for p, q in zip(ref, mine, strict=True):
        assert torch.equal(p, q)
