"""Typed run configuration: TOML file + dotted command-line overrides, validated up front.

A config is a set of dataclass sections (``[model]``, ``[data]``, ``[train]``, ``[parallel]``,
``[precision]``, ``[checkpoint]``, ``[run]``). Each component receives only its own section.
Every value is checked against its field's type and range before any worker starts or any file
is written; a bad value raises :class:`ConfigError` with one line naming the key, the value and
what would be valid. The ``[parallel]`` keys and ``train.micro_batch`` are read as one
:class:`~meshlm.layout.Layout` (:meth:`Config.layout`), checked by the layout's own rules.
``run.resume`` is a mode (``false``, ``true``, ``auto``); booleans are read as the first two.
The resolved config is written as ``config.toml`` into the run directory.

No communication; reading ``model.init_from``'s ``config.json`` is the only file access besides
the TOML file and the existence checks of paths.
"""

from __future__ import annotations

import importlib.util
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from .layout import CONFIG_KEYS, PARALLEL_KEYS, Layout
from .models.config import ModelConfig
from .models.presets import PRESETS, get_preset


class ConfigError(ValueError):
    """A user mistake in the configuration; its message is one line for the terminal."""


@dataclass
class ModelSection:
    """``preset`` plus optional overrides of any :class:`ModelConfig` field, and where the
    initial weights come from (``init_from``; not a shape field)."""

    preset: str = "small"
    n_layers: int | None = None
    dim: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    head_dim: int | None = None
    rope_theta: float | None = None
    max_seq_len: int | None = None
    tie_embeddings: bool | None = None
    init_std: float | None = None
    moe_experts: int | None = None
    moe_topk: int | None = None
    moe_ffn_hidden: int | None = None
    moe_shared_experts: int | None = None
    moe_first_dense: int | None = None
    moe_aux_loss_coef: float | None = None
    moe_balance: str | None = None  # aux | seq_aux | bias
    moe_bias_rate: float | None = None
    moe_capacity: float | None = None  # 0: dropless
    # A Hugging Face folder (config.json + safetensors: its shape replaces the preset's) or a
    # meshlm run/checkpoint dir to take the initial weights from; "" -> drawn from train.seed.
    init_from: str = ""


# ModelSection fields that are not ModelConfig overrides.
_NOT_SHAPE = ("preset", "init_from")


@dataclass
class DataSection:
    path: str = ""  # "" -> the embedded default corpus (this interpreter's standard library)
    tokenizer: str = ""  # a tokenizer.json; "" -> train a byte-level BPE on the corpus (cached)
    vocab_size: int = 4096  # size of the BPE trained when no tokenizer is given
    seq_len: int = 256
    val_fraction: float = 0.05  # share of files held out for validation
    text_field: str = "text"  # JSONL field holding the text
    cache_dir: str = ""  # "" -> $XDG_CACHE_HOME/meshlm or ~/.cache/meshlm


@dataclass
class TrainSection:
    steps: int = 500
    global_batch: int = 16  # sequences per optimizer step
    # sequences per forward/backward on one data-parallel rank; 0 -> global_batch / dp, made
    # smaller (a divisor) when the planner says it does not fit the device (meshlm train)
    micro_batch: int = 0
    seed: int = 1234
    # adamw | sgd (SGD with momentum beta1 and L2 weight decay: linear in the gradient, so
    # e.g. DiLoCo with one inner step and outer lr 1 is exactly synchronous training)
    optimizer: str = "adamw"
    # AdamW's kernels: auto (torch's fused AdamW where it has one for the device: CUDA, CPU) |
    # fused | foreach (multi-tensor; a temporary as large as the moments); see optim.py
    adamw_impl: str = "auto"
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    eval_every: int = 100  # 0 disables evaluation
    eval_batches: int = 8
    eval_batch_size: int = 8  # sequences per evaluation batch (independent of the layout)
    log_every: int = 10
    checkpoint_every: int = 0  # 0 -> only at the end
    peak_flops: float = 0.0  # per-rank peak FLOP/s for MFU; 0 -> measured (CPU) / datasheet (GPU)
    # activation recomputation: none | selective (attention core) | op (every other matmul
    # output kept) | full (whole decoder layers); see parallel/recompute.py
    recompute: str = "none"
    loss: str = "torch"  # torch (whole logits) | chunked (LM head + loss over token chunks)
    # torch.compile each decoder block, the final norm + head and the loss after
    # parallelisation (inductor; needs a C++ compiler on CPU); see parallel/compile.py
    compile: bool = False
    loss_chunk: int = 1024  # tokens per chunk of the chunked loss
    # a non-finite loss or gradient norm: stop (error, nothing saved) | skip (drop the step) |
    # rollback (reload the last checkpoint, skip the offending batches); see train/nonfinite.py
    on_nonfinite: str = "stop"
    max_skips: int = 10  # consecutive skipped / rolled-back steps that end the run
    # global batches never trained on, e.g. "120,121" (Megatron's --iterations-to-skip):
    # step k takes the k-th batch not listed; rollback adds the batches it skips
    skip_batches: str = ""


