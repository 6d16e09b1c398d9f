"""Typed run configuration: TOML file + dotted command-line overrides, validated up front.

A config is a set of dataclass sections (``[model]``, ``[data]``, ``[train]``, ``[parallel]``,
``[precision]``, ``[checkpoint]``, ``[run]``). Each component receives only its own section.
What a key accepts is declared once, on its field (:func:`meshlm.schema.declare`: a
:class:`~meshlm.schema.Choice` or a :class:`~meshlm.schema.Range`; :data:`RULES` lists them);
the layout's named values come from :mod:`meshlm.layout`, the dtypes from
:mod:`meshlm.dtypes`. :func:`load_config` parses every value as its field's type,
:func:`resolve` derives what was left to meshlm (the automatic ``train.micro_batch``), and
:func:`validate` checks every rule -- the declared ones and those relating keys -- without
changing anything, before any worker starts or any file is written; a bad value raises
:class:`ConfigError` with one line naming the key, the value and what would be valid, made
from the declaration. The ``[parallel]`` keys and ``train.micro_batch`` are read as one
:class:`~meshlm.layout.Layout` (:meth:`Config.layout`), checked by the layout's own rules;
:func:`resolve_world` fixes what depends on the world. ``run.resume`` is a mode (``false``,
``true``, ``auto``); booleans are read as the first two, also when set in code.

Nothing writes a config after :func:`validate`: what is derived later (the world's dp, the
automatic layout and micro-batch, the run directory, the resume decision) goes into a new
config (:meth:`Config.derive`, :meth:`Config.with_layout`, :func:`resolve_world`), and the one a
run reads is sealed (:meth:`Config.sealed`: a write raises). That resolved config is written as
``config.toml`` into the run directory.

No communication; reading ``model.init_from``'s ``config.json`` is the only file access besides
the TOML file and the existence checks of paths.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, make_dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from .dtypes import AUTOCAST_NAMES, FP8_RECIPES, FP8_REST, PRECISIONS
from .layout import (
    CONFIG_KEYS,
    CP_MODES,
    OFFLOADS,
    PARALLEL_KEYS,
    RECOMPUTE,
    SCHEDULES,
    ZERO_STAGES,
    Layout,
    micro_batch_problem,
)
from .models.config import ModelConfig
from .models.presets import PRESETS, get_preset
from .schema import Choice, Range, Rule, declare, doc_of, key_of, rules, section_keys

# precision.dtype and diloco.reduce_dtype: the dtypes meshlm computes and reduces in
DTYPES = AUTOCAST_NAMES


class ConfigError(ValueError):
    """A user mistake in the configuration; its message is one line for the terminal."""


_SEALED = "_sealed"  # the instance attribute marking a section (or config) frozen


class Section:
    """Base of the config and its sections: once sealed (:meth:`Config.sealed`: the resolved
    config a run reads), a write raises; what changes is a new config (:meth:`Config.derive`).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get(_SEALED):
            raise AttributeError(f"the resolved config is frozen: {type(self).__name__}.{name} "
                                 "cannot change (derive a new config: Config.derive)")
        object.__setattr__(self, name, value)


def _model_section() -> type:
    """``[model]``: ``preset``, an optional override of every :class:`ModelConfig` field but
    the name and vocabulary (``data.vocab_size`` or the tokenizer's), read from ModelConfig
    itself so that a new shape field is a key with no line here, and where the initial
    weights come from (``init_from``; not a shape field): a Hugging Face folder (config.json
    + safetensors: its shape replaces the preset's) or a meshlm run/checkpoint dir; "" ->
    drawn from train.seed."""
    hints = typing.get_type_hints(ModelConfig)
    shape = [(f.name, hints[f.name] | None,
              declare(None, doc=doc_of(f)))
             for f in fields(ModelConfig) if f.name not in _NOT_KEYS]
    return make_dataclass(
        "ModelSection",
        [("preset", str, declare("small", Choice(tuple(PRESETS), what="preset"),
                                 doc="the model shape: a preset, or the shape of init_from")),
         *shape,
         ("init_from", str, declare("", doc="initial weights: a Hugging Face folder (its "
                                            "config.json sets the shape) or a meshlm "
                                            "checkpoint; \"\": drawn from train.seed"))],
        bases=(Section,), namespace={"__module__": __name__, "__doc__": _model_section.__doc__})


_NOT_KEYS = ("name", "vocab_size")  # ModelConfig fields that are not [model] keys
ModelSection = _model_section()

