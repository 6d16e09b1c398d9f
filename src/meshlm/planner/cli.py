"""``meshlm plan``, ``parallel.auto`` and ``train --dry-run``: the planner from the command line
and for the trainer's config.

``meshlm plan --model PRESET|FILE --gpus N --gpu KIND [--seq-len L] [--global-batch-tokens T]
[--layout "tp=8,pp=4,dp=16,zero=1,mbs=1,recompute=selective,schedule=interleaved,vpp=2"]
[--json]`` prints the fastest layouts that fit (a table), or with ``--layout`` the breakdown
of that one layout (``dp_shard=N`` in it: hybrid sharding, ZeRO over shard groups of N dp
ranks replicated dp / N times). Its first line states what the plan assumes (vocabulary,
batch in tokens, precision) and where ``meshlm train``'s defaults differ; each layout comes
with the ``meshlm train`` arguments that run it (:mod:`.train_args`; ``train_args`` in the
JSON). ``meshlm plan --calibrate`` measures this machine and stores the ``cpu`` entry.
:func:`auto_layout` answers ``meshlm train --parallel.auto=true``, :func:`config_model_line`
and :func:`config_memory` the model and memory lines of ``meshlm train --dry-run``,
:func:`oom_advice` the planner's part of a rank's out-of-memory line.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError, training_problems
from ..layout import Layout
from .hardware import GIB, Accelerator, get_accelerator
from .levers import levers_text, size_text
from .memory import MemoryBreakdown, memory
from .search import MAX_WORLD, Plan, evaluate, search, world_problem
from .train_args import train_args, train_gaps, train_line
from .workload import (
    DTYPES,
    KERNELS,
    LOSSES,
    OPTIMIZER_KERNELS,
    ModelSpec,
    Workload,
    load_model_spec,
    parse_layout,
)

DEFAULT_BATCH_TOKENS = 2**20  # the Ultra-Scale Playbook's benchmark batch: 1M tokens


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``meshlm plan`` (with ``set_defaults(func=cmd_plan)``)."""
    p = subparsers.add_parser(
        "plan", help="predict memory, step time and MFU of layouts; find the best one",
        description="Rank parallel layouts of a model on a cluster by predicted tokens/s "
                    "(only those that fit in memory), or break one layout down.")
    p.add_argument("--model", help="preset name or TOML file with the model's dims")
    p.add_argument("--gpus", type=int, help=f"number of GPUs (or CPU ranks), 1 to {MAX_WORLD}")
    p.add_argument("--gpu", help="accelerator: a catalogue name (a100-80gb, h100-sxm, ..., cpu) "
                                 "or a TOML file describing one")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: 2048, or 256 on cpu, capped at the "
                        "model's max_seq_len)")
    p.add_argument("--global-batch-tokens", type=int, default=None,
                   help="tokens per optimizer step (default: 1M on GPUs, 16 sequences on cpu)")
    p.add_argument("--layout", help='one layout to break down, e.g. "tp=8,pp=4,dp=16,zero=1,'
                                    'mbs=1,recompute=selective,schedule=interleaved,vpp=2" '
                                    '(dp_shard=N: hybrid sharding over N dp ranks)')
    p.add_argument("--precision", choices=DTYPES, default=None,
                   help="matmul precision (default: bf16 on GPUs, fp32 on cpu)")
    p.add_argument("--states", choices=("fp32", "mixed"), default="fp32",
                   help="fp32: meshlm's fp32 weights/grads + Adam (16 B/param); mixed: "
                        "16-bit weights/grads + fp32 master and Adam (ZeRO paper)")
    p.add_argument("--loss", choices=LOSSES, default="torch",
                   help="cross-entropy: torch (fp32 logits, as meshlm) or fused (gradient "
                        "written in place: flash-attn, Megatron-Core loss fusion)")
    p.add_argument("--kernels", choices=KERNELS, default="eager",
                   help="memory-bound kernels: eager (one PyTorch kernel per op, as meshlm "
                        "runs) or fused (Megatron-Core / Transformer Engine, torch.compile)")
    p.add_argument("--optimizer", choices=OPTIMIZER_KERNELS, default="fused",
                   help="AdamW kernels: fused (meshlm's default: no temporaries) or foreach "
                        "(torch's multi-tensor AdamW: 4 bytes per parameter during the step)")
    p.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (matmul, memory, gloo collectives) and store "
                        "the cpu entry")
    p.add_argument("--calibrate-wait", type=float, default=60.0, metavar="SECONDS",
                   help="--calibrate: the most time spent in all waiting for an idle machine "
                        "(default 60); then it measures anyway and says how busy it was")
    p.add_argument("--calibration", default=None,
                   help="calibration file to write (--calibrate; its folder must exist, an "
                        "existing file is replaced) or read (--gpu cpu); default "
                        "~/.cache/meshlm/cpu_calibration.json")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise ConfigError(f"unexpected arguments {' '.join(rest)!r}")
    if args.calibrate:
        return run_calibration(args.calibrate_wait, args.calibration)
    for name in ("model", "gpus", "gpu"):
        if getattr(args, name) is None:
            raise ConfigError(f"meshlm plan needs --{name} (or --calibrate)")
    check_plan_numbers(args)
    spec = load_model_spec(args.model)
    hw = get_accelerator(args.gpu, args.calibration)
    work = build_workload(spec, hw, args.seq_len, args.global_batch_tokens, args.precision,
                          args.states, args.loss, args.kernels, args.optimizer)
    if args.layout:
        plan = evaluate(work, parse_layout(args.layout, args.gpus), hw, args.gpus)
        if plan.problems:
            raise ConfigError(f"--layout {args.layout!r}: " + "; ".join(plan.problems))
        if args.json:
            print(json.dumps({**context(work, hw, args.gpus), **plan_dict(work, plan)},
                             indent=1))
        else:
            print_breakdown(work, hw, plan, args.gpu)
        return 0
    if why := world_problem(work, args.gpus, hw):
        raise ConfigError(f"--gpus={args.gpus}: {why}")
    plans = search(work, args.gpus, hw, top=args.top)
    if args.json:
        print(json.dumps({**context(work, hw, args.gpus),
                          "plans": [plan_dict(work, p) for p in plans]}, indent=1))
    else:
        print_ranking(work, hw, args.gpus, plans, args.gpu)
    return 0 if plans else 1