@dataclass
class ParallelSection:
    dp: int = 0  # 0 -> inferred: world / (pp * cp * tp) under torchrun or SLURM, else 1
    tp: int = 1
    sp: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    pp_layers: str = ""  # explicit layers per stage, e.g. "3,3,2"; "" -> balanced by count
    cp: int = 1
    cp_attention: str = "zigzag"  # zigzag | ring | ulysses (context-parallel attention)
    ep: int = 1
    zero: int = 0
    offload: str = "none"  # optimizer states: none | cpu (host memory, GPU runs) | disk (memmap)
    offload_dir: str = ""  # where offload=disk keeps them; "" -> <run.dir>/offload
    bucket_mb: float = 25.0  # gradient bucket size of DDP and ZeRO-1/2
    auto: bool = False  # let the planner pick the layout of the world (see meshlm plan)
    # DiLoCo: islands of the inner layout above, synchronised every diloco.inner_steps steps
    # (world = islands * pp * dp * cp * tp); 1 = plain synchronous training
    islands: int = 1
    # hybrid sharding (HSDP): ZeRO shards over groups of dp_shard dp ranks (within a node),
    # replicated dp / dp_shard times (across nodes); 0 -> all of dp (plain ZeRO)
    dp_shard: int = 0


@dataclass
class PrecisionSection:
    dtype: str = "fp32"
    grad_reduce_dtype: str = "fp32"  # dtype of gradient reductions: fp32 | bf16 (half traffic)
    loss_scale: float = 65536.0  # fp16: initial dynamic loss scale
    loss_scale_window: int = 1000  # fp16: steps without overflow before the scale doubles


@dataclass
class ProfileSection:
    # optimizer steps to record with torch.profiler, "3-5" or "4"; "" -> no profiling
    steps: str = ""


@dataclass
class DistributedSection:
    # seconds a collective may wait for its peers before the job stops with a diagnosis (after
    # the first step); start-up and the first step get init_timeout_s (data, compilation)
    timeout_s: float = 600.0
    init_timeout_s: float = 1800.0
    flight_records: int = 256  # collectives each rank's flight recorder keeps (run.dir/flight)
    # a rank whose own work per step (step time minus time waiting in collectives) exceeds
    # its peers' median by this fraction, straggler_steps steps in a row, is named in the
    # log (train/stragglers.py); 0 -> no detection (the per-rank times are still recorded)
    straggler_threshold: float = 0.2
    straggler_steps: int = 5


@dataclass
class DilocoSection:
    # DiLoCo (Douillard et al. 2023) across parallel.islands > 1 islands; see parallel/diloco.py
    inner_steps: int = 50  # H: optimizer steps each island takes between synchronisations
    outer_lr: float = 0.7  # outer Nesterov SGD on the averaged pseudo-gradient
    outer_momentum: float = 0.9  # 0: plain SGD (outer_lr 1 then averages the islands' weights)
    reduce_dtype: str = "fp32"  # dtype of the cross-island all-reduce: fp32 | bf16 | fp16
    # Streaming DiLoCo (Douillard et al. 2025): the layers split into F fragments that
    # synchronise at staggered steps (each every inner_steps), so peak traffic falls by F
    fragments: int = 1


@dataclass
class CheckpointSection:
    keep: int = 0  # keep the last K complete checkpoints; 0 -> keep all


RESUME_MODES = ("false", "true", "auto")