# ModelSection fields that are not ModelConfig overrides.
_NOT_SHAPE = ("preset", "init_from")


@dataclass
class DataSection(Section):
    path: str = declare(
        "",
        doc="the training data: a folder made by meshlm prepare, text / JSONL / Parquet files or "
            "folders; \"\": the embedded default corpus (this interpreter's standard library)")
    tokenizer: str = declare(
        "",
        doc="a Hugging Face tokenizer.json; \"\": train a byte-level BPE on the corpus (cached)")
    vocab_size: int = declare(
        4096, Range(ge=260, note="256 bytes + special tokens", most=2**32 - 1),
        doc="size of the BPE trained when no tokenizer is given (token ids are stored as uint32)")
    seq_len: int = declare(256, Range(ge=2), doc="tokens per training sequence")
    val_fraction: float = declare(
        0.05, Range(gt=0, lt=1),
        doc="share of files held out for validation")
    text_field: str = declare("text", doc="JSONL field / Parquet column holding the text")
    cache_dir: str = declare("", doc="tokenizer and token cache; \"\": $XDG_CACHE_HOME/meshlm or ~/.cache/meshlm")
    mix: str = declare(
        "",
        doc="prepared datasets (`meshlm prepare`) mixed by weight, \"DIR_A:0.7,DIR_B:0.3\" "
            "(weights are normalised); instead of data.path")
    doc_mask: bool = declare(
        False,
        doc="attention stays inside each document of a packed sequence and RoPE positions restart "
            "at each document (Llama 3's document masking)")


# The layout's defaults, declared once on :class:`Layout` (dp differs: 0 here, inferred).
_LAYOUT: dict[str, Any] = {f.name: f.default for f in fields(Layout)}


@dataclass
class TrainSection(Section):
    steps: int = declare(500, Range(gt=0), doc="optimizer steps")
    global_batch: int = declare(16, Range(gt=0), doc="sequences per optimizer step")
    micro_batch: int = declare(
        0, Range(gt=0, zero="global_batch / parallel.dp"),
        doc="sequences per forward/backward on one data-parallel rank; 0 -> global_batch / dp, "
            "made smaller (a divisor) when the planner says it does not fit the device (meshlm "
            "train)")
    seed: int = declare(1234, Range(ge=0), doc="initial weights and data order")
    optimizer: str = declare(
        "adamw", Choice(("adamw", "sgd")),
        doc="adamw | sgd (SGD with momentum beta1 and L2 weight decay: linear in the gradient, so "
            "e.g. DiLoCo with one inner step and outer lr 1 is exactly synchronous training)")
    adamw_impl: str = declare(
        "auto", Choice(("auto", "fused", "foreach")),
        doc="AdamW's kernels: auto (torch's fused AdamW where it has one for the device: CUDA, "
            "CPU) | fused | foreach (multi-tensor; a temporary as large as the moments); see "
            "optim.py")
    lr: float = declare(3e-3, doc="peak learning rate (lr > 0 and 0 <= min_lr <= lr)")
    min_lr: float = declare(3e-4, doc="learning rate at the end of the cosine decay (0 <= min_lr <= lr)")
    warmup_steps: int = declare(
        50, Range(ge=0),
        doc="linear warmup steps, then cosine decay to min_lr")
    weight_decay: float = declare(
        0.1, Range(ge=0),
        doc="AdamW's decoupled weight decay (matrices only)")
    beta1: float = declare(
        0.9, Range(ge=0, lt=1),
        doc="AdamW's first-moment decay (SGD's momentum)")
    beta2: float = declare(0.95, Range(ge=0, lt=1), doc="AdamW's second-moment decay")
    eps: float = declare(1e-8, Range(gt=0), doc="AdamW's epsilon")
    grad_clip: float = declare(1.0, Range(ge=0), doc="clip the global gradient norm to this (0: no clipping)")
    eval_every: int = declare(100, Range(ge=0), doc="validation loss every N steps (0: no evaluation)")
    eval_batches: int = declare(8, Range(ge=0), doc="batches of the fixed validation set (>= 1 when eval_every > 0)")
    eval_batch_size: int = declare(
        8, Range(ge=1),
        doc="sequences per evaluation batch (independent of the layout)")
    log_every: int = declare(
        10, Range(ge=1),
        doc="progress lines every N steps when not on a terminal")
    checkpoint_every: int = declare(0, Range(ge=0), doc="checkpoint every N steps (0: only at the end)")
    peak_flops: float = declare(
        0.0, Range(ge=0, note="0: measured or datasheet"),
        doc="per-rank peak FLOP/s for MFU; 0 -> measured (CPU) / datasheet (GPU)")
    recompute: str = declare(
        _LAYOUT["recompute"], Choice(RECOMPUTE),
        doc="activation recomputation: none | selective (attention core) | op (every other matmul "
            "output kept) | full (whole decoder layers); see parallel/recompute.py (checked by the"
            " layout)")
    loss: str = declare(
        "torch", Choice(("torch", "chunked")),
        doc="torch (whole logits) | chunked (LM head + loss over token chunks)")
    compile: bool = declare(
        False,
        doc="torch.compile each decoder block, the final norm + head and the loss after "
            "parallelisation (inductor; needs a C++ compiler on CPU); see parallel/compile.py")
    loss_chunk: int = declare(1024, Range(ge=1), doc="tokens per chunk of the chunked loss")
    on_nonfinite: str = declare(
        "stop", Choice(("stop", "skip", "rollback")),
        doc="a non-finite loss or gradient norm: stop (error, nothing saved) | skip (drop the "
            "step) | rollback (reload the last checkpoint, skip the offending batches); see "
            "train/nonfinite.py")
    max_skips: int = declare(
        10, Range(ge=1),
        doc="consecutive skipped / rolled-back steps that end the run")
    skip_batches: str = declare(
        "",
        doc="global batches never trained on, e.g. \"120,121\" (Megatron's --iterations-to-skip): "
            "step k takes the k-th batch not listed; rollback adds the batches it skips")


