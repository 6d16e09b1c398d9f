"""Command line: ``meshlm train | info | generate | convert | schedule | plan | report``.

User mistakes (config, data path, checkpoint, numbers out of range, output paths) end with
one ``meshlm: error: ...`` line and exit status 2, before any worker starts or any file is
written; no traceback. Output paths follow :mod:`meshlm.paths`: a FILE's folder must exist
(``schedule --plot``), a FOLDER is created (``report --out``, ``prepare --out``,
``convert --to-hf``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import typing
from pathlib import Path

from .checkpoint.state import CheckpointError
from .config import ConfigError, load_config, resolve_world, to_toml
from .version import __version__


def _split_overrides(rest: list[str]) -> list[str]:
    """Accept ``--a.b=c`` and ``--a.b c``; anything else is an error."""
    out, i = [], 0
    while i < len(rest):
        item = rest[i]
        if not item.startswith("--") or "." not in item.split("=")[0]:
            raise ConfigError(f"unexpected argument {item!r} (overrides look like --section.key=value)")
        if "=" not in item:
            if i + 1 >= len(rest) or rest[i + 1].startswith("--"):
                raise ConfigError(f"override {item!r} has no value")
            item, i = f"{item}={rest[i + 1]}", i + 1
        out.append(item)
        i += 1
    return out


_OVERRIDE = re.compile(r"--[A-Za-z_]\w*\.[\w.]+(=.*)?", re.S)


def _pull_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without its ``--section.key[=value]`` overrides, the overrides) for ``train``.

    argparse takes a word that starts with ``--`` but holds a space (``--run.sample_prompt=The
    licensee``) for a positional -- the config file -- so overrides are set aside before it
    parses; a ``--section.key value`` pair keeps its value word."""
    if not argv or argv[0] != "train":
        return argv, []
    kept, pulled, i = [], [], 0
    while i < len(argv):
        word = argv[i]
        if _OVERRIDE.fullmatch(word):
            pulled.append(word)
            if "=" not in word and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                pulled.append(argv[i + 1])
                i += 1
        else:
            kept.append(word)
        i += 1
    return kept, pulled


class _Parser(argparse.ArgumentParser):
    """argparse with the contract's one line: ``meshlm: error: ...`` (no usage block), status 2."""

    def error(self, message: str) -> typing.NoReturn:
        where = self.prog.removeprefix("meshlm").strip()
        self.exit(2, f"meshlm: error: {where + ': ' if where else ''}{message} "
                     f"(see {self.prog} --help)\n")


# The planner's memory estimate may exceed the device by this factor before training is
# refused (the estimate is approximate; a layout just over may still run).
MEMORY_REFUSAL = 1.0


