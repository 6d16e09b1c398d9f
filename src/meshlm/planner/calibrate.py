"""``meshlm plan --calibrate``: measure this machine and store the planner's ``cpu`` entry.

Microbenchmarks only -- nothing here runs meshlm training, so the planner's predictions of
training runs stay predictions:

- matmul peak: best FLOP/s of a 1024^3 matmul (fp32, bf16) with 1..cores threads in one
  process -- the trainer's CPU peak, the denominator of MFU;
- GEMM rate: a stack of 6 linear layers (4096 tokens, 512 <-> 1536 features) forward, its
  outputs kept as autograd keeps activations, and backward -- the transposed backward GEMMs
  and fresh output buffers make this slower than the square matmul;
- memory bandwidth: a chain of elementwise ops on fp32 tensors of 1, 4, 16 and 64 MiB whose
  outputs stay alive (as autograd keeps activations) over a 256 MiB working set -- so every
  op writes fresh memory and pays its page faults, as in a training step;
- cross-entropy: ``F.cross_entropy`` forward + backward on fresh (4096 x 4096) fp32 logits,
  seconds per logit (on CPU this is dominated by first-touch page faults of 64 MiB buffers),
  and the same for meshlm's vocab-parallel cross-entropy (used with tp > 1);
- attention: causal SDPA forward + backward at head dimensions 8, 32 and 128 (8 heads, seq
  256), counted as half of ``3 x 4 b s^2 heads hd`` (the causal half, as FlashAttention papers
  count) -- small heads run far below the matmul rate;
- optimizer: clip-by-norm + ``torch.optim.AdamW`` step (foreach and fused kernels, each) +
  zeroing gradients on 32 tensors of 128 Ki parameters, seconds per parameter;
- op overhead: a chain of 200 tiny multiplications with autograd, forward + backward, per op;
- gloo collectives over loopback for groups of 2 and 4 processes (one thread each):
  all-reduce, all-gather, reduce-scatter, all-to-all at 64 KiB, 1 MiB and 16 MiB (comm-log
  bytes, i.e. the full buffer); ``t = latency + bytes / bandwidth`` with the bandwidth from the
  slope between 1 and 16 MiB (the sizes of meshlm's buckets and activations) and the latency
  from 64 KiB; each call timed as a training step issues it: on fresh buffers, after ~1 ms of
  matmul (the loop's time minus that of the matmul and allocation alone).

Before each measured round it waits for an idle machine, at most ``max_wait`` seconds in all
(:class:`IdleWait`); once that is spent it measures at once, and the stored entry's source says
the numbers were measured under load and how busy the machine was.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

from ..distributed.spawn import run_world
from ..matmul_rate import measure_matmul_flops
from .hardware import CpuProfile, calibration_path

SIZES = (64 * 1024, 2**20, 16 * 2**20)  # bytes of the full buffer
WORLDS = (2, 4)


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of the machine's CPU time spent busy over ``seconds`` (from /proc/stat)."""

    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        return sum(vals), vals[3] + vals[4]  # total, idle + iowait

    t0, i0 = snap()
    time.sleep(seconds)
    t1, i1 = snap()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_for_quiet(max_wait: float = 600.0, threshold: float = 0.1,
                   log: Callable[[str], None] | None = None) -> bool:
    """Wait until the machine is idle (other jobs would slow every measurement down).

    Returns False if it never became quiet within ``max_wait`` seconds.
    """
    deadline, quiet = time.monotonic() + max_wait, 0
    while time.monotonic() < deadline:
        quiet = quiet + 1 if cpu_busy() < threshold else 0
        if quiet >= 3:
            return True
    if log:
        log(f"  (the machine stayed busy for {max_wait:.0f} s; measuring anyway)")
    return False


IDLE = 0.1  # busy fraction below which the machine counts as idle


def wait_for_idle(max_wait: float, threshold: float = IDLE, sample_s: float = 1.0
                  ) -> tuple[float, float]:
    """Wait for three idle samples in a row, at most ``max_wait`` seconds (one sample at
    least); (seconds waited, the machine's busy fraction in the last sample)."""
    samples = max(1, math.ceil(max_wait / sample_s))
    taken, quiet, load = 0, 0, 1.0
    while taken < samples and quiet < 3:
        load = cpu_busy(sample_s)
        taken += 1
        quiet = quiet + 1 if load < threshold else 0
    return taken * sample_s, load