@dataclass
class ParallelSection(Section):
    # The layout's keys (all but offload_dir, bucket_mb, auto): their defaults and named values
    # come from meshlm.layout; validate checks each against its rule, then Layout.problems
    # how they combine with each other and the model.
    dp: int = declare(
        0, Range(ge=1, zero="inferred from the world size"),
        doc="data-parallel ranks; 0: inferred, world / (pp * cp * tp) under torchrun or SLURM, "
            "else 1")
    tp: int = declare(_LAYOUT["tp"], Range(ge=1), doc="tensor-parallel ranks")
    sp: bool = declare(_LAYOUT["sp"], doc="sequence parallelism on top of tp")
    pp: int = declare(_LAYOUT["pp"], Range(ge=1), doc="pipeline stages (ranks)")
    pp_schedule: str = declare(_LAYOUT["pp_schedule"], Choice(SCHEDULES), doc="pipeline schedule")
    pp_virtual: int = declare(
        _LAYOUT["pp_virtual"], Range(ge=1),
        doc="model chunks per pipeline rank (interleaved, bfs, interleaved-zb: >= 2; zbv, "
            "dualpipev: 2)")
    pp_layers: str = declare(
        _LAYOUT["pp_layers"],
        doc="explicit layers per stage, e.g. \"3,3,2\"; the first and the last may be 0 "
            "(only the embedding / only the head and loss); \"\" -> balanced by count")
    cp: int = declare(_LAYOUT["cp"], Range(ge=1), doc="context-parallel ranks")
    cp_attention: str = declare(
        _LAYOUT["cp_attention"], Choice(CP_MODES),
        doc="context-parallel attention: zigzag | ring | ulysses")
    ep: int = declare(_LAYOUT["ep"], Range(ge=1), doc="expert-parallel ranks (inside dp x cp)")
    zero: int = declare(
        _LAYOUT["zero"], Choice(ZERO_STAGES, spoken=True),
        doc="ZeRO stage: 0 DDP, 1 optimizer states, 2 + gradients, 3 + weights")
    offload: str = declare(
        _LAYOUT["offload"], Choice(OFFLOADS),
        doc="where AdamW moments live: none | cpu (host memory, GPU runs) | disk (memmap)")
    offload_dir: str = declare("", doc="where offload=disk keeps the moments; \"\": <run.dir>/offload")
    bucket_mb: float = declare(25.0, Range(gt=0), doc="gradient bucket size of DDP and ZeRO-1/2")
    auto: bool = declare(
        False,
        doc="let the planner pick the layout of the world (see meshlm plan)")
    islands: int = declare(
        _LAYOUT["islands"], Range(ge=1),
        doc="DiLoCo: islands of the inner layout above, synchronised every diloco.inner_steps "
            "steps (world = islands * pp * dp * cp * tp); 1 = plain synchronous training")
    dp_shard: int = declare(
        _LAYOUT["dp_shard"], Range(ge=1, zero="all of dp"),
        doc="hybrid sharding (HSDP): ZeRO shards over groups of dp_shard dp ranks (within a node),"
            " replicated dp / dp_shard times (across nodes); 0 -> all of dp (plain ZeRO)")


