"""Every layout meshlm supports, on N GPUs or N CPU processes, against the one-process run.

The multi-process runs use one process per GPU (NCCL), or gloo processes on CPU; each is
compared with the one-process run of the same seed and global batch: losses, gradient norms
and final weights.

For a world of N ranks (2-8 GPUs; or N gloo processes on CPU with ``--cpu --world N``) it
runs, for ``--steps`` steps each (5 by default), every layout that fills exactly N ranks:

- data parallel: DDP (``ddp``), ZeRO-1/2/3 (``zero1`` .. ``zero3``), dp = N;
- tensor parallel: ``tp``, and with sequence parallelism ``tp-sp``, tp = N;
- context parallel, cp = N: ``cp-ring``, ``cp-zigzag``, ``cp-ulysses``;
- pipeline parallel, pp = N, each schedule: ``pp-afab``, ``pp-1f1b``, ``pp-interleaved`` (2
  virtual stages per rank), ``pp-zb`` (ZB-H1), with 2N micro-batches where the batch allows;
- expert parallel: ``ep`` (the MoE model, 8 experts top-2, ep = dp = N);
- 2D (an even world of 4 or more): ``dp-tp`` (ZeRO-1, sp), ``pp-dp`` (ZeRO-1, 1F1B),
  ``cp-tp`` (sp), ``ep-tp`` (MoE, ep = dp = N/2, tp 2, sp);
- 3D and 4D (a world divisible by 8): ``3d`` = pp 2 x dp N/4 x tp 2 (sp, ZeRO-1, 1F1B) and
  ``4d-moe`` = pp 2 x dp N/4 x tp 2 x ep 2 (sp, zero bubble) on the MoE model;
- DiLoCo: ``diloco`` = N islands of one rank, ``diloco-tp`` = 2 islands of tp N/2.

A layout that does not fit the world (a degree that does not divide the heads, the layers,
the experts, the batch or the sequence; a combined layout on a world too small) is listed as
skipped, with the reason meshlm's own config validation gives. The model: dense Llama-style
(``tiny``: hidden 64, 4 layers, 8 heads / 4 KV heads, or 16 / 8 on a world divisible by 8 so
that tp 8 splits them; vocab 509, divisible by no tp degree, so the padded vocab shards are
exercised; seq 32, global batch 8, or 2N where 8 is not divisible by N). Pipeline layouts get
max(4, stages) layers, their reference as many. ``--shape small`` (the GPU default) is hidden
256, seq 128. The data: a few standard-library modules, BPE-tokenized once into the cache.

Comparison, as the CPU parity tests do (tests/test_data_parallel.py, test_pipeline.py,
test_tensor_parallel.py, test_context_parallel.py, test_expert_parallel.py, test_diloco.py):
fp32, AdamW with eps 1e-5 and clipping at 0.5 (active on every step); each step's loss and
gradient norm, relative to the one-process run's, and every final weight tensor's relative
norm difference (``meshlm.testing.max_relative_difference``) must stay under 1e-5. MoE
references use the layout's global micro-batch (the auxiliary loss counts per micro-batch).
DiLoCo compares its mean loss over islands (``outer_loss``) and its final weights with the
one-process run of the same global batch, in the setting where the two are the same
algorithm: SGD with momentum, no clipping, one inner step, outer lr 1, no outer momentum.

On GPU the same 1e-5 holds, with the arithmetic kept to fp32: TF32 off for matmuls and
cuDNN, float32 matmul precision "highest", SDPA on its math kernel (the flash kernels have no
fp32 path; the memory-efficient one would differ from the CPU's in rounding), cuDNN
deterministic and ``torch.use_deterministic_algorithms(True, warn_only=True)`` with
``CUBLAS_WORKSPACE_CONFIG=:4096:8``. The one-process reference runs on the same kind of GPU
(a world of one on GPU 0). Any remaining difference is the summation order a layout changes,
as on CPU.

Workers are started as ``meshlm train`` starts them, by ``meshlm.launch.launch_local`` (torch's
elastic agent; ``init_worker`` picks the device and NCCL, or gloo on CPU). All layouts of the
world run in one launch, one after the other; a layout whose world fails is recorded with its
error and the launch resumes with the next one. Step time is the median of the trainer's own
``step_time_s`` over steps 2.. of rank 0. ``--nccl-semantics`` sets
``MESHLM_NCCL_SEMANTICS=1`` for the workers (the process-group layer's NCCL-semantics mode on
gloo). Writes JSON to ``--json`` (default ``benchmarks/results/multi_gpu_<backend><N>.json``).

    PYTHONPATH=src python benchmarks/multi_gpu.py                 # every GPU here (2-8)
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/multi_gpu.py --cpu --world 2
    PYTHONPATH=src python benchmarks/multi_gpu.py --cpu --world 4 --only dp-tp,pp-zb --list
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from meshlm.config import ConfigError, load_config
from meshlm.launch import WorkerFailure, launch_local
from meshlm.testing import final_weights, max_relative_difference
from meshlm.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-5  # fp32, relative: the CPU parity tests' bound (losses, grad norms, weights)
VOCAB = 509  # divisible by no tp degree: the vocab-parallel shards are padded
EXPERTS, TOPK = 8, 2
BASE_LAYERS = 4
CORPUS_MODULES = ("textwrap.py", "json/decoder.py", "json/encoder.py", "fnmatch.py",
                  "shlex.py", "string.py", "bisect.py", "heapq.py", "glob.py", "csv.py",
                  "calendar.py", "copy.py")
SGD = ("--train.optimizer=sgd", "--train.lr=0.05", "--train.min_lr=0.005",
       "--train.grad_clip=0")
SYNC = ("--diloco.inner_steps=1", "--diloco.outer_lr=1", "--diloco.outer_momentum=0")
EXACT_CUDA_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
NCCL_SEMANTICS_VAR = "MESHLM_NCCL_SEMANTICS"


# ---------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """Model width, sequence length and global batch of one world."""

    dim: int
    ffn: int
    moe_ffn: int
    seq: int
    heads: int
    kv_heads: int
    global_batch: int


SHAPES = {"tiny": (64, 176, 64, 32), "small": (256, 704, 256, 128)}


def make_shape(name: str, world: int) -> Shape:
    """The shape ``name`` with heads that a tp of ``world`` splits where it can (8 / 4 heads,
    16 / 8 on a world divisible by 8) and a global batch every dp of ``world`` divides."""
    dim, ffn, moe_ffn, seq = SHAPES[name]
    kv = 8 if world % 8 == 0 else 4
    batch = 8 if 8 % world == 0 else 2 * world
    return Shape(dim, ffn, moe_ffn, seq, 2 * kv, kv, batch)


def model_args(shape: Shape, moe: bool, layers: int) -> list[str]:
    """The model overrides of a dense or MoE run with ``layers`` layers."""
    out = [f"--model.preset={'tiny-moe' if moe else 'tiny'}", f"--model.n_layers={layers}",
           f"--model.dim={shape.dim}", f"--model.ffn_hidden={shape.ffn}",
           f"--model.n_heads={shape.heads}", f"--model.n_kv_heads={shape.kv_heads}",
           f"--model.max_seq_len={max(64, shape.seq)}"]
    if moe:
        out += [f"--model.moe_experts={EXPERTS}", f"--model.moe_topk={TOPK}",
                f"--model.moe_ffn_hidden={shape.moe_ffn}"]
    return out


# ---------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Case:
    """One layout of the table: its parallel overrides and what its reference must match."""

    name: str
    parallel: tuple[str, ...] = ()  # parallel.* and train.micro_batch overrides
    moe: bool = False
    layers: int = BASE_LAYERS
    diloco: bool = False
    ref_micro: int = 0  # the reference's micro-batch (0: the global batch)
    skip: str = ""  # why the layout cannot run on this world ("" : it can)
    shown: str = ""  # what the layout is, where it has no overrides on this world

    def describe(self) -> str:
        """``dp2 x tp2, zero=1, sp, micro 4`` style summary of the overrides."""
        if not self.parallel:
            return self.shown
        opts = dict(a[2:].split("=", 1) for a in self.parallel)
        dims = [f"{k.split('.')[1]}{opts[k]}" for k in (
            "parallel.islands", "parallel.pp", "parallel.dp", "parallel.cp", "parallel.tp",
            "parallel.ep") if k in opts and opts[k] != "1"]
        extra = [f"{k.split('.')[1]}={v}" for k, v in opts.items()
                 if k in ("parallel.zero", "parallel.pp_schedule", "parallel.cp_attention")]
        if opts.get("parallel.sp") == "true":
            extra.append("sp")
        if "train.micro_batch" in opts:
            extra.append(f"micro {opts['train.micro_batch']}")
        return " x ".join(dims) + (", " + ", ".join(extra) if extra else "")


def _args(**keys: object) -> tuple[str, ...]:
    """``pp=2, micro_batch=4`` -> ``("--parallel.pp=2", "--train.micro_batch=4")``."""
    out = []
    for k, v in keys.items():
        section = "train" if k == "micro_batch" else "parallel"
        out.append(f"--{section}.{k}={str(v).lower() if isinstance(v, bool) else v}")
    return tuple(out)


def _micro(batch: int, ranks: int) -> int:
    """The per-rank micro-batch of ``ranks`` data-parallel ranks (1 where it does not divide:
    config validation then names the problem)."""
    return batch // ranks if batch % ranks == 0 and batch >= ranks else 1


def pp_micro(batch: int, pp: int, dp: int = 1) -> int:
    """Micro-batch for 2 pp micro-batches per rank (or pp) where the batch divides."""
    for m in (2 * pp, pp):
        if batch % (m * dp) == 0:
            return batch // (m * dp)
    return _micro(batch, dp)


def data_parallel_cases(n: int, b: int) -> list[Case]:
    return [Case("ddp" if z == 0 else f"zero{z}", _args(dp=n, zero=z, micro_batch=_micro(b, n)))
            for z in range(4)]


def tensor_cases(n: int, b: int) -> list[Case]:
    return [Case(name, _args(tp=n, sp=sp, micro_batch=b))
            for name, sp in (("tp", False), ("tp-sp", True))]


def context_cases(n: int, b: int) -> list[Case]:
    return [Case(f"cp-{mode}", _args(cp=n, cp_attention=mode, micro_batch=b))
            for mode in ("ring", "zigzag", "ulysses")]


def pipeline_cases(n: int, b: int) -> list[Case]:
    out = []
    for schedule in ("afab", "1f1b", "interleaved", "zb"):
        v = 2 if schedule == "interleaved" else 1
        out.append(Case(f"pp-{schedule}", _args(pp=n, pp_schedule=schedule, pp_virtual=v,
                                                micro_batch=pp_micro(b, n)),
                        layers=max(BASE_LAYERS, n * v)))
    return out


def expert_cases(n: int, b: int) -> list[Case]:
    micro = _micro(b, n)
    return [Case("ep", _args(dp=n, ep=n, micro_batch=micro), moe=True, ref_micro=micro * n)]


def two_d_cases(n: int, b: int) -> list[Case]:
    h = n // 2
    if n < 4 or n % 2:
        why = "needs an even world of 4 or more"
        return [Case(name, skip=why, shown=shown) for name, shown in (
            ("dp-tp", "dp N/2 x tp2, zero=1, sp"), ("pp-dp", "pp2 x dp N/2, zero=1, 1f1b"),
            ("cp-tp", "cp2 x tp N/2, sp"), ("ep-tp", "dp N/2 x tp2 x ep N/2, sp (MoE)"))]
    ep_micro = _micro(b, h)
    return [
        Case("dp-tp", _args(dp=h, tp=2, zero=1, sp=True, micro_batch=_micro(b, h))),
        Case("pp-dp", _args(pp=2, dp=h, zero=1, pp_schedule="1f1b", micro_batch=pp_micro(b, 2, h))),
        Case("cp-tp", _args(cp=2, tp=h, sp=True, micro_batch=b)),
        Case("ep-tp", _args(dp=h, ep=h, tp=2, sp=True, micro_batch=ep_micro), moe=True,
             ref_micro=ep_micro * h),
    ]


def three_d_cases(n: int, b: int) -> list[Case]:
    if n % 8:
        why = "needs a world divisible by 8"
        return [Case(name, skip=why, shown=shown) for name, shown in (
            ("3d", "pp2 x dp N/4 x tp2, zero=1, 1f1b, sp"),
            ("4d-moe", "pp2 x dp N/4 x tp2 x ep2, zb, sp (MoE)"))]
    dp = n // 4
    micro = pp_micro(b, 2, dp)
    return [
        Case("3d", _args(pp=2, dp=dp, tp=2, sp=True, zero=1, pp_schedule="1f1b",
                         micro_batch=micro)),
        Case("4d-moe", _args(pp=2, dp=dp, tp=2, ep=2, sp=True, pp_schedule="zb",
                             micro_batch=micro), moe=True, ref_micro=micro * dp),
    ]


def diloco_cases(n: int, b: int) -> list[Case]:
    out = [Case("diloco", _args(islands=n, dp=1, micro_batch=_micro(b, n)), diloco=True)]
    if n >= 4 and n % 2 == 0:
        out.append(Case("diloco-tp", _args(islands=2, tp=n // 2, micro_batch=_micro(b, 2)),
                        diloco=True))
    else:
        out.append(Case("diloco-tp", skip="needs an even world of 4 or more",
                        shown="islands2 x tp N/2"))
    return out


FAMILIES = (data_parallel_cases, tensor_cases, context_cases, pipeline_cases, expert_cases,
            two_d_cases, three_d_cases, diloco_cases)


def all_cases(world: int, shape: Shape) -> list[Case]:
    """Every layout of the table for ``world`` ranks, in table order."""
    return [c for family in FAMILIES for c in family(world, shape.global_batch)]


def case_names() -> list[str]:
    """The names of every layout (those of a world of 8, which has them all)."""
    return [c.name for c in all_cases(8, make_shape("tiny", 8))]


# ---------------------------------------------------------------------- run arguments
@dataclass
class Plan:
    """What one invocation runs: the shared arguments and where runs go."""

    world: int
    shape: Shape
    steps: int
    corpus: Path
    cache: Path
    work: Path
    timeout_s: float
    shared: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.shared = [
            f"--data.path={self.corpus}", f"--data.cache_dir={self.cache}",
            f"--data.vocab_size={VOCAB}", f"--data.seq_len={self.shape.seq}",
            f"--train.steps={self.steps}", f"--train.global_batch={self.shape.global_batch}",
            "--train.warmup_steps=2", "--train.eval_every=0", "--run.sample_tokens=0",
            "--train.peak_flops=1e10", "--train.grad_clip=0.5", "--train.eps=1e-5",
            "--parallel.bucket_mb=0.05", "--precision.dtype=fp32",
            f"--distributed.timeout_s={self.timeout_s}",
            f"--distributed.init_timeout_s={self.timeout_s}",
        ]

    def ref_key(self, case: Case) -> str:
        """The name of the one-process run ``case`` compares with."""
        kind = "moe" if case.moe else "dense"
        opt = "-sgd" if case.diloco else ""
        micro = case.ref_micro or self.shape.global_batch
        return f"ref-{kind}{opt}-L{case.layers}-m{micro}"

    def ref_args(self, case: Case) -> list[str]:
        """The one-process run's arguments (the optimizer of ``case``, its micro-batch)."""
        micro = case.ref_micro or self.shape.global_batch
        optimizer = list(SGD) if case.diloco else []
        return (self.shared + model_args(self.shape, case.moe, case.layers) + optimizer
                + [f"--train.micro_batch={micro}", f"--run.dir={self.work / self.ref_key(case)}"])

    def case_args(self, case: Case) -> list[str]:
        """The layout's arguments (DiLoCo: SGD, one inner step, outer lr 1, no momentum)."""
        extra = list(SGD + SYNC) if case.diloco else []
        return (self.shared + model_args(self.shape, case.moe, case.layers) + extra
                + list(case.parallel) + [f"--run.dir={self.work / case.name}"])