def check_plan_numbers(args: argparse.Namespace) -> None:
    """ConfigError for a count of ``meshlm plan`` out of range (before any work)."""
    if not 1 <= args.gpus <= MAX_WORLD:
        raise ConfigError(f"--gpus={args.gpus} must lie in [1, {MAX_WORLD}] (the planner's "
                          "maximum, 2^24, is beyond any cluster built)")
    if args.top < 1:
        raise ConfigError(f"--top={args.top} must be >= 1")
    for name in ("seq_len", "global_batch_tokens"):
        if (v := getattr(args, name)) is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={v} must be >= 1")


def run_calibration(max_wait: float, path: str | None) -> int:
    """``meshlm plan --calibrate``: measure, store, say where (and whether under load)."""
    import math

    if not (math.isfinite(max_wait) and max_wait >= 0):
        raise ConfigError(f"--calibrate-wait={max_wait} must be a number of seconds >= 0")
    from ..paths import output_file
    from .calibrate import calibrate, save

    if path is not None:  # (checked now: the measurement takes minutes)
        output_file(path, "--calibration")
    print(f"calibrating the cpu entry (a few minutes; waits at most {max_wait:.0f} s in all "
          "for an idle machine) ...")
    try:
        profile = calibrate(max_wait=max_wait)
    except TimeoutError as e:  # (a round's processes are given 300 s beyond the wait)
        raise ConfigError(f"calibration gave up: {e}; the machine is too busy to measure, "
                          "nothing was stored") from None
    print(f"stored {save(profile, path)}")
    return 0