def refuse_if_too_big(cfg) -> None:  # noqa: ANN001
    """ConfigError when the planner's estimate of the layout is clearly over this machine's
    memory (above :data:`MEMORY_REFUSAL` times its capacity); silent when it fits or when the
    device is not in the planner's catalogue."""
    from .planner.cli import config_vocab, config_workload, hardware_here
    from .planner.levers import levers_text
    from .planner.memory import memory

    try:
        hw = hardware_here("memory check")
    except ConfigError:
        return
    work = config_workload(cfg, config_vocab(cfg))
    m = memory(work, cfg.layout(), hw)
    if m.fits or m.total <= MEMORY_REFUSAL * m.capacity:
        return
    gib = 2**30
    levers = levers_text(work, cfg.layout(), hw)
    raise ConfigError(
        f"layout {cfg.layout().describe()} needs about {m.total / gib:.1f} GiB per rank by the "
        f"planner's estimate (peak at the {m.peak_phase}), but {hw.name} has "
        f"{m.capacity / gib:.1f} GiB; "
        + (f"to fit: {levers}; or " if levers else "")
        + f"add ranks to shard the {m.states / gib:.1f} GiB of weights, gradients and Adam "
        "moments (parallel.tp, parallel.pp, parallel.dp with parallel.zero=3), or see meshlm "
        "train --dry-run"
    )


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    """Validate everything, then train: in-process, under torchrun/SLURM, or on local workers."""
    from .world import detect_external_world

    if args.keys:
        from .config import key_reference

        for key, default, accepts, doc in key_reference():
            print(f"{key} = {default}  ({accepts})\n    {doc}")
        return 0

    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts={args.max_restarts} must be >= 0")
    hw = None  # --gpu: the accelerator of the dry run's memory estimate (None: this machine's)
    if args.gpu is not None:
        if not args.dry_run:
            raise ConfigError(f"--gpu {args.gpu} names the accelerator of --dry-run's memory "
                              "estimate: it needs --dry-run (a run uses the devices it has)")
        from .planner.hardware import get_accelerator

        hw = get_accelerator(args.gpu)
    cfg = load_config(args.config, _split_overrides(rest))
    world = detect_external_world()
    if world is not None and args.max_restarts:
        raise ConfigError(f"--max-restarts restarts the workers meshlm starts itself; this "
                          f"process is one rank of a {world.source} world, so let its launcher "
                          "restart them (e.g. torchrun --max-restarts)")
    # load_config validated cfg; what is derived from here on goes into new configs, and the
    # one a run reads is sealed (meshlm.config.Section): nothing writes it
    if cfg.parallel.auto:
        cfg = apply_auto_layout(cfg, world.world_size if world else cfg.world_size)
    cfg = resolve_world(cfg, world.world_size if world else None)
    from .planner.cli import fit_micro_batch, oom_advice

    if world is None and (cfg.world_size > 1 or args.max_restarts) and not args.dry_run:
        from .distributed.forkserver import start_worker_server

        # local workers will fork from it: its imports (torch, meshlm: seconds) run beside this
        # process's own and its checks, not before the first fork
        start_worker_server()
    cfg, line = fit_micro_batch(cfg, hw)
    if line and (world is None or world.rank == 0):
        print(line)
    if not args.dry_run:
        refuse_if_too_big(cfg)
    if args.dry_run:
        from .planner.cli import config_memory, config_model_line

        print(config_model_line(cfg))  # (the vocabulary and precision, against meshlm plan's)
        print(to_toml(cfg))
        for line in config_memory(cfg, hw):
            print(line)
        return 0
    from .train.run_dir import claim_run_dir, with_run_dir
    from .train.trainer import prepare_launch, run_worker, train

    # The run directory is this run's (a lock, meshlm/run_lock.py) from here to its end:
    # claimed before anything is written into it or any worker starts.
    if world is not None:  # this process is one rank of a world torchrun/SLURM started
        from .data import build_data
        from .launch import (
            announce_restart,
            export_env,
            init_worker,
            rank_zero_text,
            shutdown_worker,
        )

        export_env(world)
        if cfg.run.dir:  # (NCCL only: torch's flight recorder dumps next to meshlm's)
            from pathlib import Path

            from .launch import nccl_flight_env

            for k, v in nccl_flight_env(str(Path(cfg.run.dir).expanduser() / "flight")).items():
                os.environ.setdefault(k, v)
        cfg = with_run_dir(cfg).sealed()  # (rank 0's name is the world's: agree_run_dir)
        lock, refused = None, ""
        if world.rank == 0:  # rank 0 claims it for the world; the others learn a refusal
            try:
                lock = claim_run_dir(cfg)
            except ConfigError as e:
                refused = str(e)
        try:
            # Before the process group exists, so a first, slow tokenization cannot time out
            # the others' collectives; concurrent builds of one cache are safe (atomic renames).
            if not refused:
                build_data(cfg.data, log=print if world.rank == 0 else (lambda _m: None))
            announce_restart(init_worker(cfg.distributed.init_timeout_s).rank)
            if refused := rank_zero_text(refused):
                shutdown_worker()
                raise ConfigError(refused)
            ended_well = False
            try:
                result = train(cfg, oom_advice=oom_advice)
                ended_well = True
            finally:
                shutdown_worker(wait_for_peers=ended_well)
            if world.rank == 0:
                _say_how_to_resume(result, argv_rest=rest, config=args.config)
        finally:
            if lock is not None:
                lock.release()
        _leave_world()
    elif cfg.world_size > 1 or args.max_restarts:  # workers started here by torch's agent
        from pathlib import Path

        from .launch import launch_local, refuse_local_ranks

        refuse_local_ranks(cfg.world_size)  # (CUDA: one GPU per rank; nothing written yet)
        cfg = with_run_dir(cfg).sealed()
        with claim_run_dir(cfg) as lock:  # held by this process and by every worker
            prepare_launch(cfg)  # run dir and data checked (and data cached) before any worker
            results = launch_local(cfg.world_size, run_worker, cfg, oom_advice,
                                   max_restarts=args.max_restarts,
                                   timeout_s=cfg.distributed.init_timeout_s,
                                   flight_dir=str(Path(cfg.run.dir).expanduser() / "flight"),
                                   hold=lock.handle())
        _say_how_to_resume(results[0], argv_rest=rest, config=args.config)
    else:
        cfg = with_run_dir(cfg).sealed()
        with claim_run_dir(cfg):
            result = train(cfg, oom_advice=oom_advice)
        _say_how_to_resume(result, argv_rest=rest, config=args.config)
    return 0


