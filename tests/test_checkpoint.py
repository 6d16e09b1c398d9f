"""Sharded checkpoints: exact resume, resharding to other layouts, shard-only construction,
damaged checkpoints, and nothing ever unpickled from disk."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from meshlm import load_model
from meshlm.checkpoint import CheckpointError, ShardedCheckpoint, validate
from meshlm.checkpoint.sharded import read_local
from meshlm.config import load_config
from meshlm.testing import (
    final_weights,
    max_relative_difference,
    relative_difference,
    run_cli,
    run_world,
)
from meshlm.train.trainer import Trainer, train

STEPS, HALF = 10, 5


def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
        "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
        "--train.global_batch=8", "--train.warmup_steps=2", "--train.eval_every=0",
        "--run.sample_tokens=0", "--train.peak_flops=1e10", "--train.grad_clip=0.5",
        f"--train.checkpoint_every={HALF}", "--parallel.bucket_mb=0.05",
    ]


def _quiet(_m: str) -> None:
    pass


def fixed_batch() -> torch.Tensor:
    return torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(7))


def train_one(base: list[str], extra: list[str]) -> dict[int, float]:
    return train(load_config(None, base + extra), log=_quiet, progress=False).losses


def cut_copy(src: Path, dst: Path, keep_step: int) -> None:
    """``dst``: the run ``src`` as it was after checkpoint ``keep_step`` (later ones removed)."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").iterdir():
        if int(ckpt.name.split("_")[1]) > keep_step:
            shutil.rmtree(ckpt)


def source_then_resume(base: list[str], src: Path, cut: Path, layout: list[str]) -> dict:
    """World body: the source run, then (same layout) a resume from its step-5 checkpoint."""
    import torch.distributed as dist

    full = train_one(base, layout + [f"--run.dir={src}"])
    if dist.get_rank() == 0:
        cut_copy(src, cut, HALF)
    dist.barrier()
    resumed = train_one(base, layout + [f"--run.dir={cut}", "--run.resume=true"])
    return {"full": full, "resumed": resumed}


def resume_elsewhere(base: list[str], src: Path, runs: list[tuple[str, list[str]]]) -> dict:
    """World body: for each (name, layout), resume a copy of ``src``'s step-5 checkpoint on that
    layout: logits on a fixed batch right after loading, losses of the steps that follow, and
    the elements this rank read from the checkpoint."""
    import torch.distributed as dist

    out = {}
    for name, layout in runs:
        run_dir = src.parent / f"{src.name}-{name}"
        if not dist.is_initialized() or dist.get_rank() == 0:
            cut_copy(src, run_dir, HALF)
        if dist.is_initialized():
            dist.barrier()
        reads = []
        original = ShardedCheckpoint.read

        def counting(self, kind, tensor, box, _orig=original, _reads=reads):  # noqa: ANN001, ANN202
            _reads.append(torch.Size([s.stop - s.start for s in box]).numel())
            return _orig(self, kind, tensor, box)

        ShardedCheckpoint.read = counting
        try:
            trainer = Trainer(load_config(None, base + layout + [f"--run.dir={run_dir}",
                                                                 "--run.resume=true"]),
                              log=_quiet, progress=False)
        finally:
            ShardedCheckpoint.read = original
        with torch.no_grad():
            logits = trainer.logits(fixed_batch())
        held = sum(o.hi - o.lo for o in trainer.model_part.engine.owned())
        fused = [bool(g.get("fused")) for g in trainer.model_part.engine.optimizer.param_groups]
        out[name] = {"logits": logits, "losses": trainer.fit().losses, "read": sum(reads),
                     "owned": held, "fused": fused}
    return out


LAYOUT_8 = ["--parallel.dp=2", "--parallel.tp=2", "--parallel.pp=2", "--parallel.zero=1",
            "--train.micro_batch=2", "--parallel.sp=true"]