def build_workload(spec: ModelSpec, hw: Accelerator, seq_len: int | None,
                   batch_tokens: int | None, precision: str | None, states: str,
                   loss: str = "torch", kernels: str = "eager", optimizer: str = "fused"
                   ) -> Workload:
    c = spec.config
    seq = seq_len if seq_len is not None else min(c.max_seq_len, 256 if hw.is_cpu else 2048)
    if seq < 1 or seq > c.max_seq_len:
        raise ConfigError(f"--seq-len={seq} must lie in [1, max_seq_len={c.max_seq_len}] of "
                          f"model {c.name}")
    tokens = batch_tokens if batch_tokens is not None else (
        16 * seq if hw.is_cpu else DEFAULT_BATCH_TOKENS)
    if tokens < seq:
        raise ConfigError(f"--global-batch-tokens={tokens} is less than one sequence of "
                          f"{seq} tokens")
    dtype = precision or ("fp32" if hw.is_cpu else "bf16")
    return Workload(spec, seq, tokens // seq, dtype=dtype, states=states, loss=loss,
                    kernels=kernels, optimizer=optimizer)


def context(work: Workload, hw: Accelerator, gpus: int) -> dict[str, Any]:
    c = work.model.config
    return {"model": c.name, "params": work.model.num_params(), "vocab_size": c.vocab_size,
            "gpus": gpus, "hardware": hw.name, "hardware_sources": hw.sources,
            "seq_len": work.seq_len, "global_batch_seqs": work.global_batch,
            "global_batch_tokens": work.tokens_per_step, "precision": work.dtype,
            "states": work.states, "loss": work.loss}


def plan_dict(work: Workload, plan: Plan) -> dict[str, Any]:
    """A plan's JSON: :meth:`Plan.to_dict`, the ``meshlm train`` words that run its layout
    (``train_args``) and what they cannot give the trainer (``train_gaps``, empty: none)."""
    return {**plan.to_dict(), "train_args": train_args(work, plan.layout),
            "train_gaps": train_gaps(work, plan.layout)}