def _leave_world() -> typing.NoReturn:
    """End a rank of a torchrun / SLURM world whose run completed: output flushed, then the
    process exits at once. Its process group is destroyed and its peers have left
    (``shutdown_worker``); what is left are C++ objects of torch.distributed (store clients,
    gloo threads) whose destructors at interpreter exit can abort a complete run
    ("terminate called without an active exception") when the rendezvous host has gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _say_how_to_resume(result, argv_rest: list[str], config: str | None) -> None:  # noqa: ANN001
    """After a graceful stop (SIGTERM/SIGINT): the command line that continues the run."""
    if not result.stopped_by:
        return
    import shlex

    keep = [a for a in _split_overrides(argv_rest)
            if not a.startswith(("--run.resume=", "--run.dir="))]
    line = shlex.join(["meshlm", "train", *([config] if config else []), *keep,
                       f"--run.dir={result.run_dir}", "--run.resume=true"])
    print(f"meshlm: stopped by {result.stopped_by} at step {result.final_step} with a complete "
          f"checkpoint; to continue: {line}", flush=True)


def apply_auto_layout(cfg, world_size: int):  # noqa: ANN001, ANN201
    """``parallel.auto=true``: a copy of ``cfg`` with the planner's best layout of
    ``world_size`` ranks.

    Under torchrun/SLURM the world is given; otherwise its size is pp * dp * cp * tp of the
    config (e.g. ``--parallel.dp=4`` means "4 local ranks, planner's choice of layout"). The
    planner proposes only layouts that pass the trainer's rules.
    """
    from .planner.cli import auto_layout

    layout = auto_layout(cfg, world_size)
    print(f"parallel.auto: {world_size} ranks -> {layout.describe()}")
    return cfg.with_layout(layout)


def cmd_info(args: argparse.Namespace, rest: list[str]) -> int:
    from .models.config import ModelConfig
    from .models.presets import PRESETS

    if rest:
        raise ConfigError(f"unexpected arguments {' '.join(rest)!r}")
    if args.seq_len < 1:
        raise ConfigError(f"--seq-len={args.seq_len} must be >= 1")
    rows = []
    for name, mc in PRESETS.items():
        rows.append({
            "preset": name, "params": mc.num_params(), "active_params": mc.num_params(active=True),
            "layers": mc.n_layers, "dim": mc.dim, "heads": mc.n_heads, "kv_heads": mc.n_kv_heads,
            "experts": mc.moe_experts, "flops_per_token": mc.flops_per_token(args.seq_len),
            "vocab": mc.vocab_size, "attention": mc.attention_layer.upper(),
            # the techniques' extra modules: apart from the totals (published totals leave
            # them out); their FLOPs are in flops_per_token
            **mc.info(),
        })
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"meshlm {__version__} presets (training FLOPs/token at seq {args.seq_len})")
    extra = ModelConfig.info_columns()  # (header, what, depth, total, active) of extra modules
    table.caption = ("params at each preset's vocabulary (vocab); meshlm train sizes the "
                     "embedding and head to its tokenizer's (the default corpus: 4096 ids)"
                     + "".join(f"; params and active leave out {what} ({h}: its own "
                               "parameters, total / active; its FLOPs are in FLOPs/token)"
                               for h, what, *_ in extra))
    cols = ("preset", "params", "active", *(h for h, *_ in extra), "vocab", "layers", "dim",
            "heads/kv", "experts", "FLOPs/token")
    for col in cols:
        table.add_column(col, justify="left" if col == "preset" else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            r["preset"], _human(r["params"]), _human(r["active_params"]),
            *((f"{_human(r[total])} / {_human(r[active])}" if r[depth] else "-")
              for _, _, depth, total, active in extra), f"{r['vocab']:,}",
            str(r["layers"]), str(r["dim"]),
            f"{r['heads']}/{r['kv_heads']}" + (f" {r['attention']}" if r["attention"] != "GQA"
                                               else ""),
            str(r["experts"] or "-"), _human(r["flops_per_token"]),
        )
    Console(width=None if sys.stdout.isatty() else 140).print(table)
    return 0


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))


def cmd_generate(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise ConfigError(f"unexpected arguments {' '.join(rest)!r}")
    from .checkpoint.loading import load_model, resolve_checkpoint
    from .data.tokenizer import Tokenizer
    from .generate import generate_text

    if not args.prompt:
        raise ConfigError("--prompt must not be empty")
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature={args.temperature} must be a number >= 0 (0: the "
                          "most likely token)")
    if args.top_k < 0:
        raise ConfigError(f"--top-k={args.top_k} must be >= 0 (0: no limit)")
    ckpt = resolve_checkpoint(args.checkpoint)
    tok_path = ckpt / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no tokenizer.json")
    model = load_model(ckpt)
    text = generate_text(model, Tokenizer.load(tok_path), args.prompt, args.max_new_tokens,
                         args.temperature, args.top_k, args.seed)
    print(text)
    return 0


def cmd_convert(args: argparse.Namespace, rest: list[str]) -> int:
    """A meshlm checkpoint -> a Hugging Face folder (LlamaForCausalLM, MixtralForCausalLM,
    Qwen3(Moe)ForCausalLM or DeepseekV3ForCausalLM: ``models/hf_config.py``), one tensor at a
    time from the sharded files."""
    import shutil

    from .checkpoint.hf import hf_architecture, write_hf
    from .checkpoint.loading import checkpoint_model_config, resolve_checkpoint
    from .checkpoint.sharded import ShardedCheckpoint, check_model
    from .models.llama import build_model

    if rest:
        raise ConfigError(f"unexpected arguments {' '.join(rest)!r}")
    from .paths import output_dir
    from .run_lock import claim

    out = Path(args.to_hf).expanduser()
    refusal = f"--to-hf {str(out)!r} already exists and is not an empty folder"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(refusal)
    output_dir(out, "--to-hf")
    if not (math.isfinite(args.max_shard_mb) and args.max_shard_mb > 0):
        raise ConfigError(f"--max-shard-mb={args.max_shard_mb} must be a positive number")
    with ShardedCheckpoint(resolve_checkpoint(args.checkpoint)) as ckpt:
        cfg = checkpoint_model_config(ckpt)
        check_model(ckpt, {n: tuple(p.shape)
                           for n, p in build_model(cfg, device="meta").named_parameters()})
        created = _first_missing(out)
        # one convert per output (the folder is written beside it and renamed: lock beside)
        with claim(out, "--to-hf", "--to-hf", "meshlm convert", beside=True):
            if out.exists() and any(out.iterdir()):  # (written meanwhile by another)
                raise ConfigError(refusal)
            try:
                write_hf(out, cfg, ckpt.source("weight"), int(args.max_shard_mb * 2**20),
                         expert_biases=ckpt.trainer.get("moe_bias"))
            except (ValueError, OSError) as e:
                if created is not None:
                    shutil.rmtree(created, ignore_errors=True)
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                raise ConfigError(f"--to-hf {str(out)!r}: {why}" if isinstance(e, OSError)
                                  else why) from None
            if (ckpt.directory / "tokenizer.json").is_file():
                shutil.copyfile(ckpt.directory / "tokenizer.json", out / "tokenizer.json")
    print(f"wrote {out} ({hf_architecture(cfg)}, "
          f"{cfg.num_params() / 1e6:.1f} M parameters) from {ckpt.directory}")
    return 0


# The most pipeline ranks and (rank, micro-batch, virtual stage) cells ``meshlm schedule``
# lays out: a table of pp rows and about 3 x microbatches x virtual columns, printed and
# simulated in about a second.
MAX_SCHEDULE_PP, MAX_SCHEDULE_CELLS = 128, 4096


def cmd_schedule(args: argparse.Namespace, rest: list[str]) -> int:
    """Print (and draw) a pipeline schedule, or draw a run's measured timeline."""
    if rest:
        raise ConfigError(f"unexpected arguments {' '.join(rest)!r}")
    from .paths import output_file
    from .viz import PLOT_FORMATS, schedule_rows, timeline_rows

    plot = output_file(args.plot, "--plot", PLOT_FORMATS) if args.plot else None
    if args.timeline:
        try:
            rows, head = timeline_rows(args.timeline)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
        busy = [sum(a["end"] - a["start"] for a in row) for row in rows]
        total = max(a["end"] for row in rows for a in row)
        print(f"measured {head['schedule']} step over {len(rows)} stages: "
              f"bubble {1 - sum(busy) / (len(rows) * total):.3f}")
        _draw(plot, rows, f"measured {head['schedule']} (pp={len(rows)})", "seconds")
        return 0
    from .layout import LOOPED_SCHEDULES, V_SCHEDULES
    from .parallel.schedules import build_schedule, format_table, simulate

    if args.virtual is None:  # the fewest chunks per rank the schedule runs with
        args.virtual = 2 if args.schedule in (*V_SCHEDULES, *LOOPED_SCHEDULES) else 1
    check_schedule_size(args.pp, args.microbatches, args.virtual)
    try:
        tables = build_schedule(args.schedule, args.pp, args.microbatches, args.virtual)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sim = simulate(tables, args.virtual)
    print(format_table(tables))
    print(f"ideal bubble (F=1, B=2, I=W=1 per stage): {sim['bubble']:.4f}; peak live "
          f"micro-batches per rank: {sim['peak_live']}")
    v = f", v={args.virtual}" if args.virtual > 1 else ""
    _draw(plot, schedule_rows(sim), f"{args.schedule} (pp={args.pp}, m={args.microbatches}"
          f"{v}): bubble {sim['bubble']:.3f}", "time (forward of one stage = 1)")
    return 0