@dataclass
class PrecisionSection(Section):
    dtype: str = declare(
        "fp32", Choice(PRECISIONS),
        doc="compute precision: fp32 | bf16 | fp16 | fp8 (the decoder blocks' linears in float8, "
            "needs torchao: pip install \"meshlm[fp8]\"; the rest in fp8_rest)")
    fp8_recipe: str = declare(
        "tensorwise", Choice(FP8_RECIPES),
        doc="fp8 scaling (torchao's recipes): tensorwise (one scale per tensor) | rowwise (per "
            "row)")
    fp8_rest: str = declare(
        "bf16", Choice(FP8_REST),
        doc="under fp8, the dtype of everything outside the float8 linears: bf16, or fp32 (a "
            "numerics reference; also the fast one on CPUs without native bf16 matmul)")
    grad_reduce_dtype: str = declare(
        "fp32", Choice(tuple(d for d in DTYPES if d != "fp16")),
        doc="dtype of gradient reductions: fp32 | bf16 (half traffic)")
    loss_scale: float = declare(65536.0, Range(gt=0), doc="fp16: initial dynamic loss scale")
    loss_scale_window: int = declare(
        1000, Range(ge=1),
        doc="fp16: steps without overflow before the scale doubles")


@dataclass
class ProfileSection(Section):
    steps: str = declare(
        "",
        doc="optimizer steps to record with torch.profiler, \"3-5\" or \"4\"; \"\" -> no profiling")


@dataclass
class DistributedSection(Section):
    timeout_s: float = declare(
        600.0, Range(gt=0),
        doc="seconds a collective may wait for its peers before the job stops with a diagnosis "
            "(after the first step); start-up and the first step get init_timeout_s (data, "
            "compilation)")
    init_timeout_s: float = declare(
        1800.0, Range(gt=0),
        doc="how long a collective waits at start-up and in the first step")
    flight_records: int = declare(
        256, Range(ge=1),
        doc="collectives each rank's flight recorder keeps (run.dir/flight)")
    straggler_threshold: float = declare(
        0.2, Range(ge=0, note="0: no straggler detection"),
        doc="a rank whose own work per step (step time minus time waiting in collectives) exceeds "
            "its peers' median by this fraction, straggler_steps steps in a row, is named in the "
            "log (train/stragglers.py); 0 -> no detection (the per-rank times are still recorded)")
    straggler_steps: int = declare(
        5, Range(ge=1),
        doc="steps in a row a rank must be slow to be named a straggler")


@dataclass
class DilocoSection(Section):
    inner_steps: int = declare(
        50, Range(ge=1),
        doc="DiLoCo's H (parallel.islands > 1): optimizer steps each island takes between "
            "synchronisations")
    outer_lr: float = declare(
        0.7, Range(gt=0, finite=True),
        doc="DiLoCo's outer Nesterov SGD learning rate on the averaged pseudo-gradient")
    outer_momentum: float = declare(
        0.9, Range(ge=0, lt=1),
        doc="DiLoCo's outer momentum (0: plain SGD; outer_lr 1 then averages the islands' "
            "weights)")
    reduce_dtype: str = declare(
        "fp32", Choice(DTYPES),
        doc="dtype of the cross-island all-reduce (any of precision.dtype's)")
    fragments: int = declare(
        1,
        doc="Streaming DiLoCo (Douillard et al. 2025): the layers split into F fragments that "
            "synchronise at staggered steps (each every inner_steps), so peak traffic falls by F; "
            "1 <= F <= model.n_layers and F divides inner_steps (checked with those keys)")


@dataclass
class CheckpointSection(Section):
    keep: int = declare(
        0, Range(ge=0, note="0 keeps every checkpoint"),
        doc="keep the last K complete checkpoints (0: keep all)")
    async_save: bool = declare(
        False, key="async",
        doc="asynchronous saves: the step loop goes on while a background thread writes the "
            "shards copied to host memory (checkpoint/async_save.py); complete once its index is "
            "written")


RESUME_MODES = ("false", "true", "auto")
MALLOC_CACHE_MB = 64  # run.malloc_cache_mb's default (train/process.py)
RESUME_RULE = Choice(RESUME_MODES, booleans=True)