@pytest.fixture(scope="module")
def source_run(corpus_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """dp=2 tp=2 pp=2 zero=1 (sp): 10 steps, and a resume of its step-5 checkpoint."""
    root = tmp_path_factory.mktemp("ckpt")
    base = base_args(corpus_dir, cache_dir)
    res = run_world(8, source_then_resume, base, root / "src", root / "cut", LAYOUT_8)[0]
    return base, root, res


def test_resume_on_the_same_layout_is_exact(source_run) -> None:  # noqa: ANN001
    _, root, res = source_run
    assert sorted(res["resumed"]) == list(range(HALF + 1, STEPS + 1))
    for step, loss in res["resumed"].items():
        assert loss == res["full"][step], step  # bitwise: same layout, same order of sums
    a, b = final_weights(root / "src"), final_weights(root / "cut")
    for name, t in a.items():
        assert torch.equal(t, b[name]), name


def test_checkpoint_files_are_per_rank_and_cover_every_tensor(source_run) -> None:  # noqa: ANN001
    _, root, _ = source_run
    ckpt = root / "src" / "checkpoints" / "step_0000010"
    index = validate(ckpt)
    files = sorted(p.name for p in ckpt.glob("rank_*.safetensors"))
    assert files == [f"rank_{r:05d}.safetensors" for r in range(8)]
    # each element once: the sizes of the stored weights add up to the model's
    n_params = sum(torch.Size(t["shape"]).numel() for t in index["tensors"].values())
    stored = sum(torch.Size([b - a for a, b in p["box"]]).numel()
                 for f in index["files"].values() for p in f["pieces"] if p["kind"] == "weight")
    assert stored == n_params
    # no file holds the whole model: every rank wrote its share only
    per_file = [sum(torch.Size([b - a for a, b in p["box"]]).numel()
                    for p in f["pieces"] if p["kind"] == "weight")
                for f in index["files"].values()]
    assert max(per_file) < n_params / 2, per_file
    assert not list(ckpt.glob("*.pt")) and not list(ckpt.glob("*.pkl"))


def test_reshard_to_other_layouts(source_run) -> None:  # noqa: ANN001
    """Saved under dp2 tp2 pp2 zero1: loads under dp4 zero3, tp4, and one process with equal
    logits, and training goes on with the losses of the source run."""
    base, root, res = source_run
    ref_logits = load_model(root / "cut" / "checkpoints" / "step_0000005")(fixed_batch())
    got = run_world(4, resume_elsewhere, base, root / "src",
                    [("zero3", ["--parallel.dp=4", "--parallel.zero=3",
                                "--train.micro_batch=2"]),
                     ("tp4", ["--parallel.tp=4", "--train.micro_batch=4"]),
                     # written by the fused AdamW, resumed by the foreach one
                     ("zero3-foreach", ["--parallel.dp=4", "--parallel.zero=3",
                                        "--train.micro_batch=2", "--train.adamw_impl=foreach"])])
    got0 = got[0]
    got0.update(resume_elsewhere(base, root / "src", [("one", ["--train.micro_batch=8"]),
                                                      ("one-foreach", [
                                                          "--train.micro_batch=8",
                                                          "--train.adamw_impl=foreach"])]))
    for name, r in got0.items():
        # every engine (ZeRO-3 shards, tp shards, one process) steps with the fused AdamW
        # unless the run asks for foreach (train.adamw_impl)
        assert r["fused"] == [not name.endswith("foreach")] * 2, (name, r["fused"])
        assert relative_difference(r["logits"], ref_logits) < 1e-6, name
        assert sorted(r["losses"]) == list(range(HALF + 1, STEPS + 1)), name
        for step, loss in r["losses"].items():
            assert abs(loss - res["full"][step]) / res["full"][step] < 1e-5, (name, step)
        worst, tensor = max_relative_difference(final_weights(root / f"src-{name}"),
                                                final_weights(root / "src"))
        assert worst < 1e-5, (name, tensor, worst)
    # each ZeRO-3 rank read only its shard: weights + two moments of what it owns
    for r in got:
        z = r["zero3"]
        assert 0 < z["read"] <= 3 * z["owned"], z


# ---------------------------------------------------------------------- construction memory
def test_foreach_checkpoint_resumes_under_fused_adamw(corpus_dir: Path, cache_dir: Path,
                                                      tmp_path: Path) -> None:
    """A checkpoint written by the foreach AdamW resumes under the fused one: the state it
    installs is the saved one (step count, both moments, bit for bit; ``step`` where the
    fused kernel keeps it) and the losses and weights that follow are the foreach run's."""
    base = base_args(corpus_dir, cache_dir) + ["--train.micro_batch=8"]
    src = tmp_path / "src"
    full = train_one(base, ["--train.adamw_impl=foreach", f"--run.dir={src}"])
    cut = tmp_path / "cut"
    cut_copy(src, cut, HALF)
    trainer = Trainer(load_config(None, base + [f"--run.dir={cut}", "--run.resume=true"]),
                      log=_quiet, progress=False)
    opt = trainer.model_part.engine.optimizer
    assert all(g["fused"] for g in opt.param_groups)
    with ShardedCheckpoint(cut / "checkpoints" / f"step_{HALF:07d}") as ckpt:
        for o in trainer.model_part.engine.owned():
            state = opt.state[o.key]
            assert state["step"].dtype == torch.float32 and float(state["step"]) == HALF
            assert state["step"].device == o.key.device
            for kind in ("exp_avg", "exp_avg_sq"):
                saved = read_local(ckpt.source(kind), o.spec, o.lo, o.hi, o.key.device)
                assert torch.equal(state[kind].reshape(-1), saved), (o.spec.name, kind)
    resumed = trainer.fit().losses
    assert sorted(resumed) == list(range(HALF + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert abs(loss - full[step]) / full[step] < 1e-5, step
    worst, tensor = max_relative_difference(final_weights(cut), final_weights(src))
    assert worst < 1e-5, (tensor, worst)


def construct_zero3(dims: dict, zero: int) -> dict:
    """World body: shard-only construction of a ~27 M-parameter model; peak RSS growth."""
    import resource

    import torch._dynamo  # noqa: F401 -- torch's optimizers import it when first built: not ours
    import torch.distributed as dist

    from meshlm.config import ParallelSection, TrainSection
    from meshlm.distributed.comm import Comm, CommLog
    from meshlm.distributed.mesh import Mesh
    from meshlm.distributed.source import InitSource
    from meshlm.layout import Layout
    from meshlm.models.config import ModelConfig
    from meshlm.models.llama import build_model
    from meshlm.parallel import parallelize

    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = Mesh(Layout(dp=world))
    comm = Comm(mesh, CommLog())
    from meshlm.train.trainer import pin_malloc_mmap_threshold

    # freed buffers go back to the system (as run.malloc_mmap_kb does): the peak counts live
    # tensors, not holes glibc's heap keeps after its threshold rises
    pin_malloc_mmap_threshold()
    cfg = ModelConfig(**dims)
    model = build_model(cfg, device="meta")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    source = InitSource(cfg, 0, shapes)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    par = parallelize(model, comm, ParallelSection(dp=world, zero=zero), TrainSection(),
                      source=source)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    state = par.engine.state_bytes()
    return {"growth": peak - base, "params": state["params"],
            "largest": 4 * max(torch.Size(s).numel() for s in shapes.values()),
            "model": 4 * sum(torch.Size(s).numel() for s in shapes.values())}


DIMS = {"vocab_size": 2048, "dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 8,
        "ffn_hidden": 1376}


def test_shard_only_construction_holds_only_the_shards() -> None:
    """ZeRO-3 over 4 ranks: building the model raises a rank's memory by at most its weight
    shard and its gradient shard (allocated with it) plus two buffers of the largest parameter
    (the drawn global tensor and its slice) -- never the whole model's weights."""
    for r in run_world(4, construct_zero3, DIMS, 3):
        shards = 2 * r["params"]  # weights + gradients, each 1/4 of the model
        bound = shards + 2 * r["largest"] + 24 * 2**20  # (+ allocator and process-group slack)
        assert r["growth"] < bound, r
        assert r["growth"] < r["model"], r  # never the whole model


# ---------------------------------------------------------------------- damage and safety
@pytest.fixture()
def small_run(tiny_args: list[str], tmp_path: Path) -> Path:
    train(load_config(None, tiny_args + ["--train.steps=4", "--train.checkpoint_every=2"]),
          log=_quiet, progress=False)
    return tmp_path / "run"


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _damage(kind: str, ckpt: Path) -> str:
    """Damage a checkpoint; returns what the error must name."""
    if kind == "missing shard":
        (ckpt / "rank_00000.safetensors").unlink()
        return "rank_00000.safetensors"
    if kind == "truncated":
        path = ckpt / "rank_00000.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
        return "rank_00000.safetensors"
    if kind == "index edited":
        index = json.loads((ckpt / "index.json").read_text())
        piece = index["files"]["rank_00000.safetensors"]["pieces"][0]
        piece["box"][0][1] -= 1
        (ckpt / "index.json").write_text(json.dumps(index))
        return "index"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing shard", "truncated", "index edited"])
def test_damaged_checkpoint_is_named_and_auto_resume_falls_back(
        small_run: Path, tiny_args: list[str], kind: str) -> None:
    latest = small_run / "checkpoints" / "step_0000004"
    needle = _damage(kind, latest)
    with pytest.raises(CheckpointError, match=needle):
        validate(latest)
    before = _snapshot(small_run / "checkpoints")
    # the CLI: one line naming the file, no traceback, nothing written
    out = run_cli(["generate", "--checkpoint", str(latest), "--prompt", "x"])
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert _snapshot(small_run / "checkpoints") == before
    # auto-resume says so and continues from step 2 with the losses of an undamaged run
    logs: list[str] = []
    res = train(load_config(None, tiny_args + ["--train.steps=4", "--train.checkpoint_every=2",
                                               "--run.resume=auto"]),
                log=logs.append, progress=False)
    assert any(needle in m and "falling back to step_0000002" in m for m in logs), logs
    assert sorted(res.losses) == [3, 4]


def test_checkpoint_of_another_model_is_refused(small_run: Path, tiny_args: list[str],
                                                tmp_path: Path) -> None:
    before = _snapshot(small_run)
    with pytest.raises(CheckpointError, match="layers.0.attention.wq.weight|has shape"):
        train(load_config(None, tiny_args + [f"--run.dir={tmp_path / 'other'}",
                                             f"--model.init_from={small_run}",
                                             "--model.dim=32", "--model.n_heads=4",
                                             "--model.n_kv_heads=2"]),
              log=_quiet, progress=False)
    assert _snapshot(small_run) == before


class _Payload:
    """Unpickling this creates ``marker``: proof that a file was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


def test_nothing_is_unpickled(small_run: Path, tiny_args: list[str], tmp_path: Path) -> None:
    marker = tmp_path / "UNPICKLED"
    ckpt = small_run / "checkpoints" / "step_0000004"
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Payload(probe)))
    assert probe.exists()  # the payload works: unpickling it would leave the marker
    torch.save({"x": _Payload(marker)}, ckpt / "optimizer.pt")
    torch.save({"x": _Payload(marker)}, ckpt / "rng.pt")
    for name in ("trainer.pt", "metadata.pkl", ".metadata", "model.bin"):
        (ckpt / name).write_bytes(pickle.dumps({"x": _Payload(marker)}))
    load_model(small_run)
    train(load_config(None, tiny_args + ["--train.steps=5", "--run.resume=true"]),
          log=_quiet, progress=False)
    for args in (["generate", "--checkpoint", str(ckpt), "--prompt", "x",
                  "--max-new-tokens", "2"],
                 ["convert", str(ckpt), "--to-hf", str(tmp_path / "hf")]):
        out = run_cli(args)
        assert out.returncode == 0, out.stderr
    load_model(tmp_path / "hf")
    assert not marker.exists()


def test_memory_is_reported_per_phase(small_run: Path, tiny_args: list[str]) -> None:
    from meshlm.train.metrics import read_metrics

    logs: list[str] = []
    train(load_config(None, tiny_args + ["--train.steps=6", "--train.checkpoint_every=2",
                                         "--run.resume=true"]), log=logs.append, progress=False)
    records = {r["step"]: r for r in read_metrics(small_run / "metrics.jsonl")}
    assert sorted(records) == list(range(1, 7))
    assert records[1]["mem_construction_bytes"] > 0 and "mem_load_bytes" not in records[1]
    assert records[5]["mem_construction_bytes"] > 0 and records[5]["mem_load_bytes"] > 0
    assert {s for s, r in records.items() if "mem_save_bytes" in r} == {2, 4, 6}
    assert all(r["mem_peak_bytes"] > 0 for r in records.values())
    assert any(m.startswith("peak memory at construction") for m in logs), logs
    assert any(m.startswith("peak memory at load") for m in logs), logs