@dataclass
class IdleWait:
    """The time left to wait for an idle machine, shared by every round of a calibration,
    and the highest load a round was measured under (below :data:`IDLE`: all idle)."""

    left: float
    load: float = 0.0

    def wait(self) -> None:
        """Wait for an idle machine from what is left of the budget, note the load."""
        self.note(*wait_for_idle(self.left))

    def note(self, waited: float, load: float) -> None:
        self.left = max(0.0, self.left - waited)
        self.load = max(self.load, load)

    @property
    def under_load(self) -> bool:
        return self.load >= IDLE

    def remark(self) -> str:
        """The source's note (empty when every round ran on an idle machine)."""
        return f"; measured under load (up to {self.load:.0%} busy)" if self.under_load else ""


def _median(fn: Callable[[], object], seconds: float = 0.4, min_reps: int = 5) -> float:
    """Median wall time of ``fn`` over ``seconds`` (at least ``min_reps`` calls).

    The median, not the best: training runs at the typical rate of a busy machine, and the
    planner predicts training.
    """
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak(dtype: torch.dtype, n: int = 1024) -> float:
    """The trainer's CPU peak (``train/peak.py``): best rate of an n^3 matmul."""
    return measure_matmul_flops(dtype, n)


def gemm_rate(dtype: torch.dtype, m: int = 4096, k: int = 512, n: int = 1536,
              layers: int = 6) -> float:
    """FLOP/s of a stack of linear layers, forward (activations kept) and backward."""
    ws = [torch.randn(*((n, k) if i % 2 == 0 else (k, n)), dtype=dtype, requires_grad=True)
          for i in range(layers)]
    x = torch.randn(m, k, dtype=dtype)

    def step() -> None:
        y = x
        for w in ws:
            y = torch.nn.functional.linear(y, w)
        y.backward(torch.ones_like(y))
        for w in ws:
            w.grad = None

    # forward: every layer; backward: every weight gradient, every input gradient but the first
    return (3 * layers - 1) * 2 * m * k * n / _median(step)


def optimizer_cost(tensors: int = 32, numel: int = 128 * 1024, kernels: str = "foreach"
                   ) -> float:
    """Seconds per parameter of clipping + AdamW (``foreach`` or ``fused`` kernels) + zeroing
    gradients."""
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel)
    opt = torch.optim.AdamW(params, lr=1e-3, **{kernels: True})

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        for p in params:
            p.grad.zero_()

    return _median(step) / (tensors * numel)


BW_SIZES = (2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20)
HEAD_DIMS = (8, 32, 128)


