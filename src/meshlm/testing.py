"""Comparison helpers for parity checks of a layout against the single-process reference.

Weights are compared per tensor by the relative norm of the difference,
``||a - b|| / ||b||``. Element-wise relative error is the wrong measure after a few AdamW steps:
an element whose gradient is a near-cancelling sum has a large relative rounding error under
any change of summation order (micro-batching, a reduce-scatter), and Adam's normalised update
``m / sqrt(v)`` turns that into an absolute weight difference of up to ``lr * rel_error`` on that
one element, while the tensor as a whole agrees to ~1e-7.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (0 when both are zero)."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    denom = b64.norm().item()
    diff = (a64 - b64).norm().item()
    return diff if denom == 0 else diff / denom


def max_relative_difference(
    got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]
) -> tuple[float, str]:
    """Largest per-tensor relative difference and its name; names must match exactly."""
    if set(got) != set(ref):
        raise AssertionError(f"parameter names differ: {sorted(set(got) ^ set(ref))[:5]}")
    worst, worst_name = 0.0, ""
    for name, r in ref.items():
        if got[name].shape != r.shape:
            raise AssertionError(f"{name}: shape {tuple(got[name].shape)} != {tuple(r.shape)}")
        d = relative_difference(got[name], r)
        if d > worst:
            worst, worst_name = d, name
    return worst, worst_name


def assert_weights_close(
    got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], rel: float = 1e-5
) -> None:
    worst, name = max_relative_difference(got, ref)
    if worst >= rel:
        raise AssertionError(f"{name}: relative difference {worst:.3e} >= {rel:.0e}")


# ---------------------------------------------------------------------- spawned worlds
def _world_entry(rank: int, world: int, port: int, fn, args, queue, timeout: float) -> None:  # noqa: ANN001
    import faulthandler
    import os
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # A stuck rank prints every thread's stack before the parent gives up on it.
    faulthandler.dump_traceback_later(max(10.0, timeout - 20), exit=False)
    try:
        # a collective that waits longer than this raises instead of hanging
        limit = timedelta(seconds=max(30.0, timeout - 40))
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=limit)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=limit)
        queue.put((rank, "ok", fn(*args)))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world: int, fn, *args, timeout: float = 300.0) -> list:  # noqa: ANN001
    """Run ``fn(*args)`` on ``world`` gloo ranks (spawned, one thread each); rank-ordered results.

    ``fn`` must be importable (module level). A failing rank raises here with its traceback.
    """
    import queue as queue_mod

    import torch.distributed as dist
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # The parent serves the rendezvous store on a port the OS picks: no race for a free port
    # with other worlds started at the same time.
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_world_entry, args=(r, world, port, fn, args, q, timeout),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        while len(results) < world:
            try:
                rank, status, value = q.get(timeout=timeout)
            except queue_mod.Empty:
                raise TimeoutError(f"world of {world} timed out after {timeout}s") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        del store
    return [results[r] for r in range(world)]


# ---------------------------------------------------------------------- training runs
def train_runs(base: list[str], runs: list[list[str]]) -> list[dict[int, float]]:
    """Train ``base + run`` for each run in turn (works as a spawned-world body); losses."""
    from .config import load_config
    from .train.trainer import train

    return [train(load_config(None, base + r), log=lambda _m: None, progress=False).losses
            for r in runs]


def final_weights(run_dir) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Full weights of the latest checkpoint of a run directory."""
    from pathlib import Path

    from .checkpoint.state import find_latest, load_state

    return load_state(find_latest(Path(run_dir) / "checkpoints"))["weights"]