def check_schedule_size(pp: int, microbatches: int, virtual: int) -> None:
    """ConfigError for a schedule too large to print (:data:`MAX_SCHEDULE_CELLS`)."""
    if pp > MAX_SCHEDULE_PP:
        raise ConfigError(f"--pp={pp} is more than the {MAX_SCHEDULE_PP} ranks a printed "
                          "schedule shows")
    cells = max(pp, 1) * max(microbatches, 1) * max(virtual, 1)
    if cells > MAX_SCHEDULE_CELLS:
        raise ConfigError(f"--pp={pp} x --microbatches={microbatches} x --virtual={virtual} "
                          f"= {cells} is more than the {MAX_SCHEDULE_CELLS} cells a printed "
                          "schedule shows")


def _draw(plot: Path | None, rows: list[list[dict]], title: str, unit: str) -> None:
    """``--plot``: draw ``rows`` into the checked path (nothing when not asked)."""
    if plot is None:
        return
    from .viz import draw

    try:
        draw(rows, title, plot, unit)
    except OSError as e:
        raise ConfigError(f"--plot {str(plot)!r}: cannot write it ({e.strerror or e})") from None
    print(f"wrote {plot}")


def cmd_report(args: argparse.Namespace, rest: list[str]) -> int:
    """PNG plots and one self-contained HTML page of a run directory."""
    if rest:
        raise ConfigError(f"unexpected arguments {' '.join(rest)!r}")
    from .paths import output_dir
    from .train.report import ReportError, write_report

    out = output_dir(args.out, "--out") if args.out else None
    try:
        files = write_report(args.run_dir, out)
    except ReportError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"cannot write the report of {args.run_dir}: {e}") from None
    print(f"wrote {len(files) - 1} figure(s): {', '.join(f.name for f in files[:-1]) or '-'}")
    print(f"report: {files[-1]}")
    return 0