def _count(n: float) -> str:
    """``8.03 B``, ``3.95 M``, ``158.02 K``."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f}"


def assumptions(work: Workload, hw: Accelerator, gpus: int) -> str:
    """The plan's first line: model (with the vocabulary it counts), cluster, sequence, batch
    in sequences and tokens, precision, states; and which of them ``meshlm train``'s defaults
    differ in (the train lines set them)."""
    from ..config import Config

    c = work.model.config
    d = Config()
    line = (f"{c.name} ({_count(work.model.num_params())} params at vocabulary "
            f"{c.vocab_size:,}) on {gpus} x {hw.name}: seq {work.seq_len}, global batch "
            f"{work.global_batch} seqs ({work.tokens_per_step:,} tokens), {work.dtype}, "
            f"states {work.states}")
    differ = [what for what, same in (
        (d.precision.dtype, work.dtype == d.precision.dtype),
        (f"seq {d.data.seq_len}", work.seq_len == d.data.seq_len),
        (f"{d.train.global_batch} seqs", work.global_batch == d.train.global_batch),
        (f"a {d.data.vocab_size:,}-entry BPE vocabulary",
         c.vocab_size == d.data.vocab_size)) if not same]
    if differ:
        line += (f"; meshlm train's defaults differ ({', '.join(differ)}): the train lines "
                 "below set these")
    return line


def print_train_lines(work: Workload, gpu: str, plans: list[Plan]) -> None:
    """``meshlm train`` of each listed layout (numbered as the table), and once what they
    cannot give the trainer; ``gpu``: the plan's ``--gpu``, for the dry run's."""
    import shlex

    gaps = list(dict.fromkeys(g for p in plans for g in train_gaps(work, p.layout)))
    which = "each layout" if len(plans) > 1 else "it"
    print(f"to run {which} (add --dry-run --gpu {shlex.quote(gpu)} to check it on any "
          "machine):")
    for i, p in enumerate(plans, 1):
        print(f"{f'{i:>3}' if len(plans) > 1 else ''}  {train_line(work, p.layout)}")
    if gaps:
        print("  these run meshlm's nearest equivalent, not the plan: " + "; ".join(gaps))


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def _size(x: float) -> str:
    return f"{x / GIB:.2f} GiB" if x >= GIB else f"{x / 2**20:.1f} MiB"


def print_ranking(work: Workload, hw: Accelerator, gpus: int, plans: list[Plan],
                  gpu: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    print(assumptions(work, hw, gpus))
    if not plans:
        print(f"no layout fits in {_gib(hw.memory)} GiB per device")
        return
    table = Table()
    for col in ("#", "layout", "tokens/s", "MFU", "step s", "bubble", "exposed comm",
                "mem GiB"):
        table.add_column(col, justify="left" if col == "layout" else "right", no_wrap=True)
    for i, p in enumerate(plans, 1):
        t = p.time
        assert t is not None
        comm = sum(v for k, v in t.items.items() if k.startswith("comm:"))
        table.add_row(str(i), p.layout.describe(), f"{t.tokens_per_s:,.0f}", f"{t.mfu:.1%}",
                      f"{t.step:.3g}", f"{t.items['pipeline bubble'] / t.step:.1%}",
                      f"{comm / t.step:.1%}", f"{_gib(p.memory.total)}/{_gib(hw.memory)}")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    print_train_lines(work, gpu or hw.name, plans)


def print_breakdown(work: Workload, hw: Accelerator, plan: Plan, gpu: str | None = None
                    ) -> None:
    t, m = plan.time, plan.memory
    assert t is not None
    print(assumptions(work, hw, plan.layout.world_size))
    print(f"  layout {plan.layout.describe()}: {t.micro_batches} micro-batches per replica, "
          f"{work.loss} loss")
    lo = plan.layout
    if lo.hybrid:
        print(f"  hybrid sharding: ZeRO shards over groups of {lo.shard_size * lo.cp} ranks "
              f"(dp_shard{' x cp' if lo.cp > 1 else ''}), {lo.dp_rep} copies of each shard "
              "(dp / dp_shard)")
    verdict = "fits" if m.fits else "does NOT fit"
    print(f"memory per device (stage {m.stage}, peak at the {m.peak_phase}): {_size(m.total)} "
          f"of {_size(m.capacity)} -- {verdict}")
    for k, v in m.items.items():
        print(f"  {k:<24} {_size(v):>14}")
    print(f"time per step: {t.step:.4g} s")
    for k, v in t.items.items():
        if v > 0:
            print(f"  {k:<24} {v:>10.4g} s  {v / t.step:6.1%}")
    if t.comm:
        before = ", ".join(f"{k} {v:.3g} s" for k, v in t.comm.items())
        print(f"communication before overlap: {before}")
    print(f"tokens/s {t.tokens_per_s:,.0f} ({t.tokens_per_s / plan.layout.world_size:,.0f} per "
          f"device), MFU {t.mfu:.1%}, HFU {t.hfu:.1%}")
    print_train_lines(work, gpu or hw.name, [plan])


# ---------------------------------------------------------------------- the trainer's config
def hardware_here(purpose: str) -> Accelerator:
    """This machine's accelerator: its GPU's catalogue entry, or the (calibrated) ``cpu``."""
    import torch

    if not torch.cuda.is_available():
        return get_accelerator("cpu")
    name = torch.cuda.get_device_name().upper()
    mem = torch.cuda.get_device_properties(0).total_memory
    entry = ""
    for key, kind in (("H800", "h800"), ("H200", "h200"), ("B200", "b200"), ("MI300X", "mi300x")):
        if key in name:
            entry = kind
    if "H100" in name:
        entry = "h100-pcie" if "PCIE" in name else "h100-sxm"
    if "A100" in name:
        entry = "a100-40gb" if mem < 60 * GIB else "a100-80gb"
    if not entry:
        raise ConfigError(f"{purpose}: GPU {name!r} is not in the planner's catalogue")
    # the capacity the device reports (an H200's 139.8 GiB, where the datasheet says 141 GB)
    return replace(get_accelerator(entry), memory=float(mem))


def config_workload(cfg: Config, vocab_size: int | None = None) -> Workload:
    """The planner's question for a training config: its model, sequence, batch and dtype
    (meshlm keeps fp32 weights, gradients and Adam moments)."""
    return Workload(ModelSpec(cfg.model_config(vocab_size)), cfg.data.seq_len,
                    cfg.train.global_batch, dtype=cfg.precision.dtype, states="fp32",
                    loss=cfg.train.loss, loss_chunk=cfg.train.loss_chunk,
                    kernels="fused" if cfg.train.compile else "eager",
                    # auto: torch's fused AdamW, which it has for CUDA and CPU parameters
                    optimizer="foreach" if cfg.train.adamw_impl == "foreach" else "fused",
                    inner_steps=cfg.diloco.inner_steps, island_dtype=cfg.diloco.reduce_dtype,
                    fp8_rest=cfg.precision.fp8_rest)


def config_vocab(cfg: Config) -> int:
    """The vocabulary the run will have: its tokenizer's, or the BPE it trains."""
    if cfg.data.tokenizer and Path(cfg.data.tokenizer).expanduser().is_file():
        from ..data.tokenizer import Tokenizer

        return Tokenizer.load(Path(cfg.data.tokenizer).expanduser()).vocab_size
    return cfg.data.vocab_size