@dataclass
class RunSection:
    dir: str = ""  # "" -> runs/<preset>-<timestamp>
    # "true": continue from the latest checkpoint in run.dir (there must be one); "auto": the
    # same when there is one, else start fresh; "false": a new run (run.dir must be empty)
    resume: str = "false"
    sample_tokens: int = 120  # tokens sampled at the end of training (0: none)
    sample_prompt: str = "def "
    tensorboard: bool = False
    # CPU memory (glibc): 0 -> malloc's own policy (fast); N -> every buffer above N KiB is
    # mmapped and returned to the OS when freed, so peak RSS measures live memory and stays
    # flat step after step, at the cost of page faults (small CPU runs: ~1.6x slower steps)
    malloc_mmap_kb: int = 0
    # CPU memory (glibc): true -> freed buffers stay in the process (no mmap below 1 GiB, no
    # trim), so a step reuses last step's pages instead of faulting in fresh ones: eager CPU
    # steps ~10 % faster, compiled ones about the same; peak RSS then counts freed memory too
    malloc_keep: bool = False


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run: RunSection = field(default_factory=RunSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    diloco: DilocoSection = field(default_factory=DilocoSection)

    # train.micro_batch was left at 0: it follows the layout (resolve_world recomputes it)
    micro_batch_auto: ClassVar[bool] = False

    # -------------------------------------------------------------- derived views
    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The model shape: the preset (or ``model.init_from``'s Hugging Face ``config.json``)
        with every override applied."""
        base = self._hf_base() or get_preset(self.model.preset)
        changes = {
            f.name: getattr(self.model, f.name)
            for f in fields(self.model)
            if f.name not in _NOT_SHAPE and getattr(self.model, f.name) is not None
        }
        if vocab_size is not None:
            changes["vocab_size"] = vocab_size
        try:
            return base.with_(**changes)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _hf_base(self) -> ModelConfig | None:
        """The shape of the Hugging Face folder ``model.init_from`` names (None: not one)."""
        if not self.model.init_from:
            return None
        folder = Path(self.model.init_from).expanduser()
        if not (folder / "config.json").is_file():
            return None
        from .models.hf_config import model_config_from_hf

        try:
            return model_config_from_hf(folder)
        except (ValueError, OSError) as e:
            raise ConfigError(f"model.init_from={self.model.init_from!r}: {e}") from None

    def layout(self) -> Layout:
        """The parallel layout: the ``[parallel]`` keys and ``train.micro_batch`` (dp left at 0,
        to be inferred from a world, reads as 1)."""
        values = {k: getattr(self.parallel, k) for k in PARALLEL_KEYS}
        return Layout(**{**values, "dp": max(1, self.parallel.dp)},
                      micro_batch=self.train.micro_batch, recompute=self.train.recompute)

    def set_layout(self, layout: Layout) -> None:
        """Write ``layout`` into the ``[parallel]`` keys and ``train.micro_batch``."""
        if layout.tp_overlap:
            raise ConfigError(f"layout {layout.describe()}: tp overlap is not a config key")
        for key in PARALLEL_KEYS:
            setattr(self.parallel, key, getattr(layout, key))
        self.train.micro_batch = layout.micro_batch
        self.micro_batch_auto = False
        self.train.recompute = layout.recompute

    @property
    def world_size(self) -> int:
        return self.layout().world_size

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.layout().micro_batches(self.train.global_batch)


SECTIONS = {f.name: f for f in fields(Config)}
DTYPES = ("fp32", "bf16", "fp16")
REDUCE_DTYPES = ("fp32", "bf16")
ISLAND_DTYPES = ("fp32", "bf16", "fp16")
LOSSES = ("torch", "chunked")
NONFINITE = ("stop", "skip", "rollback")
OPTIMIZERS = ("adamw", "sgd")
ADAMW_IMPLS = ("auto", "fused", "foreach")
OFFLOADS = ("none", "cpu", "disk")


# ------------------------------------------------------------------ parsing values
def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation such as ``int | None``."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


# Largest integer a key takes (int64): beyond it torch, numpy and the RNGs overflow.
_INT_MAX = 2**63 - 1


def _convert(key: str, value: Any, tp: Any) -> Any:
    """``value`` as the field type ``tp`` (a string is parsed); ConfigError naming ``key``."""
    out = _parse(key, value, tp)
    if isinstance(out, float) and not math.isfinite(out):
        raise ConfigError(f"{key}={value!r}: expected a finite number")
    if isinstance(out, int) and not isinstance(out, bool) and abs(out) > _INT_MAX:
        raise ConfigError(f"{key}={value!r}: out of range (at most {_INT_MAX} in magnitude)")
    return out


def _parse(key: str, value: Any, tp: Any) -> Any:
    base, optional = _base_type(tp)
    if value is None and optional:
        return None
    if isinstance(value, str) and base is not str:
        text = value.strip()
        if optional and text.lower() in ("none", ""):
            return None
        if base is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"{key}={value!r}: expected true or false")
        try:
            number = float(text)
        except ValueError:
            number = float("nan")
        if base is float and number == number:
            if not math.isfinite(number):
                raise ConfigError(f"{key}={value!r}: expected a finite number")
            return number
        if base is int and number == number and number.is_integer():
            return int(text) if text.lstrip("+-").isdigit() else int(number)
        kind = {int: "an integer", float: "a number"}[base]
        raise ConfigError(f"{key}={value!r}: expected {kind}")
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected true or false")
        return value
    if base is int:
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        ):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return int(value)
    if base is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if base is str and not isinstance(value, str):
        raise ConfigError(f"{key}={value!r}: expected a string")
    return value


def resume_mode(value: Any, key: str = "run.resume") -> str:
    """``run.resume`` as one of :data:`RESUME_MODES`; booleans and their spellings are read as
    ``"true"``/``"false"``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).strip().lower() if isinstance(value, str | int) else ""
    if text in ("true", "1", "yes", "on"):
        return "true"
    if text in ("false", "0", "no", "off"):
        return "false"
    if text == "auto":
        return "auto"
    raise ConfigError(f"{key}={value!r}: expected one of {', '.join(RESUME_MODES)} "
                      "(or a boolean)")


# Keys whose values are read by their own function instead of by the field's type.
_READERS = {"run.resume": resume_mode}


def _set(cfg: Config, dotted: str, value: Any) -> None:
    section_name, _, key = dotted.partition(".")
    if section_name not in SECTIONS or not key:
        raise ConfigError(
            f"unknown config key {dotted!r} (sections: {', '.join(SECTIONS)}; "
            "keys are written section.key)"
        )
    section = getattr(cfg, section_name)
    by_name = {f.name: f for f in fields(section)}
    if key not in by_name:
        raise ConfigError(
            f"unknown config key {dotted!r} (valid keys in [{section_name}]: "
            f"{', '.join(by_name)})"
        )
    if dotted in _READERS:
        setattr(section, key, _READERS[dotted](value, dotted))
        return
    hints = typing.get_type_hints(type(section))
    setattr(section, key, _convert(dotted, value, hints[key]))


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    check_paths: bool = True,
) -> Config:
    """Read a TOML file (optional), apply ``section.key=value`` overrides, validate.

    ``check_paths=False`` skips the existence checks of data files (reading a saved config).
    """
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte "
                              f"0x{e.object[e.start]:02x} at offset {e.start})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: "
                              f"{' '.join(str(e).split())}") from None
        for section_name, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"config file {str(p)!r}: top-level key {section_name!r} must be a "
                    f"[section] (sections: {', '.join(SECTIONS)})"
                )
            for key, value in table.items():
                _set(cfg, f"{section_name}.{key}", value)
    for item in overrides or []:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        key, _, value = text.partition("=")
        _set(cfg, key.strip(), value)
    validate(cfg, check_paths=check_paths)
    return cfg