def mem_bandwidth(nbytes: int, working_set: int = 256 * 2**20) -> float:
    """Bytes/s of a chain of elementwise ops whose outputs stay alive (as autograd keeps
    activations), over a working set larger than the caches: fresh memory every op."""
    x = torch.randn(nbytes // 4)
    count = max(4, working_set // nbytes)

    def step() -> None:
        keep, y = [], x
        for _ in range(count):
            y = y * 1.0001  # read one tensor, write a fresh one
            keep.append(y)

    return 2 * nbytes * count / _median(step, min_reps=3)


def cross_entropy_cost(rows: int = 4096, vocab: int = 4096) -> float:
    """Seconds per logit element of cross-entropy forward + backward (fresh buffers)."""
    logits = torch.randn(rows, vocab)
    target = torch.randint(0, vocab, (rows,))

    def step() -> None:
        x = logits.clone().requires_grad_(True)
        torch.nn.functional.cross_entropy(x, target).backward()

    clone = _median(lambda: logits.clone())
    return max(0.0, _median(step) - clone) / (rows * vocab)


def vocab_parallel_ce_cost(rows: int = 4096, vocab: int = 4096) -> float:
    """Seconds per logit of meshlm's vocab-parallel cross-entropy (``parallel/tensor.py``),
    forward + backward, on one rank (its collectives short-circuit; they are timed apart)."""
    from ..distributed.comm import Comm
    from ..distributed.mesh import Mesh
    from ..layout import Layout
    from ..parallel.tensor import vocab_parallel_cross_entropy

    comm = Comm(Mesh(Layout()))
    logits = torch.randn(rows, vocab)
    target = torch.randint(0, vocab, (rows,))

    def step() -> None:
        x = logits.clone().requires_grad_(True)
        vocab_parallel_cross_entropy(x, target, 0, vocab, comm).backward()

    clone = _median(lambda: logits.clone())
    return max(0.0, _median(step) - clone) / (rows * vocab)


def attention_rate(hd: int, heads: int = 8, s: int = 256) -> float:
    """Causal SDPA forward + backward FLOP/s at head dimension ``hd`` (about 8 Mi elements
    of q, k, v each), counting the causal half of ``3 x 4 b s^2 heads hd``."""
    b = max(1, 2**20 // (heads * s * hd))
    q, k, v = (torch.randn(b, heads, s, hd, requires_grad=True) for _ in range(3))

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    flops = 0.5 * 3 * 4 * b * s * s * heads * hd
    return flops / _median(step)


def op_overhead(n_ops: int = 200) -> float:
    x0 = torch.ones(16, requires_grad=True)

    def chain() -> None:
        x = x0
        for _ in range(n_ops):
            x = x * 1.0001
        x.sum().backward()

    return _median(chain) / (2 * n_ops)  # one forward and one backward op per multiplication


def _bench_collectives(sizes: tuple[int, ...], reps: int) -> dict[str, dict[int, float]]:
    """Run inside a gloo world: median seconds per (op, size), each call as a training step
    issues it -- on fresh buffers, between stretches of computation.

    Both matter on a small CPU machine: gloo sets up every new buffer address it is handed
    (a 1 MiB all-reduce on a fresh tensor took 3.1 ms at 2 ranks, on a reused one 0.9 ms), and
    a peer's transport threads compete with this rank's computation for the cores (a 1 MiB
    all-reduce after each ~1 ms matmul added 2.4 ms, not 0.9). Measured: the loop of (matmul,
    fresh buffers, collective) minus the loop of (matmul, fresh buffers).
    """
    import torch.distributed as dist

    # torch 2.13 renamed the tensor collectives (as in meshlm.distributed.comm).
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    n = dist.get_world_size()
    work = torch.randn(384, 384)  # ~1 ms of matmul per call: a step's compute between calls

    def timed(fn: Callable[[], object]) -> float:
        fn()
        fn()  # two warm-up calls
        times = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(max(1, reps // 3)):
                fn()
            times.append((time.perf_counter() - t0) / max(1, reps // 3))
        return statistics.median(times)

    out: dict[str, dict[int, float]] = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        out[op] = {}
        for size in sizes:
            numel = size // 4 // n * n

            def buffers(numel: int = numel) -> tuple[torch.Tensor, torch.Tensor]:
                work @ work
                return torch.ones(numel), torch.ones(numel // n)

            def call(op: str = op, buffers: Callable = buffers) -> None:
                full, shard = buffers()
                if op == "all_reduce":
                    dist.all_reduce(full)
                elif op == "all_gather":
                    all_gather(full, shard)
                elif op == "all_to_all":  # the comm log's bytes: the whole input buffer
                    dist.all_to_all_single(torch.empty_like(full), full)
                else:
                    reduce_scatter(shard, full)

            out[op][size] = max(0.0, timed(call) - timed(buffers))
    return out


def collectives(worlds: tuple[int, ...] = WORLDS, reps: int = 15
                ) -> dict[str, dict[int, tuple[float, float]]]:
    """op -> group size -> (latency s, bytes/s): bandwidth from the 1 -> 16 MiB slope,
    latency from the 64 KiB time."""
    fitted: dict[str, dict[int, tuple[float, float]]] = {}
    for n in worlds:
        per_rank = run_world(n, _bench_collectives, SIZES, reps)
        for op in per_rank[0]:
            # The slowest rank finishes the collective: take the max over ranks.
            t = {s: max(r[op][s] for r in per_rank) for s in SIZES}
            (s0, t0), (s1, t1), (s2, t2) = sorted(t.items())
            bw = (s2 - s1) / max(t2 - t1, 1e-9)
            lat = max(0.0, t0 - s0 / bw)
            fitted.setdefault(op, {})[n] = (lat, bw)
    return fitted


def _rates(t: int, max_wait: float) -> dict[str, object]:
    """Every single-process rate with ``t`` threads: one round, in a fresh process, after
    waiting at most ``max_wait`` s for an idle machine (``"waited"``, ``"load"``: that wait).

    A fresh process per round, warmed up by one unmeasured pass, so the allocator's state (which
    decides how often fresh buffers pay page faults) is that of a training process in its steady
    state rather than whatever earlier measurements left behind.
    """
    torch.set_num_threads(t)
    out: dict[str, object] = {}
    for measured in (False, True):
        if measured:
            out["waited"], out["load"] = wait_for_idle(max_wait)
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            out[f"peak_{name}"] = matmul_peak(dt)
            out[f"gemm_{name}"] = gemm_rate(dt)
        out["bw"] = {size: mem_bandwidth(size) for size in BW_SIZES}
        out["attn"] = {hd: attention_rate(hd) for hd in HEAD_DIMS}
        out["ce"] = cross_entropy_cost()
        out["ce_tp"] = vocab_parallel_ce_cost()
        out["adam"] = optimizer_cost()
        out["adam_fused"] = optimizer_cost(kernels="fused")
    return out


def _best_of(rounds: list[dict], key: str, fastest: Callable = max):
    values = [r[key] for r in rounds]
    if isinstance(values[0], dict):
        return {k: fastest(v[k] for v in values) for k in values[0]}
    return fastest(values)


def calibrate(log: Callable[[str], None] = print, rounds: int = 3, max_wait: float = 60.0
              ) -> CpuProfile:
    """Measure every rate of :class:`CpuProfile` on this machine.

    The machine may be shared: other jobs only ever slow a measurement down, so each rate is
    the best of ``rounds`` rounds (each round a median of many calls), each after waiting for
    an idle machine -- at most ``max_wait`` seconds in all; the rest measure under load.
    """
    idle = IdleWait(max_wait)
    cores = os.cpu_count() or 1
    saved = torch.get_num_threads()
    peak: dict[str, dict[int, float]] = {"fp32": {}, "bf16": {}}
    gemm: dict[str, dict[int, float]] = {"fp32": {}, "bf16": {}}
    bw: dict[int, dict[int, float]] = {}
    attn: dict[int, dict[int, float]] = {}
    ce, ce_tp, adam, adam_fused = {}, {}, {}, {}
    try:
        for t in sorted({1, cores}):
            rs = []
            for _ in range(rounds):
                rs.append(run_world(1, _rates, t, idle.left, timeout=300.0 + idle.left)[0])
                idle.note(rs[-1]["waited"], rs[-1]["load"])
            for name in ("fp32", "bf16"):
                peak[name][t] = _best_of(rs, f"peak_{name}")
                gemm[name][t] = _best_of(rs, f"gemm_{name}")
            bw[t] = _best_of(rs, "bw")
            attn[t] = _best_of(rs, "attn")
            ce[t] = _best_of(rs, "ce", min)
            ce_tp[t] = _best_of(rs, "ce_tp", min)
            adam[t] = _best_of(rs, "adam", min)
            adam_fused[t] = _best_of(rs, "adam_fused", min)
            mem = ", ".join(f"{v / 1e9:.1f}" for v in bw[t].values())
            att = ", ".join(f"{v / 1e9:.1f}" for v in attn[t].values())
            log(f"  {t} thread(s): matmul peak fp32 {peak['fp32'][t] / 1e9:.1f} GFLOP/s, linear "
                f"fp32 {gemm['fp32'][t] / 1e9:.1f}, bf16 {gemm['bf16'][t] / 1e9:.1f} GFLOP/s, "
                f"memory (1/4/16/64 MiB) {mem} GB/s, attention (hd 8/32/128) {att} GFLOP/s, "
                f"cross-entropy {ce[t] * 1e9:.2f} (vocab-parallel {ce_tp[t] * 1e9:.2f}) ns/logit, "
                f"AdamW {adam[t] * 1e9:.2f} ns/param")
        torch.set_num_threads(1)
        overhead = min(op_overhead() for _ in range(rounds))
        log(f"  eager op overhead {overhead * 1e6:.1f} us")
    finally:
        torch.set_num_threads(saved)
    runs = []
    for _ in range(rounds):
        idle.wait()
        runs.append(collectives())
    coll = {op: {n: (min(r[op][n][0] for r in runs), max(r[op][n][1] for r in runs))
                 for n in runs[0][op]} for op in runs[0]}
    for op, by_n in coll.items():
        for n, (lat, b) in by_n.items():
            log(f"  gloo {op} over {n}: latency {lat * 1e6:.0f} us, {b / 1e9:.2f} GB/s")
    if idle.under_load:
        log(f"  measured under load: the machine was up to {idle.load:.0%} busy (no idle "
            f"stretch within --calibrate-wait={max_wait:.0f} s); the rates are low")
    return CpuProfile(cores, peak, gemm, bw, attn, ce, ce_tp, adam, overhead, coll,
                      source=f"meshlm plan --calibrate on {os.uname().nodename}, "
                             f"{date.today().isoformat()}, torch {torch.__version__}"
                             f"{idle.remark()}",
                      adam_fused=adam_fused)


def save(profile: CpuProfile, path: str | Path | None = None) -> Path:
    p = Path(path).expanduser() if path else calibration_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(profile.to_dict(), indent=1))
    return p