def config_model_line(cfg: Config) -> str:
    """``meshlm train --dry-run``'s first line: the model's parameters at the vocabulary the run
    will have, and its precision -- each against what ``meshlm plan`` assumes (the preset's
    published vocabulary; bf16 on GPUs) when they differ."""
    vocab, published = config_vocab(cfg), cfg.model_config().vocab_size
    mc = cfg.model_config(vocab)
    source = ("the tokenizer's" if cfg.data.tokenizer
              else "data.vocab_size: the BPE meshlm trains on the data")
    line = (f"# model {mc.name}: {_count(ModelSpec(mc).num_params())} parameters at vocabulary "
            f"{vocab:,} ")
    if vocab == published:
        line += "(the model's own)"
    else:
        whose = "model.init_from" if cfg.model.init_from else "the preset"
        line += (f"({source}; {whose} publishes {published:,}, which meshlm plan counts: "
                 f"{_count(ModelSpec(cfg.model_config(published)).num_params())} -- set "
                 f"data.vocab_size={published} or data.tokenizer to match)")
    dtype = cfg.precision.dtype
    return line + f"; precision {dtype}" + (
        " (meshlm train's default; meshlm plan's on GPUs: bf16)" if dtype == "fp32" else "")


def config_memory(cfg: Config, hw: Accelerator | None = None) -> list[str]:
    """``meshlm train --dry-run``: the planner's memory of the config's layout, per rank, on
    ``hw`` (``--gpu``; None: this machine's device)."""
    work = config_workload(cfg, config_vocab(cfg))
    lo = cfg.layout()
    if hw is None:
        try:
            hw = hardware_here("memory estimate")
        except ConfigError as e:
            return [f"# memory estimate: {e}"]
    m = memory(work, lo, hw)
    stage = f" (pipeline stage {m.stage}, the most loaded)" if lo.pp > 1 else ""
    alive = set(m.phases[m.peak_phase])
    rest = ("transient", "buffers", "weight copies", "step temporaries")
    return [
        f"# memory estimate per rank (planner, {hw.name}): model {work.model.name}, "
        f"{work.model.num_params() / 1e6:.2f} M parameters, layout {lo.describe()}, "
        f"{'compiled' if work.kernels == 'fused' else 'eager'}, {work.optimizer} AdamW",
        f"#   weights + grads + Adam: {_size(m.states)} ({8 if m.host else 16} bytes/parameter "
        "before sharding)",
        *(f"#   Adam moments off the device ({lo.offload}): {_size(v)}"
          for v in m.host.values()),
        f"#   activations (micro-batch {lo.micro_batch} x {work.seq_len}): "
        f"{_size(m.items['activations'])}",
        *(f"#   {k}: {_size(m.items[k])}" for k in rest if m.items.get(k)),
        f"#   reserved (runtime + allocator): {_size(m.items['reserved'])}",
        f"#   peak{stage}, at the {m.peak_phase} ("
        + " + ".join(k for k in m.items if k in alive and m.items[k]) + "): "
        f"{_size(m.total)} of {_size(m.capacity)} -- " + ("fits" if m.fits else "does NOT fit"),
        *([checkpoint_host_line(m, hw.is_cpu)] if cfg.checkpoint.async_save else []),
    ]