def config_problem(args: list[str]) -> str:
    """meshlm's own validation of a run's arguments ("" : valid)."""
    try:
        load_config(None, args, check_paths=False)
    except ConfigError as e:
        return str(e)
    return ""


def resolve_skips(plan: Plan, cases: list[Case]) -> list[Case]:
    """``cases`` with the skip reason of every layout that meshlm's validation refuses."""
    out = []
    for c in cases:
        why = c.skip or config_problem(plan.case_args(c))
        out.append(replace(c, skip=why))
    return out


# ---------------------------------------------------------------------- workers
def exact_cuda() -> None:
    """fp32 arithmetic on the GPU: no TF32, SDPA's math kernel, deterministic algorithms."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
        if hasattr(torch.backends.cuda, name):
            getattr(torch.backends.cuda, name)(False)
    torch.use_deterministic_algorithms(True, warn_only=True)


def world_body(runs: list[list[str]]) -> dict[str, Any]:
    """What every worker runs (module level: spawned workers import it): each run in turn;
    the worker's backend, device and NCCL-semantics setting."""
    import torch.distributed as dist

    from meshlm.train.trainer import train

    cuda = torch.cuda.is_available()
    if cuda:
        exact_cuda()
    for args in runs:
        result = train(load_config(None, args), log=lambda _m: None, progress=False)
        if result.stopped_by:  # SIGTERM / Ctrl-C, relayed by launch_local: no further runs
            raise KeyboardInterrupt(f"stopped by {result.stopped_by}")
    return {"backend": dist.get_backend(), "world": dist.get_world_size(),
            "device": f"cuda:{torch.cuda.current_device()}" if cuda else "cpu",
            "nccl_semantics_env": os.environ.get(NCCL_SEMANTICS_VAR, "")}


