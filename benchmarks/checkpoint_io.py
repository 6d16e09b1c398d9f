"""Sharded checkpoint save and load at world size 4: meshlm ZeRO-3 vs torch FSDP2 + DCP.

Both sides hold the same model (meshlm's ``Transformer``, fp32) sharded over 4 gloo ranks with
AdamW moments after one optimizer step, and write weights + both moments:

- meshlm dp=4 zero=3: the model built shard-only on the meta device and parallelised
  (``meshlm.parallel.parallelize`` with the seed's ``InitSource``); saved with
  ``meshlm.checkpoint.sharded.save_checkpoint`` (each rank writes ``rank_NNNNN.safetensors``,
  rank 0 the index), loaded with ``ShardedCheckpoint`` + ``load_into`` (index validated, each
  rank reads its boxes);
- torch FSDP2: the model built whole, ``fully_shard`` on every decoder layer then the root,
  ``torch.optim.AdamW``; saved with ``torch.distributed.checkpoint.save`` of
  ``get_state_dict(model, optimizer)`` (each rank writes ``__R_0.distcp``, the coordinator
  ``.metadata``), loaded with ``dcp.load`` into fresh state dicts + ``set_state_dict``. DCP's
  ``FileSystemWriter`` fsyncs every file by default (``sync_files=True``), as meshlm's save
  does (files, then the directory before its rename); DCP runs twice in its world,
  alternating: as by default (the like-for-like row the ratios use) and with
  ``sync_files=False``.

Times are collective: from a barrier to the end of the operation on the slowest rank (a
barrier after it). Bytes: the file each rank writes. Each world runs ``--reps`` save + load
repetitions (a fresh directory each; loads read files the page cache still holds, on both
sides); the table reports medians.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_io.py [--models small 300M] [--reps 3]
        [--json benchmarks/results/checkpoint_io.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshlm.config import load_config
from meshlm.distributed.spawn import run_world

WORLD, SEQ, VOCAB = 4, 128, 4096
MIB = 2**20
MODELS: dict[str, list[str]] = {
    "small": [],
    "300M": ["--model.n_layers=24", "--model.dim=1024", "--model.n_heads=16",
             "--model.n_kv_heads=16", "--model.ffn_hidden=2816"],
}
REF = "torch-fsdp2-dcp"  # the ratios' reference (fsync, as meshlm)


def config(model: str):  # noqa: ANN201
    return load_config(None, [
        "--model.preset=small", *MODELS[model], f"--data.seq_len={SEQ}",
        f"--data.vocab_size={VOCAB}", f"--train.global_batch={WORLD}", "--train.micro_batch=1",
        f"--parallel.dp={WORLD}", "--parallel.zero=3", "--run.dir=unused",
    ], check_paths=False)


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def timed(fn: Any) -> float:
    """Collective wall time of ``fn()``: barrier, run, barrier; the slowest rank's."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def meshlm_side(model_name: str, root: Path, reps: int) -> dict[str, Any]:
    from meshlm.checkpoint.sharded import (
        ShardedCheckpoint,
        load_into,
        rank_file,
        save_checkpoint,
    )
    from meshlm.distributed.comm import Comm, CommLog
    from meshlm.distributed.mesh import Mesh
    from meshlm.distributed.source import InitSource
    from meshlm.models.llama import build_model
    from meshlm.parallel import parallelize

    cfg = config(model_name)
    mesh = Mesh(cfg.layout(), "cpu")
    comm = Comm(mesh, CommLog())
    mc = cfg.model_config(vocab_size=VOCAB)
    model = build_model(mc, device="meta")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    engine = parallelize(model, comm, cfg.parallel, cfg.train,
                         source=InitSource(mc, cfg.train.seed, shapes)).engine
    x, y = batch(mesh.rank)
    loss_of(model(x), y).backward()
    engine.finish_grads()
    engine.clip_grad_norm(1.0)
    engine.step(1e-4)
    engine.zero_grad()
    device = torch.device("cpu")
    saves, loads, sizes = [], [], []
    for rep in range(reps):
        ckpt_root = root / f"meshlm-{rep}"
        out: list[Path] = []
        saves.append(timed(lambda r=ckpt_root, o=out: o.append(save_checkpoint(
            r, 1, engine, comm, trainer_state={}, extra_files={"config.toml": ""}, keep=0))))
        sizes.append((out[0] / rank_file(mesh.rank)).stat().st_size)

        def load(d: Path = out[0]) -> None:
            with ShardedCheckpoint(d) as ckpt:
                load_into(ckpt, engine, device)

        loads.append(timed(load))
        dist.barrier()
        if mesh.rank == 0:
            shutil.rmtree(ckpt_root)
    return {"save_s": saves, "load_s": loads, "bytes": sizes[-1],
            "params": mc.num_params()}