@dataclass
class RunSection(Section):
    dir: str = declare("", doc="the run directory; \"\": runs/<preset>-<timestamp>")
    resume: str = declare(
        "false", RESUME_RULE,
        doc="\"true\": continue from the latest checkpoint in run.dir (there must be one); "
            "\"auto\": the same when there is one, else start fresh; \"false\": a new run (run.dir"
            " must be empty)")
    sample_tokens: int = declare(
        120, Range(ge=0),
        doc="tokens sampled at the end of training (0: none)")
    sample_prompt: str = declare("def ", doc="prompt of the sample printed at the end of training")
    tensorboard: bool = declare(False, doc="also write TensorBoard scalars")
    malloc_cache_mb: int = declare(
        MALLOC_CACHE_MB, Range(ge=0, le=2047, note="0: malloc's own policy; mallopt takes an int"),
        doc="CPU memory (glibc), the default policy: buffers below 32 MiB come from the heap and "
            "up to N MiB freed at its top stay for reuse (glibc's own dynamic policy held at its "
            "ceiling), so a step reuses the pages its micro-batches freed instead of faulting in "
            "fresh ones; 0 -> glibc's policy as it comes. run.malloc_mmap_kb and run.malloc_keep "
            "replace it")
    malloc_mmap_kb: int = declare(
        0, Range(ge=0, le=2097151, note="0: run.malloc_cache_mb's policy; mallopt takes an int"),
        doc="CPU memory (glibc): 0 -> run.malloc_cache_mb's policy; N -> every buffer above N KiB is"
            " mmapped and returned to the OS when freed, so peak RSS measures live memory and "
            "stays flat step after step, at the cost of page faults (small CPU runs: ~1.6x slower "
            "steps)")
    malloc_keep: bool = declare(
        False,
        doc="CPU memory (glibc): true -> freed buffers stay in the process (no mmap below 1 GiB, "
            "no trim), so a step reuses last step's pages instead of faulting in fresh ones: eager"
            " CPU steps ~10 % faster, compiled ones about the same; peak RSS then counts freed "
            "memory too")

    def __setattr__(self, name: str, value: Any) -> None:
        # run.resume is a mode: a spelling of one set in code (True, "TRUE") is stored as it
        if name == "resume":
            value = _resume_spelling(value) or value
        super().__setattr__(name, value)