# ------------------------------------------------------------------ validation
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(cfg: Config, check_paths: bool = True) -> None:
    """Every rule that can be checked without reading data; raises ConfigError."""
    t, p, d = cfg.train, cfg.parallel, cfg.data
    _check(cfg.model.preset in PRESETS,
           f"model.preset={cfg.model.preset!r} is not a preset (valid: {', '.join(PRESETS)})")
    if cfg.model.init_from and check_paths:
        _check(Path(cfg.model.init_from).expanduser().exists(),
               f"model.init_from={cfg.model.init_from!r} does not exist")
    mc = cfg.model_config()
    for key in ("steps", "global_batch"):
        _check(getattr(t, key) > 0, f"train.{key}={getattr(t, key)} must be positive")
    _check(t.micro_batch >= 0, f"train.micro_batch={t.micro_batch} must be positive (or 0: "
           "global_batch / parallel.dp)")
    _check(p.dp >= 0, f"parallel.dp={p.dp} must be >= 1 (or 0: inferred from the world size)")
    _check(p.islands >= 1, f"parallel.islands={p.islands} must be >= 1")
    if t.micro_batch == 0 or cfg.micro_batch_auto:
        auto_micro_batch(cfg, max(1, p.dp))
    _check(t.on_nonfinite in NONFINITE,
           f"train.on_nonfinite={t.on_nonfinite!r} is not one of {', '.join(NONFINITE)}")
    _check(t.max_skips >= 1, f"train.max_skips={t.max_skips} must be >= 1")
    _check(cfg.run.malloc_mmap_kb >= 0,
           f"run.malloc_mmap_kb={cfg.run.malloc_mmap_kb} must be >= 0 (0: malloc's own policy)")
    _check(not (cfg.run.malloc_keep and cfg.run.malloc_mmap_kb),
           f"run.malloc_keep=true and run.malloc_mmap_kb={cfg.run.malloc_mmap_kb} contradict "
           "each other (keep freed memory vs return it): set one")
    skip_batches(t.skip_batches)  # (raises ConfigError)
    if t.compile:
        import torch

        from .toolchain import CompileError, check_compiler

        try:
            check_compiler("cuda" if torch.cuda.is_available() else "cpu")
        except CompileError as e:
            raise ConfigError(str(e)) from None
    d_ = cfg.distributed
    for key in ("timeout_s", "init_timeout_s"):
        _check(getattr(d_, key) > 0, f"distributed.{key}={getattr(d_, key)} must be positive")
    _check(d_.flight_records >= 1,
           f"distributed.flight_records={d_.flight_records} must be >= 1")
    _check(d_.straggler_threshold >= 0,
           f"distributed.straggler_threshold={d_.straggler_threshold} must be >= 0 "
           "(0: no straggler detection)")
    _check(d_.straggler_steps >= 1,
           f"distributed.straggler_steps={d_.straggler_steps} must be >= 1")
    _check(t.lr > 0 and 0 <= t.min_lr <= t.lr,
           f"train.lr={t.lr} and train.min_lr={t.min_lr} must satisfy 0 <= min_lr <= lr, lr > 0")
    _check(0 <= t.warmup_steps, f"train.warmup_steps={t.warmup_steps} must be >= 0")
    _check(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1,
           f"train.beta1={t.beta1}, train.beta2={t.beta2} must lie in [0, 1)")
    _check(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0")
    _check(t.eps > 0, f"train.eps={t.eps} must be positive")
    _check(t.optimizer in OPTIMIZERS,
           f"train.optimizer={t.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    _check(t.adamw_impl in ADAMW_IMPLS,
           f"train.adamw_impl={t.adamw_impl!r} is not one of {', '.join(ADAMW_IMPLS)}")
    _check(t.optimizer == "adamw" or p.offload == "none",
           f"parallel.offload={p.offload} offloads AdamW moments: it needs train.optimizer=adamw")
    _check(t.seed >= 0, f"train.seed={t.seed} must be >= 0")
    _check(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay} must be >= 0")
    _check(t.peak_flops >= 0,
           f"train.peak_flops={t.peak_flops} must be >= 0 (0: measured or datasheet)")
    _check(t.eval_batch_size >= 1, f"train.eval_batch_size={t.eval_batch_size} must be >= 1")
    for key in ("eval_every", "eval_batches", "log_every", "checkpoint_every"):
        _check(getattr(t, key) >= 0, f"train.{key}={getattr(t, key)} must be >= 0")
    _check(t.log_every >= 1, f"train.log_every={t.log_every} must be >= 1")
    _check(d.seq_len >= 2, f"data.seq_len={d.seq_len} must be >= 2")
    _check(d.seq_len <= mc.max_seq_len,
           f"data.seq_len={d.seq_len} exceeds model.max_seq_len={mc.max_seq_len}")
    _check(d.vocab_size >= 260,
           f"data.vocab_size={d.vocab_size} must be >= 260 (256 bytes + special tokens)")
    _check(d.vocab_size <= 2**32 - 1, f"data.vocab_size={d.vocab_size} is too large")
    _check(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must lie in (0, 1)")
    if d.path and check_paths:
        _check(Path(d.path).expanduser().exists(), f"data.path={d.path!r} does not exist")
    if d.tokenizer and check_paths:
        _check(Path(d.tokenizer).expanduser().is_file(),
               f"data.tokenizer={d.tokenizer!r} is not a file")
    _check(cfg.precision.dtype in DTYPES,
           f"precision.dtype={cfg.precision.dtype!r} is not one of {', '.join(DTYPES)}")
    pr = cfg.precision
    _check(pr.grad_reduce_dtype in REDUCE_DTYPES,
           f"precision.grad_reduce_dtype={pr.grad_reduce_dtype!r} is not one of "
           f"{', '.join(REDUCE_DTYPES)}")
    _check(pr.loss_scale > 0, f"precision.loss_scale={pr.loss_scale} must be positive")
    _check(pr.loss_scale_window >= 1,
           f"precision.loss_scale_window={pr.loss_scale_window} must be >= 1")
    _check(t.loss in LOSSES, f"train.loss={t.loss!r} is not one of {', '.join(LOSSES)}")
    _check(t.loss_chunk >= 1, f"train.loss_chunk={t.loss_chunk} must be >= 1")
    _check(p.offload in OFFLOADS,
           f"parallel.offload={p.offload!r} is not one of {', '.join(OFFLOADS)}")
    if p.offload == "disk" and p.offload_dir and check_paths:
        problem = _unwritable_dir(Path(p.offload_dir).expanduser())
        _check(problem is None, f"parallel.offload_dir={p.offload_dir!r}: {problem}")
    profile_steps(cfg.profile.steps)  # (raises ConfigError)
    validate_diloco(cfg, mc.n_layers)
    problems = training_problems(cfg, cfg.layout(), mc)
    _check(not problems, problems[0] if problems else "")
    _check(p.bucket_mb > 0, f"parallel.bucket_mb={p.bucket_mb} must be positive")
    _check(t.eval_every == 0 or t.eval_batches >= 1,
           f"train.eval_batches={t.eval_batches} must be >= 1 when train.eval_every > 0")
    _check(cfg.run.sample_tokens == 0 or bool(cfg.run.sample_prompt),
           "run.sample_prompt must not be empty when run.sample_tokens > 0")
    _check(cfg.checkpoint.keep >= 0,
           f"checkpoint.keep={cfg.checkpoint.keep} must be >= 0 (0 keeps every checkpoint)")
    cfg.run.resume = resume_mode(cfg.run.resume)  # also when set in code, e.g. to True
    if cfg.run.resume != "false":
        _check(bool(cfg.run.dir),
               f"run.resume={cfg.run.resume} needs run.dir naming the run to continue")
    if cfg.run.tensorboard:
        _check(importlib.util.find_spec("tensorboard") is not None,
               "run.tensorboard=true needs the tensorboard package (pip install tensorboard)")
    _check(cfg.run.sample_tokens >= 0, f"run.sample_tokens={cfg.run.sample_tokens} must be >= 0")


def validate_diloco(cfg: Config, n_layers: int) -> None:
    """The ``[diloco]`` keys, and what islands cannot be combined with."""
    g, p = cfg.diloco, cfg.parallel
    _check(g.inner_steps >= 1, f"diloco.inner_steps={g.inner_steps} must be >= 1")
    _check(math.isfinite(g.outer_lr) and g.outer_lr > 0,
           f"diloco.outer_lr={g.outer_lr} must be positive")
    _check(0 <= g.outer_momentum < 1,
           f"diloco.outer_momentum={g.outer_momentum} must lie in [0, 1)")
    _check(g.reduce_dtype in ISLAND_DTYPES,
           f"diloco.reduce_dtype={g.reduce_dtype!r} is not one of {', '.join(ISLAND_DTYPES)}")
    _check(1 <= g.fragments <= n_layers,
           f"diloco.fragments={g.fragments} must lie in [1, model.n_layers={n_layers}] "
           "(fragments are groups of whole layers)")
    _check(g.inner_steps % g.fragments == 0,
           f"diloco.inner_steps={g.inner_steps} is not divisible by diloco.fragments="
           f"{g.fragments} (fragments synchronise every inner_steps / fragments steps in turn)")
    if p.islands > 1:
        _check(cfg.train.on_nonfinite != "rollback",
               "train.on_nonfinite=rollback cannot be used with parallel.islands > 1 (islands "
               "do not agree on a step between synchronisations); use stop or skip")
        _check(not p.auto, "parallel.auto=true cannot be used with parallel.islands > 1 (the "
               "planner picks a layout for one synchronous world); give the inner layout")


def auto_micro_batch(cfg: Config, dp: int) -> None:
    """``train.micro_batch`` = 0 (or left to follow the layout): global_batch / (dp * islands)."""
    t, k = cfg.train, cfg.parallel.islands
    shown = f"parallel.dp * islands = {dp} * {k}" if k > 1 else f"parallel.dp={dp}"
    _check(t.global_batch % (dp * k) == 0,
           f"train.global_batch={t.global_batch} is not divisible by {shown}")
    cfg.micro_batch_auto = True
    t.micro_batch = t.global_batch // (dp * k)


def skip_batches(text: str) -> list[int]:
    """``train.skip_batches`` ("3,7" or "") as a sorted list of batch indices (>= 1)."""
    try:
        out = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        raise ConfigError(f"train.skip_batches={text!r}: expected batch numbers separated by "
                          "commas, e.g. 120,121") from None
    _check(all(b >= 1 for b in out), f"train.skip_batches={text!r}: batches start at 1")
    return out


def _unwritable_dir(path: Path) -> str | None:
    """Why the directory ``path`` cannot be created or written to (None: it can)."""
    if path.exists():
        if not path.is_dir():
            return "exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is not writable"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


def profile_steps(text: str) -> range:
    """The optimizer steps ``profile.steps`` names ("3-5", "4"; "" -> none) as a range."""
    if not text.strip():
        return range(0)
    first, _, last = text.strip().partition("-")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise ConfigError(f"profile.steps={text!r}: expected a step or a range such as "
                          "3-5") from None
    if not 1 <= lo <= hi:
        raise ConfigError(f"profile.steps={text!r}: steps start at 1 and the range must not "
                          "be empty")
    return range(lo, hi + 1)


def training_problems(cfg: Config, layout: Layout, model_cfg: ModelConfig | None = None
                      ) -> list[str]:
    """Why meshlm's trainer cannot run ``layout`` with the rest of ``cfg`` (empty: it can).

    :meth:`Layout.problems` with the trainer's rules, named by config key.
    """
    out = layout.problems(model_cfg or cfg.model_config(), cfg.data.seq_len,
                          cfg.train.global_batch, trainer=True, keys=CONFIG_KEYS)
    return out


def resolve_world(cfg: Config, world_size: int | None) -> Config:
    """Fix ``parallel.dp`` for a given world (None: this process launches the workers).

    Under torchrun or SLURM the world is given: dp is inferred as world / (pp * cp * tp) when
    left at 0, and an explicit dp must fill the world exactly. Only what the world changes is
    checked: its arithmetic and, for an inferred dp, the layout's rules (``load_config``
    validated the rest).
    """
    p = cfg.parallel
    inner = p.islands * p.pp * p.cp * p.tp
    if world_size is None:
        p.dp = p.dp or 1  # Config.layout() read 0 as 1 already: nothing new to check
        return cfg
    isl = (" * islands", f" * {p.islands}") if p.islands > 1 else ("", "")
    _check(world_size % inner == 0,
           f"the world has {world_size} ranks, not divisible by parallel.pp * cp * tp"
           f"{isl[0]} = {p.pp} * {p.cp} * {p.tp}{isl[1]} = {inner}")
    inferred = p.dp == 0
    if inferred:
        p.dp = world_size // inner
        if cfg.micro_batch_auto:
            auto_micro_batch(cfg, p.dp)
    _check(p.dp * inner == world_size,
           f"parallel.dp={p.dp} does not fit the world: pp * dp * cp * tp{isl[0]} = "
           f"{p.dp * inner}, but the world has {world_size} ranks "
           "(leave parallel.dp unset to infer it)")
    if inferred:
        problems = training_problems(cfg, cfg.layout())
        _check(not problems, problems[0] if problems else "")
    return cfg


# ------------------------------------------------------------------ saving
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{s}"'


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (fields left at None are omitted)."""
    lines: list[str] = []
    for name in SECTIONS:
        section = getattr(cfg, name)
        lines.append(f"[{name}]")
        for f in fields(section):
            value = getattr(section, f.name)
            if value is not None:
                lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)