def torch_side(model_name: str, root: Path, reps: int) -> dict[str, dict[str, Any]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from meshlm.models.llama import build_model

    cfg = config(model_name)
    rank = dist.get_rank()
    mc = cfg.model_config(vocab_size=VOCAB)
    model = build_model(mc, cfg.train.seed)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x, y = batch(rank)
    loss_of(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    out: dict[str, dict[str, Any]] = {}
    for rep in range(reps):
        for impl, sync in (("torch-fsdp2-dcp", True), ("torch-fsdp2-dcp-nosync", False)):
            ckpt_dir = root / f"{impl}-{rep}"

            def save(d: Path = ckpt_dir, sync: bool = sync) -> None:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd},
                         storage_writer=dcp.FileSystemWriter(str(d), sync_files=sync))

            def load(d: Path = ckpt_dir) -> None:
                msd, osd = get_state_dict(model, opt)
                dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(d))
                set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

            r = out.setdefault(impl, {"save_s": [], "load_s": [], "params": mc.num_params()})
            r["save_s"].append(timed(save))
            r["bytes"] = sum(p.stat().st_size for p in ckpt_dir.glob(f"__{rank}_*.distcp"))
            r["load_s"].append(timed(load))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ckpt_dir)
    return out


def worker(side: str, model_name: str, root: str, reps: int) -> dict[str, dict[str, Any]]:
    """{implementation: times and bytes} of one side on this rank."""
    if side == "meshlm":
        return {"meshlm-zero3": meshlm_side(model_name, Path(root), reps)}
    return torch_side(model_name, Path(root), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/checkpoint_io.json")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="meshlm-ckpt-io-"))
    rows = []
    try:
        for model in a.models:
            for side in ("meshlm", "torch"):
                res = run_world(WORLD, worker, side, model, str(tmp / f"{model}-{side}"),
                                a.reps, timeout=1800.0)
                for impl in res[0]:
                    row = {"model": model, "params": res[0][impl]["params"], "impl": impl,
                           "save_s": statistics.median(res[0][impl]["save_s"]),
                           "load_s": statistics.median(res[0][impl]["load_s"]),
                           "save_runs_s": res[0][impl]["save_s"],
                           "load_runs_s": res[0][impl]["load_s"],
                           "bytes_per_rank": [r[impl]["bytes"] for r in res]}
                    rows.append(row)
                    print(f"{model} {impl}: save {row['save_s']:.2f} s, load "
                          f"{row['load_s']:.2f} s, {max(row['bytes_per_rank']) / MIB:.1f} MiB "
                          "on the largest rank", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nworld {WORLD} (gloo, 1 thread/rank), fp32 weights + AdamW moments, median of "
          f"{a.reps} repetitions")
    print("| model | implementation | save (s) | load (s) | bytes per rank (MiB) | "
          "save ratio | load ratio |")
    print("|---|---|---|---|---|---|---|")
    ref = {r["model"]: r for r in rows if r["impl"] == REF}
    for r in rows:
        t = ref.get(r["model"])
        mine = r["impl"] == "meshlm-zero3" and t is not None
        r["save_ratio"] = r["save_s"] / t["save_s"] if mine else None
        r["load_ratio"] = r["load_s"] / t["load_s"] if mine else None
        per_rank = " / ".join(f"{b / MIB:.1f}" for b in r["bytes_per_rank"])
        ratios = [f"{x:.2f}" if x else "-" for x in (r["save_ratio"], r["load_ratio"])]
        print(f"| {r['model']} ({r['params'] / 1e6:.1f} M) | {r['impl']} | {r['save_s']:.2f} | "
              f"{r['load_s']:.2f} | {per_rank} | {ratios[0]} | {ratios[1]} |")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "world": WORLD, "rows": rows}, indent=1))
    print(f"ratios: meshlm / {REF} (DCP with fsync, as meshlm's save); wrote {out}")


if __name__ == "__main__":
    main()