@dataclass
class Config(Section):
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
        to be inferred from a world, reads as the smallest dp its rules allow: one shard group,
        ``dp_shard``, else 1; :func:`resolve_world` checks the dp it infers)."""
        values = {k: getattr(self.parallel, k) for k in PARALLEL_KEYS}
        dp = self.parallel.dp or max(1, self.parallel.dp_shard)
        return Layout(**{**values, "dp": dp},
                      micro_batch=self.train.micro_batch, recompute=self.train.recompute)

    def with_layout(self, layout: Layout) -> Config:
        """A copy with ``layout`` in the ``[parallel]`` keys and ``train.micro_batch``."""
        if layout.tp_overlap or layout.ep_over_tp:
            what = "tp overlap" if layout.tp_overlap else "an expert group folded over tp"
            raise ConfigError(f"layout {layout.describe()}: {what} is not a config key")
        out = self.copy()
        for key in PARALLEL_KEYS:
            setattr(out.parallel, key, getattr(layout, key))
        out.train.micro_batch = layout.micro_batch
        out.micro_batch_auto = False
        out.train.recompute = layout.recompute
        return out

    def copy(self) -> Config:
        """A deep copy that can be written (also of a sealed config)."""
        out = copy.deepcopy(self)
        for part in (out, *(getattr(out, name) for name in SECTIONS)):
            part.__dict__.pop(_SEALED, None)
        return out

    def derive(self, values: dict[str, Any]) -> Config:
        """A copy with ``{"section.key": value}`` set (values of the fields' types)."""
        out = self.copy()
        for dotted, value in values.items():
            section, _, key = dotted.partition(".")
            setattr(getattr(out, section), _FIELD[dotted], value)
        return out

    def sealed(self) -> Config:
        """A deep copy no code can write: the resolved config a run reads."""
        out = self.copy()
        for part in (out, *(getattr(out, name) for name in SECTIONS)):
            object.__setattr__(part, _SEALED, True)
        return out

    @property
    def is_sealed(self) -> bool:
        return bool(self.__dict__.get(_SEALED))

    @property
    def world_size(self) -> int:
        return self.layout().world_size

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.layout().micro_batches(self.train.global_batch)


SECTIONS = {f.name: f for f in fields(Config)}
# Every declared rule by dotted key ("train.steps" -> Range(gt=0)): what each key accepts.
RULES: dict[str, Rule] = {
    dotted: rule for name, f in SECTIONS.items()
    for dotted, rule in rules(f.default_factory, name).items()  # type: ignore[arg-type]
}


# The field each declared key is stored in ("checkpoint.async" -> async_save).
_FIELD: dict[str, str] = {
    f"{name}.{key}": field_name for name, f in SECTIONS.items()
    for key, field_name in section_keys(f.default_factory).items()  # type: ignore[arg-type]
}


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


def _resume_spelling(value: Any) -> str | None:
    """The mode of :data:`RESUME_MODES` that ``value`` spells (booleans and their spellings
    read as ``"true"``/``"false"``); None: none."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).strip().lower() if isinstance(value, str | int) else ""
    if text in ("true", "1", "yes", "on"):
        return "true"
    if text in ("false", "0", "no", "off"):
        return "false"
    return text if text in RESUME_MODES else None


def resume_mode(value: Any, key: str = "run.resume") -> str:
    """``run.resume`` as one of :data:`RESUME_MODES`; booleans and their spellings are read as
    ``"true"``/``"false"``."""
    mode = _resume_spelling(value)
    if mode is None:
        raise ConfigError(RESUME_RULE.problem(key, value))
    return mode


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
    by_key = section_keys(section)  # (a key is its field's name unless declared otherwise)
    if key not in by_key:
        raise ConfigError(
            f"unknown config key {dotted!r} (valid keys in [{section_name}]: "
            f"{', '.join(by_key)})"
        )
    name = by_key[key]
    if dotted in _READERS:
        setattr(section, name, _READERS[dotted](value, dotted))
        return
    hints = typing.get_type_hints(type(section))
    setattr(section, name, _convert(dotted, value, hints[name]))


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
    resolve(cfg)
    validate(cfg, check_paths=check_paths)
    return cfg


# ------------------------------------------------------------------ derived values
def resolve(cfg: Config) -> Config:
    """Set the values a config leaves to meshlm, before :func:`validate` checks them.

    ``train.micro_batch`` left at 0 (or following the layout) becomes global_batch / (dp *
    islands) -- under pipeline parallelism the largest divisor of it that gives the pipeline at
    least ``parallel.pp`` micro-batches (:func:`pipeline_micro_batch`). A value that cannot be derived (the division does not come out even) is left
    as it is, for :func:`validate` to name. ``run.resume`` needs nothing here: its spellings
    are read into a mode when set (:class:`RunSection`). The world's values are
    :func:`resolve_world`'s.
    """
    t, dp = cfg.train, max(1, cfg.parallel.dp)
    if (_micro_batch_follows(cfg) and t.global_batch >= 1 and cfg.parallel.islands >= 1
            and _auto_micro_batch_problem(cfg, dp) is None):
        auto_micro_batch(cfg, dp)
    return cfg


def _micro_batch_follows(cfg: Config) -> bool:
    """Whether ``train.micro_batch`` is derived from the layout (left at 0, or derived
    before)."""
    return cfg.train.micro_batch == 0 or cfg.micro_batch_auto


def _auto_micro_batch_problem(cfg: Config, dp: int) -> str | None:
    """Why ``train.micro_batch`` cannot be global_batch / (dp * islands) (None: it can)."""
    t, k = cfg.train, cfg.parallel.islands
    shown = f"parallel.dp * islands = {dp} * {k}" if k > 1 else f"parallel.dp={dp}"
    if t.global_batch % (dp * k):
        return f"train.global_batch={t.global_batch} is not divisible by {shown}"
    return None


def pipeline_micro_batch(per_rank: int, pp: int, schedule: str) -> int:
    """The micro-batch of ``per_rank`` sequences per step on a pipeline of ``pp`` ranks: the
    largest divisor of ``per_rank`` that gives at least ``pp`` micro-batches (and as many as
    the schedule needs: a multiple of pp for the interleaved ones, 2 pp for dualpipev), so every
    stage has work while the first micro-batch goes through; ``per_rank`` without a pipeline;
    1 when there are fewer sequences than stages."""
    if pp <= 1:
        return per_rank
    for micro in range(per_rank, 0, -1):
        m = per_rank // micro
        if per_rank % micro == 0 and m >= pp and micro_batch_problem(schedule, pp, m) is None:
            return micro
    return 1


def auto_micro_batch(cfg: Config, dp: int) -> None:
    """``train.micro_batch`` = 0 (or left to follow the layout): global_batch / (dp * islands),
    made smaller under pipeline parallelism (:func:`pipeline_micro_batch`)."""
    _refuse(_auto_micro_batch_problem(cfg, dp))
    cfg.micro_batch_auto = True
    p = cfg.parallel
    cfg.train.micro_batch = pipeline_micro_batch(cfg.train.global_batch // (dp * p.islands),
                                                 p.pp, p.pp_schedule)


# ------------------------------------------------------------------ validation
def parse_mix(text: str) -> list[tuple[str, float]]:
    """``"DIR_A:0.7,DIR_B:0.3"`` -> [(folder, weight), ...] with the weights normalised to sum
    to 1; ConfigError naming the entry when a weight is not a positive number."""
    out: list[tuple[str, float]] = []
    for entry in (e.strip() for e in text.split(",")):
        folder, sep, weight = entry.rpartition(":")
        try:
            w = float(weight) if sep and folder else float("nan")
        except ValueError:
            w = float("nan")
        if not (math.isfinite(w) and w > 0):
            raise ConfigError(f"data.mix: {entry!r} is not FOLDER:WEIGHT with a positive "
                              "number as the weight (e.g. data.mix=\"web:0.7,code:0.3\")")
        out.append((folder.strip(), w))
    folders = [f for f, _ in out]
    dup = next((f for f in folders if folders.count(f) > 1), None)
    if dup is not None:
        raise ConfigError(f"data.mix names {dup!r} twice")
    total = sum(w for _, w in out)
    return [(f, w / total) for f, w in out]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _refuse(problem: str | None) -> None:
    """Raise ConfigError with ``problem`` unless it is None."""
    if problem is not None:
        raise ConfigError(problem)


def _resolved_layout(cfg: Config) -> Layout:
    """:meth:`Config.layout` with the micro-batch :func:`resolve` derives (when it does)."""
    layout = cfg.layout()
    if _micro_batch_follows(cfg):
        p = cfg.parallel
        per_rank = cfg.train.global_batch // (layout.dp * p.islands)
        layout = replace(layout, micro_batch=pipeline_micro_batch(per_rank, p.pp, p.pp_schedule))
    return layout


def validate(cfg: Config, check_paths: bool = True) -> None:
    """Every rule that can be checked without reading data; raises ConfigError naming the
    first broken one, and changes nothing in ``cfg``.

    First every key against the rule declared on its field (:data:`RULES`, in declaration
    order: no key is listed here), then the rules that relate keys, files and packages. A
    micro-batch left to :func:`resolve` is checked as resolve derives it, so the result is the
    same before and after resolve.
    """
    t, p, d = cfg.train, cfg.parallel, cfg.data
    for dotted, rule in RULES.items():
        section, _, key = dotted.partition(".")
        _refuse(rule.problem(dotted, getattr(getattr(cfg, section), _FIELD[dotted])))
    if cfg.model.init_from and check_paths:
        _check(Path(cfg.model.init_from).expanduser().exists(),
               f"model.init_from={cfg.model.init_from!r} does not exist")
    mc = cfg.model_config()
    if _micro_batch_follows(cfg):
        _refuse(_auto_micro_batch_problem(cfg, max(1, p.dp)))
    _check(not (cfg.run.malloc_keep and cfg.run.malloc_mmap_kb),
           f"run.malloc_keep=true and run.malloc_mmap_kb={cfg.run.malloc_mmap_kb} contradict "
           "each other (keep freed memory vs return it): set one")
    _check(cfg.run.malloc_cache_mb in (0, MALLOC_CACHE_MB)
           or not (cfg.run.malloc_keep or cfg.run.malloc_mmap_kb),
           f"run.malloc_cache_mb={cfg.run.malloc_cache_mb} and "
           f"{'run.malloc_keep=true' if cfg.run.malloc_keep else 'run.malloc_mmap_kb'} "
           "contradict each other (each sets the malloc policy): set one")
    skip_batches(t.skip_batches)  # (raises ConfigError)
    if t.compile:
        import torch

        from .toolchain import CompileError, check_compiler

        try:
            check_compiler("cuda" if torch.cuda.is_available() else "cpu")
        except CompileError as e:
            raise ConfigError(str(e)) from None
    _check(t.lr > 0 and 0 <= t.min_lr <= t.lr,
           f"train.lr={t.lr} and train.min_lr={t.min_lr} must satisfy 0 <= min_lr <= lr, lr > 0")
    _check(t.optimizer == "adamw" or p.offload == "none",
           f"parallel.offload={p.offload} offloads AdamW moments: it needs train.optimizer=adamw")
    _check(d.seq_len <= mc.max_seq_len,
           f"data.seq_len={d.seq_len} exceeds model.max_seq_len={mc.max_seq_len}")
    for problem in mc.run_problems(d.seq_len):
        _check(False, problem)
    if d.path and check_paths:
        _check(Path(d.path).expanduser().exists(), f"data.path={d.path!r} does not exist")
    if d.tokenizer and check_paths:
        _check(Path(d.tokenizer).expanduser().is_file(),
               f"data.tokenizer={d.tokenizer!r} is not a file")
    if d.mix:
        _check(not d.path, f"data.mix={d.mix!r} and data.path={d.path!r} both name the data: "
                           "set one")
        for folder, _ in parse_mix(d.mix):
            _check(not check_paths or Path(folder).expanduser().is_dir(),
                   f"data.mix: {folder!r} is not a folder (a dataset made by meshlm prepare)")
    if cfg.precision.dtype == "fp8":
        _check(importlib.util.find_spec("torchao") is not None,
               'precision.dtype=fp8 needs torchao, which is not installed '
               '(pip install "meshlm[fp8]")')
    if p.offload == "disk" and p.offload_dir and check_paths:
        problem = _unwritable_dir(Path(p.offload_dir).expanduser())
        _check(problem is None, f"parallel.offload_dir={p.offload_dir!r}: {problem}")
    profile_steps(cfg.profile.steps)  # (raises ConfigError)
    validate_diloco(cfg, mc.n_layers)
    problems = training_problems(cfg, _resolved_layout(cfg), mc)
    _check(not problems, problems[0] if problems else "")
    _check(t.eval_every == 0 or t.eval_batches >= 1,
           f"train.eval_batches={t.eval_batches} must be >= 1 when train.eval_every > 0")
    _check(cfg.run.sample_tokens == 0 or bool(cfg.run.sample_prompt),
           "run.sample_prompt must not be empty when run.sample_tokens > 0")
    resume = resume_mode(cfg.run.resume)  # (raises ConfigError)
    if resume != "false":
        _check(bool(cfg.run.dir), f"run.resume={resume} needs run.dir naming the run to continue")
    if cfg.run.tensorboard:
        _check(importlib.util.find_spec("tensorboard") is not None,
               "run.tensorboard=true needs the tensorboard package (pip install tensorboard)")


def validate_diloco(cfg: Config, n_layers: int) -> None:
    """What the ``[diloco]`` keys and islands cannot be combined with (their own rules are
    declared)."""
    g, p = cfg.diloco, cfg.parallel
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
    """A copy of ``cfg`` with ``parallel.dp`` fixed for a given world (None: this process
    launches the workers); ``cfg`` itself is left as it is.

    Under torchrun or SLURM the world is given: dp is inferred as world / (pp * cp * tp) when
    left at 0, and an explicit dp must fill the world exactly. Only what the world changes is
    checked: its arithmetic and, for an inferred dp, the layout's rules (``load_config``
    validated the rest).
    """
    cfg = cfg.copy()
    p = cfg.parallel
    inner = p.islands * p.pp * p.cp * p.tp
    if world_size is None:
        inferred, p.dp = p.dp == 0, p.dp or 1
        if inferred and p.dp_shard > 1:  # Config.layout() read dp as dp_shard: check dp = 1
            problems = training_problems(cfg, cfg.layout())
            _check(not problems, problems[0] if problems else "")
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


# ------------------------------------------------------------------ reference
def key_reference() -> list[tuple[str, str, str, str]]:
    """Every key as declared: (``section.key``, its default, what it accepts, its one-line
    doc), in declaration order -- what ``meshlm train --keys`` prints."""
    out = []
    for name, section in SECTIONS.items():
        hints = typing.get_type_hints(section.default_factory)  # type: ignore[arg-type]
        for f in fields(section.default_factory):  # type: ignore[arg-type]
            dotted = f"{name}.{key_of(f)}"
            rule = RULES.get(dotted)
            base, optional = _base_type(hints[f.name])
            accepts = (rule.listed if isinstance(rule, Choice) else
                       f"{base.__name__} that {rule.requirement}" if isinstance(rule, Range)
                       else base.__name__)
            default = "preset's" if optional and f.default is None else _toml_value(f.default)
            out.append((dotted, default, accepts, doc_of(f)))
    return out


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
                lines.append(f"{key_of(f)} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)