def finished(run_dir: Path, steps: int) -> bool:
    """Whether a run wrote every step's metrics and its final checkpoint."""
    return (len(read_metrics(run_dir / "metrics.jsonl")) >= steps
            and (run_dir / "checkpoints" / f"step_{steps:07d}").is_dir())


def run_in_world(world: int, runs: dict[str, list[str]], steps: int, timeout_s: float
                 ) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Run ``runs`` (name -> arguments) in turn in worlds of ``world`` workers: {name: error}
    of those that failed (a failure ends its launch; the next launch resumes after it), and
    what each rank of a completed launch reported."""
    pending, errors = list(runs), {}
    while pending:
        try:
            ranks = launch_local(world, world_body, [runs[n] for n in pending],
                                 timeout_s=timeout_s)
            return errors, [ranks[r] for r in sorted(ranks)]
        except WorkerFailure as e:
            rundir = {n: Path(next(a for a in runs[n] if a.startswith("--run.dir="))
                              .removeprefix("--run.dir=")) for n in pending}
            failed = next((n for n in pending if not finished(rundir[n], steps)), pending[-1])
            errors[failed] = str(e)
            print(f"{failed}: failed: {e}", flush=True)
            pending = pending[pending.index(failed) + 1:]
    return errors, []


# ---------------------------------------------------------------------- comparison
def step_time(records: list[dict[str, Any]]) -> float | None:
    """Median ``step_time_s`` of steps 2.. (the first one allocates and warms up)."""
    times = [r["step_time_s"] for r in records if r["step"] > 1] or [
        r["step_time_s"] for r in records]
    return statistics.median(times) if times else None


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


def compare(run_dir: Path, ref_dir: Path, diloco: bool, steps: int) -> dict[str, Any]:
    """Loss, grad-norm and final-weight differences of a run against its reference."""
    got, ref = read_metrics(run_dir / "metrics.jsonl"), read_metrics(ref_dir / "metrics.jsonl")
    if len(got) != steps or len(ref) != steps:
        return {"status": "failed", "error": f"{len(got)} of {steps} steps recorded"}
    key = "outer_loss" if diloco else "loss"
    loss = max(_rel(g[key], r["loss"]) for g, r in zip(got, ref, strict=True))
    # each island clips and reports its own gradient: no norm to compare under DiLoCo
    norm = None if diloco else max(_rel(g["grad_norm"], r["grad_norm"])
                                   for g, r in zip(got, ref, strict=True))
    weight, name = max_relative_difference(final_weights(run_dir), final_weights(ref_dir))
    match = loss < RTOL and weight < RTOL and (norm is None or norm < RTOL)
    return {"status": "ok" if match else "mismatch", "match": match,
            "max_loss_diff": loss, "max_grad_norm_diff": norm, "max_weight_diff": weight,
            "worst_weight": name, "losses": [g[key] for g in got],
            "ref_losses": [r["loss"] for r in ref], "step_time_s": step_time(got),
            "ref_step_time_s": step_time(ref)}


def row_of(plan: Plan, case: Case, errors: dict[str, str]) -> dict[str, Any]:
    """The table row of ``case`` once its world has run."""
    row: dict[str, Any] = {"layout": case.name, "config": case.describe(),
                           "world": plan.world if not case.skip else None,
                           "model": "moe" if case.moe else "dense", "layers": case.layers,
                           "reference": plan.ref_key(case), "args": list(case.parallel)}
    if case.skip:
        return {**row, "status": "skipped", "match": None, "reason": case.skip}
    if case.name in errors or plan.ref_key(case) in errors:
        return {**row, "status": "failed", "match": False,
                "error": errors.get(case.name) or f"reference: {errors[plan.ref_key(case)]}"}
    res = compare(plan.work / case.name, plan.work / plan.ref_key(case), case.diloco, plan.steps)
    return {**row, **res, "match": res.get("match", False)}


# ---------------------------------------------------------------------- data and device
def corpus_dir(cache: Path) -> Path:
    """A few standard-library modules in a folder under the cache (the run's data.path)."""
    root = cache / "multi_gpu_corpus"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root.mkdir(parents=True, exist_ok=True)
    for rel in CORPUS_MODULES:
        dst = root / rel.replace("/", "_")
        if not dst.exists():
            shutil.copyfile(stdlib / rel, dst)
    return root


def default_cache() -> Path:
    from meshlm.data import default_cache_root

    return default_cache_root()


def device_name(cpu: bool) -> str:
    if cpu:
        return "cpu"
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, text=True, capture_output=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def tree_state() -> dict[str, Any]:
    """The commit that ran, and whether ``src/`` had changes not in it."""
    return {"commit": _git("rev-parse", "--short", "HEAD"),
            "src_modified": bool(_git("status", "--porcelain", "--", "src"))}


# ---------------------------------------------------------------------- table
NOTE_CHARS = 60  # of a skip reason or an error, in the table
COLUMNS = ("layout", "config", "world", "match", "max loss diff", "max weight diff",
           "step ms")


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table_cells(row: dict[str, Any]) -> list[str]:
    match = "ref" if row["world"] == 1 else {True: "y", False: "n", None: "skipped"}[
        row.get("match")]
    note = row.get("reason") or row.get("error") or ""
    if len(note) > NOTE_CHARS:  # (the JSON has all of it)
        note = note[:NOTE_CHARS - 3] + "..."
    ms = row.get("step_time_s")
    return [row["layout"], row["config"] + (f" ({note})" if note else ""),
            str(row["world"] or "-"), match, _num(row.get("max_loss_diff"), ".1e"),
            _num(row.get("max_weight_diff"), ".1e"), _num(ms and ms * 1e3, ".1f")]


def reference_rows(rows: list[dict[str, Any]], work: Path) -> list[dict[str, Any]]:
    """One row per one-process reference that ran (world 1), with its step time."""
    out = []
    for key in dict.fromkeys(r["reference"] for r in rows if r["status"] != "skipped"):
        recs = read_metrics(work / key / "metrics.jsonl")
        out.append({"layout": key, "config": "one process", "world": 1, "match": None,
                    "step_time_s": step_time(recs) if recs else None})
    return out


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    body = [table_cells(r) for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(COLUMNS)]
    print(title)
    print("| " + " | ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for b in body:
        print("| " + " | ".join(x.ljust(w) for x, w in zip(b, widths, strict=True)) + " |")


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true",
                    help="run on CPU with gloo workers (one thread each), even where GPUs are")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks per layout (default: the GPUs here, at most 8; --cpu: 2)")
    ap.add_argument("--only", default="",
                    help=f"comma-separated subset of the layouts: {', '.join(case_names())}")
    ap.add_argument("--steps", type=int, default=5, help="training steps per run (default 5)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="model size: tiny (hidden 64, seq 32; the --cpu default) or small "
                         "(hidden 256, seq 128; the GPU default)")
    ap.add_argument("--nccl-semantics", action="store_true",
                    help=f"set {NCCL_SEMANTICS_VAR}=1 for the workers (gloo with NCCL's rules)")
    ap.add_argument("--json", default=None, help="output JSON (default "
                    "benchmarks/results/multi_gpu_<gloo|nccl><world>.json)")
    ap.add_argument("--cache-dir", default=None,
                    help="meshlm cache folder (tokenizer, token files; default meshlm's)")
    ap.add_argument("--timeout-s", type=float, default=180.0,
                    help="collective timeout of the workers (a hung layout fails after it)")
    ap.add_argument("--list", action="store_true",
                    help="print the layouts of this world (run or skipped) and exit")
    args = ap.parse_args(argv)
    if args.only:
        unknown = sorted(set(args.only.split(",")) - set(case_names()))
        if unknown:
            ap.error(f"--only: unknown layout(s) {', '.join(unknown)}")
    return args


def pick_world(args: argparse.Namespace) -> int | None:
    """The world size (None, with a message, where it cannot run here)."""
    gpus = 0 if args.cpu else torch.cuda.device_count()
    world = args.world or (min(gpus, 8) if gpus else 2)
    if not args.cpu and gpus < 2:
        print("multi_gpu.py: needs 2-8 CUDA GPUs; --cpu runs the same layouts on gloo",
              file=sys.stderr)
        return None
    if world < 2 or (not args.cpu and world > gpus):
        print(f"multi_gpu.py: --world {world}: need 2 <= world"
              + ("" if args.cpu else f" <= {gpus} GPUs"), file=sys.stderr)
        return None
    return world


def worker_env(args: argparse.Namespace) -> None:
    """Environment the spawned workers inherit."""
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # init_worker then picks gloo
        os.environ["OMP_NUM_THREADS"] = "1"
        if args.nccl_semantics:
            os.environ[NCCL_SEMANTICS_VAR] = "1"
    else:
        os.environ.update(EXACT_CUDA_ENV)


def selected(cases: list[Case], only: str) -> list[Case]:
    names = [n for n in only.split(",") if n]
    return [c for c in cases if not names or c.name in names]


def run_plan(plan: Plan, cases: list[Case]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """References in a world of one, then every layout in a world of ``plan.world``: the
    table's rows and what the ranks of the layouts' world reported."""
    runnable = [c for c in cases if not c.skip]
    refs = {plan.ref_key(c): plan.ref_args(c) for c in runnable}
    errors, workers = run_in_world(1, refs, plan.steps, plan.timeout_s) if refs else ({}, [])
    todo = {c.name: plan.case_args(c) for c in runnable if plan.ref_key(c) not in errors}
    if todo:
        more, workers = run_in_world(plan.world, todo, plan.steps, plan.timeout_s)
        errors.update(more)
    return [row_of(plan, c, errors) for c in cases], workers


def write_json(path: Path, args: argparse.Namespace, plan: Plan, rows: list[dict[str, Any]],
               refs: list[dict[str, Any]], workers: list[dict[str, Any]], wall_s: float) -> None:
    ran = [r for r in rows if r["status"] != "skipped"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "benchmark": "multi_gpu", "backend": "gloo" if args.cpu else "nccl",
        "device": device_name(args.cpu), "world": plan.world, "torch": torch.__version__,
        **tree_state(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["benchmarks/multi_gpu.py", *(sys.argv[1:])]),
        "nccl_semantics": bool(args.cpu and args.nccl_semantics), "rtol": RTOL,
        "steps": plan.steps, "shape": plan.shape.__dict__, "vocab": VOCAB,
        "shared_args": [a for a in plan.shared if not a.startswith(("--data.path",
                                                                    "--data.cache_dir"))],
        "all_matched": all(r["match"] for r in ran), "ran": len(ran),
        "skipped": len(rows) - len(ran), "wall_s": wall_s, "workers": workers,
        "references": refs, "rows": rows,
    }, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = pick_world(args)
    if world is None:
        return 2
    shape = make_shape(args.shape or ("tiny" if args.cpu else "small"), world)
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache()
    if args.list:
        plan = Plan(world, shape, args.steps, cache, cache, cache, args.timeout_s)
        for c in resolve_skips(plan, selected(all_cases(world, shape), args.only)):
            print(f"{c.name:14s} {c.describe():50s} {('skipped: ' + c.skip) if c.skip else ''}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="meshlm-multi-gpu-"))
    plan = Plan(world, shape, args.steps, corpus_dir(cache), cache, work, args.timeout_s)
    cases = resolve_skips(plan, selected(all_cases(world, shape), args.only))
    worker_env(args)
    start = time.time()
    rows, workers = run_plan(plan, cases)
    refs = reference_rows(rows, work)
    wall = time.time() - start
    backend = "gloo" if args.cpu else "nccl"
    print_table(f"meshlm layouts vs one process: {device_name(args.cpu)}, {backend}, world "
                f"{world}, torch {torch.__version__}, {args.steps} steps, fp32, rtol {RTOL:.0e}"
                f", {wall:.0f} s", refs + rows)
    out = Path(args.json) if args.json else (
        ROOT / "benchmarks" / "results" / f"multi_gpu_{backend}{world}.json")
    write_json(out, args, plan, rows, refs, workers, wall)
    print(f"wrote {out}")
    bad = [r["layout"] for r in rows if r["status"] in ("failed", "mismatch")]
    if bad:
        print(f"not matched: {', '.join(bad)} (run folders kept: {work})")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