def oom_advice(cfg: Config) -> tuple[str, str]:
    """(the planner's estimate of ``cfg``'s layout, the levers that would fit it) on this
    machine, for the out-of-memory line of a rank (``train/oom.py``); ("", "") when the device
    is not in the planner's catalogue."""
    try:
        hw = hardware_here("out-of-memory report")
        work, lo = config_workload(cfg, config_vocab(cfg)), cfg.layout()
        m = memory(work, lo, hw)
        return (f"the planner estimates {size_text(m.total)} per rank for layout "
                f"{lo.describe()} (peak at the {m.peak_phase}) of {size_text(m.capacity)}",
                levers_text(work, lo, hw))
    except (ConfigError, ValueError, OSError):
        return "", ""


def checkpoint_host_line(m: MemoryBreakdown, cpu: bool) -> str:
    """``checkpoint.async``: the host copy of the rank's shards, kept between saves (on a CPU
    the same memory as the step's, so on top of its peak)."""
    line = (f"#   host memory: copy of the checkpoint shards (checkpoint.async, kept between "
            f"saves): {_size(m.checkpoint_host)}")
    if cpu:
        line += f"; on this CPU on top of the peak: {_size(m.total + m.checkpoint_host)}"
    return line


def fit_micro_batch(cfg: Config, hw: Accelerator | None = None) -> tuple[Config, str | None]:
    """An automatic ``train.micro_batch`` (left at 0: global / (dp x islands)) made the
    largest divisor of global / (dp x islands) whose layout the planner says fits ``hw``
    (None: this machine's device): (the config, a copy when it changed; the line saying so,
    None when unchanged). Nothing fits even at 1: 1, for the memory check to report."""
    if not cfg.micro_batch_auto:
        return cfg, None
    if hw is None:
        try:
            hw = hardware_here("train.micro_batch")
        except ConfigError:
            return cfg, None
    work = config_workload(cfg, config_vocab(cfg))
    layout = cfg.layout()
    per_rank = cfg.train.global_batch // (layout.dp * cfg.parallel.islands)
    start = cfg.train.micro_batch  # (under a pipeline already smaller: at least pp of them)
    for m in sorted((d for d in range(1, start + 1) if per_rank % d == 0), reverse=True):
        if memory(work, replace(layout, micro_batch=m), hw).fits or m == 1:
            break
    if m == start:
        return cfg, None
    out = cfg.derive({"train.micro_batch": m})
    out.micro_batch_auto = True
    return out, (f"train.micro_batch: {m} (a micro-batch of {start} does not fit {hw.name} "
                 "memory by the planner's estimate)")


def auto_layout(cfg: Config, world_size: int) -> Layout:
    """Best layout of ``world_size`` ranks for ``cfg`` among those meshlm's trainer runs.

    Every candidate goes through :func:`meshlm.config.training_problems`, so only what
    training supports is proposed (apply it with ``cfg.with_layout``). Raises ConfigError when
    nothing fits.
    """
    work = config_workload(cfg)
    hw = hardware_here("parallel.auto")
    model_cfg = work.model.config

    def allowed(lo: Layout) -> bool:
        return not training_problems(cfg, lo, model_cfg)

    if why := world_problem(work, world_size, hw):
        raise ConfigError(f"parallel.auto: {why}")

    plans = search(work, world_size, hw, top=1, allowed=allowed)  # recomputation included
    if not plans:
        raise ConfigError(f"parallel.auto: no layout of {world_size} ranks fits model "
                          f"{work.model.name} (seq {work.seq_len}, global batch "
                          f"{work.global_batch}) in {_gib(hw.memory)} GiB per device on "
                          f"{hw.name}")
    # (the search never moves optimizer states; the config's choice stays)
    return replace(plans[0].layout, offload=cfg.parallel.offload)
