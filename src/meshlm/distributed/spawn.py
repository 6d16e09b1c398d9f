"""Spawned gloo worlds on this machine: run a module-level function on N ranks, get results.

Used by the planner's calibration (collectives over loopback) and by tests and benchmarks.
Each rank is a fresh process with one thread, forked from a forkserver that has torch and meshlm
imported (``spawn`` where there is no forkserver), with the caller's environment; the parent
serves the rendezvous store.
"""

from __future__ import annotations

import os
import pickle
import time

import torch

from .forkserver import CallerStdio, ensure_server, forkserver_context

# What a forked rank finds imported: the forkserver imports these once, then forks every rank
# of every world from itself (a spawned rank imports torch and meshlm anew, seconds each).
# torch._dynamo: torch's optimizers import it when the first one is built (seconds per rank).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "meshlm.train.trainer",
           "meshlm.distributed.spawn"]


def _context():  # noqa: ANN202
    return forkserver_context(PRELOAD)


def _world_entry(stdio: CallerStdio, rank: int, world: int, port: int, fn, args,  # noqa: ANN001
                 queue, timeout: float, collective_timeout: float | None,  # noqa: ANN001
                 environ: dict[str, str]) -> None:
    # stdio first: the caller's stdout / stderr are in place before ``fn`` is unpickled (a
    # function whose module does not import is reported there, not to the server's streams)
    import faulthandler
    import os
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    # the caller's environment as it is now (a forked rank has the forkserver's, from its start)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # A stuck rank prints every thread's stack before the parent gives up on it.
    faulthandler.dump_traceback_later(max(10.0, timeout - 20), exit=False)
    try:
        # a collective that waits longer than this raises instead of hanging
        limit = timedelta(seconds=collective_timeout or max(30.0, timeout - 40))
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=limit)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=limit)
        if world > 1:  # every rank's gloo mesh complete before any rank may end (see init_worker)
            dist.barrier()
        # plain pickle: tensors travel by value, not as shared memory that vanishes when
        # this process exits before the parent has read the result
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world: int, fn, *args, timeout: float = 1800.0,  # noqa: ANN001
              collective_timeout: float | None = None) -> list:
    """Run ``fn(*args)`` on ``world`` gloo ranks (one thread each); rank-ordered results.

    ``fn`` must be importable (module level). A failing rank raises here with its traceback.
    ``timeout`` guards against a hang, not a slow machine: a world of many training runs on a
    loaded 2-core machine takes several times its idle time, so the default is generous.
    ``collective_timeout``: the process group's (default ``timeout`` - 40 s, at least 30 s), for
    a world expected to deadlock.
    """
    import queue as queue_mod

    import torch.distributed as dist

    ctx = _context()
    ensure_server(ctx)
    q = ctx.Queue()
    # The parent serves the rendezvous store on a port the OS picks: no race for a free port
    # with other worlds started at the same time.
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
    env = dict(os.environ)
    procs = [ctx.Process(target=_world_entry, daemon=True,
                         args=(CallerStdio(), r, world, port, fn, args, q, timeout,
                               collective_timeout, env))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, status, value = q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None
                        and r not in results]
                if dead and q.empty():  # (a rank that died without a word: a signal, an abort)
                    time.sleep(0.5)
                    if q.empty():
                        code = procs[dead[0]].exitcode
                        raise RuntimeError(f"rank {dead[0]} died (exit code {code})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"world of {world} timed out after {timeout}s") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        del store
    return [results[r] for r in range(world)]