def cmd_prepare(args: argparse.Namespace, rest: list[str]) -> int:
    """Tokenize inputs into a sharded dataset folder (docs/data.md)."""
    if unknown := [r for r in rest if r.startswith("-")]:
        raise ConfigError(f"unexpected arguments {' '.join(unknown)!r}")
    args.inputs += rest  # inputs written after some options
    if args.tokenizer and args.vocab_size is not None:
        raise ConfigError("give --tokenizer or --vocab-size, not both")
    if args.vocab_size is not None and args.vocab_size < 260:
        raise ConfigError(f"--vocab-size={args.vocab_size} must be >= 260 (256 bytes + "
                          "special tokens)")
    if not (math.isfinite(args.unit_mb) and args.unit_mb > 0):
        raise ConfigError(f"--unit-mb={args.unit_mb} must be a number > 0")
    from pathlib import Path

    from .data.prepare import prepare, summary
    from .paths import output_dir
    from .run_lock import claim

    out = output_dir(args.out, "--out")
    created = _first_missing(out)
    # one prepare per folder, for its whole life (a later one resumes an unfinished folder)
    with claim(out, "--out", "--out", "meshlm prepare"):
        try:
            result = prepare(args.inputs, out, tokenizer=args.tokenizer,
                             vocab_size=args.vocab_size or 4096, workers=args.workers,
                             text_field=args.text_field, val_fraction=args.val_fraction,
                             unit_bytes=int(args.unit_mb * 2**20), progress=not args.quiet)
        except ConfigError:  # (a bad input found on the way: the folders this call made go)
            if created is not None:
                import shutil

                shutil.rmtree(created, ignore_errors=True)
            raise
    print(summary(result, Path(args.out)))
    return 0


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (None: it exists)."""
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="meshlm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"meshlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (default: `small` on the default corpus)",
                       epilog="overrides: --section.key=value, e.g. --train.steps=50 "
                              "(every key: meshlm train --keys)")
    p.add_argument("config", nargs="?", help="TOML config file")
    p.add_argument("--keys", action="store_true",
                   help="list every config key with its default, what it accepts and what it "
                        "does, then exit")
    p.add_argument("--dry-run", action="store_true",
                   help="validate, print the resolved config and the memory estimate")
    p.add_argument("--gpu", metavar="KIND",
                   help="with --dry-run: estimate the memory on this accelerator (a meshlm "
                        "plan --gpu name or TOML file) instead of this machine's")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="when a worker fails, restart all workers up to N times; they resume "
                        "from the latest checkpoint (local workers only; default 0)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare", help="tokenize text / JSONL / Parquet / datasets folders "
                       "into a sharded dataset folder for training (data.path, data.mix)")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files or folders (text, .jsonl[.gz|.zst], .parquet, save_to_disk)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the dataset folder to write, created if missing (an unfinished one "
                        "of the same command resumes, a finished one is kept; other files "
                        "there: refused)")
    p.add_argument("--tokenizer", metavar="FILE", help="a Hugging Face tokenizer.json "
                   "(default: train a byte-level BPE on the train documents)")
    p.add_argument("--vocab-size", type=int, metavar="N",
                   help="vocabulary of the trained BPE (default 4096)")
    p.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 1), metavar="N",
                   help="tokenizing processes (default: one per CPU)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="JSONL field / Parquet or arrow column holding the text")
    p.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                   help="share of documents held out for validation (default 0.05)")
    p.add_argument("--unit-mb", type=float, default=8, metavar="MB",
                   help="input megabytes per work unit (default 8)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("info", help="list model presets with parameter and FLOP counts")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)

    from .planner.cli import add_plan_parser

    add_plan_parser(sub)

    from .layout import SCHEDULES

    p = sub.add_parser("schedule", help="print and draw a pipeline schedule or a measured step")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedule", default="1f1b", help=" | ".join(SCHEDULES))
    p.add_argument("--virtual", type=int, default=None,
                   help="virtual stages per rank (default: 2 for interleaved, bfs, "
                        "interleaved-zb, zbv and dualpipev, else 1)")
    p.add_argument("--timeline", help="a run dir: draw its measured last step instead")
    p.add_argument("--plot", metavar="FILE",
                   help="image to write: .png, .svg, .pdf or .jpg (its folder must exist; "
                        "an existing file of that name is replaced)")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser("generate", help="sample text from a trained model")
    p.add_argument("--checkpoint", required=True, help="run dir or checkpoint dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=120)
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature (default 0.8; 0: always the most likely token)")
    p.add_argument("--top-k", type=int, default=50,
                   help="sample among the k most likely tokens (default 50; 0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("convert", help="export a checkpoint as a Hugging Face model folder")
    p.add_argument("checkpoint", help="run dir or checkpoint dir")
    p.add_argument("--to-hf", required=True, metavar="OUT",
                   help="new (or empty) folder, created if missing: config.json + "
                        "safetensors (Llama, Mixtral, Qwen3, Qwen3-MoE or DeepSeek-V3 "
                        "ForCausalLM, as the model's shape asks)")
    p.add_argument("--max-shard-mb", type=float, default=5120,
                   help="split the weights into files of at most this size (default 5120)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("report", help="plots (PNG) and one HTML page of a training run")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (run.dir)")
    p.add_argument("--out", metavar="DIR",
                   help="folder to write them into, created if missing; a previous report "
                        "there is replaced (default RUN_DIR/report)")
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv, overrides = _pull_overrides(list(sys.argv[1:] if argv is None else argv))
    args, rest = parser.parse_known_args(argv)
    rest = overrides + rest
    try:
        return args.func(args, rest)
    except (ConfigError, CheckpointError) as e:
        # Under torchrun every rank validates the same config: only rank 0 speaks.
        if _rank_zero():
            print(f"meshlm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshlm: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        code = _fault_status(e)
        if code is None:
            raise
        return code


def _rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0" and os.environ.get("SLURM_PROCID", "0") == "0"


def _fault_status(e: Exception) -> int | None:
    """Exit status 1 after one line for a fault while running (not a user mistake); None for
    anything else. (Imported here: a configuration error never needs torch.)"""
    from .distributed.flight import CollectiveFailure
    from .launch import WorkerFailure
    from .train.nonfinite import NonFiniteError
    from .train.oom import OutOfMemory

    # OutOfMemory: the rank that ran out says where, how much and what would fit;
    # CollectiveFailure: every rank that gave up says which rank it waited for;
    # WorkerFailure: launch_local's one line for a failed worker
    if isinstance(e, OutOfMemory | CollectiveFailure | WorkerFailure):
        print(f"meshlm: error: {e}", file=sys.stderr)
        return 1
    if isinstance(e, NonFiniteError):  # decided alike on every rank: rank 0 speaks
        if _rank_zero():
            print(f"meshlm: error: {e}", file=sys.stderr)
        return 1
    return None


if __name__ == "__main__":
    sys.exit(main())
