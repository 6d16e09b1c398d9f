"""Shared measurement protocol of the multi-process benchmarks.

Each implementation runs in its own spawned gloo world (so a rank's peak memory is its own),
``rounds`` times, alternating with the others -- in the given order in even rounds and in the
reverse order in odd ones, so that no implementation always runs first after a world's
teardown -- the fastest run counts, and a step counts at the pace of its slowest rank. Memory
is the growth of peak resident memory (max over ranks) over the resident memory a rank had
before building its model.

An implementation named ``<impl>-compiled`` is ``<impl>`` with ``train.compile=true``: its first
step compiles (excluded, like every warm-up step, from the median; kernels come from the
inductor cache in the data cache folder when an earlier run wrote them). Its peak resident
memory includes the compiler's own.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from meshlm.testing import run_world
from meshlm.train.process import set_process_policies
from meshlm.train.trainer import Trainer

COMPILED = "-compiled"


def split_compiled(impl: str) -> tuple[str, list[str]]:
    """(the implementation without ``-compiled``, the config overrides it adds)."""
    if impl.endswith(COMPILED):
        return impl[: -len(COMPILED)], ["--train.compile=true"]
    return impl, []


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def minor_faults() -> int:
    """Minor page faults of this process so far (each a page the kernel mapped, and zeroed, on
    first touch: what a buffer given back to the OS costs when it is allocated again)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def meshlm_step_times(cfg, steps: int, faults: list[int] | None = None  # noqa: ANN001
                      ) -> list[float]:
    """Wall time of the trainer's own steps 1..steps, under the process policies ``meshlm
    train`` sets (malloc, threads; a policy the process set before stays); ``faults`` (when
    given) gets each step's minor page faults."""
    set_process_policies(cfg.run)
    trainer = Trainer(cfg, log=lambda _m: None, progress=False)
    times = []
    for step in range(1, steps + 1):
        t0, f0 = time.perf_counter(), minor_faults()
        trainer.train_step(step)
        times.append(time.perf_counter() - t0)
        if faults is not None:
            faults.append(minor_faults() - f0)
    return times


def summary(times: list[float], base_rss: int, faults: list[int] | None = None) -> dict:
    # the first two steps allocate buffers and warm the thread pool
    out = {"step_time_s": statistics.median(times[2:]),
           "peak_rss_growth": peak_rss_bytes() - base_rss}
    if faults:
        out["faults_per_step"] = statistics.median(faults[2:])
    return out


def best_of(world: int, worker: Callable[..., dict], impls: list[str], args: dict,
            rounds: int, runs: dict[str, list[float]] | None = None) -> dict[str, dict]:
    """{impl: best run} with ``worker(impl, args, run_dir)`` run on every rank: the fastest
    round's step time and the smallest round's peak memory; ``runs`` (when given) also gets
    each round's step time of each implementation."""
    best: dict[str, dict] = {}
    tmp = Path(tempfile.mkdtemp(prefix="meshlm-bench-"))
    for r in range(rounds):
        for impl in (impls if r % 2 == 0 else impls[::-1]):  # ABBA: no fixed first runner
            res = run_world(world, worker, impl, args, str(tmp / f"{impl}-{r}"))
            step = max(x["step_time_s"] for x in res)  # the slowest rank sets the pace
            mem = max(x["peak_rss_growth"] for x in res)
            if runs is not None:
                runs.setdefault(impl, []).append(step)
                if "faults_per_step" in res[0]:  # (each rank's, per round)
                    runs.setdefault(f"{impl}/faults", []).append(
                        [x["faults_per_step"] for x in res])
            mem = min(mem, best.get(impl, {}).get("peak_rss_growth", mem))
            if impl not in best or step < best[impl]["step_time_s"]:
                best[impl] = {"impl": impl, "step_time_s": step, "peak_rss_growth": mem}
            else:
                best[impl]["peak_rss_growth"] = mem
    return best


def print_rows(rows: list[dict], width: int = 16) -> None:
    """Markdown table of implementation, step time, tokens/s, memory and ratios."""
    print(f"| {'implementation':<{width}} | {'step (s)':>8} | {'tokens/s':>8} | "
          f"{'peak RSS growth':>15} | {'time ratio':>10} | {'memory ratio':>12} |")
    print(f"|{'-' * (width + 2)}|{'-' * 10}|{'-' * 10}|{'-' * 17}|{'-' * 12}|{'-' * 14}|")
    for r in rows:
        tr = f"{r['time_ratio']:.3f}" if r.get("time_ratio") else "-"
        mr = f"{r['memory_ratio']:.3f}" if r.get("memory_ratio") else "-"
        print(f"| {r['impl']:<{width}} | {r['step_time_s']:>8.3f} | {r['tokens_per_s']:>8.0f} | "
              f"{r['peak_rss_growth'] / 2**20:>11.1f} MiB | {tr:>10} | {mr:>12} |")
