"""From a planned layout to the ``meshlm train`` arguments that run it.

:func:`train_args` turns what a plan decided -- the :class:`~meshlm.planner.workload.Workload`
(model, sequence length, global batch, precision, loss, kernels, AdamW's kernels) and the
:class:`~meshlm.layout.Layout` (dp, tp, sp, pp with its schedule and virtual stages, cp, ep,
ZeRO and hybrid sharding, micro-batch, recomputation) -- into ``--section.key=value`` words of
``meshlm train``. Every key is a declared config key (``config.py``, ``layout.py``'s
:data:`~meshlm.layout.CONFIG_KEYS`), so ``meshlm train <args> --dry-run`` resolves the same
layout and, on the same accelerator (``--gpu``), the same memory estimate: both read the
planner's memory model (:func:`meshlm.planner.cli.config_workload` builds the same workload
back from the config).

Where the plan's assumptions differ from ``meshlm train``'s defaults, the words set them: the
precision (the plan's bf16 on GPUs; train's default fp32), the model's own vocabulary
(``data.vocab_size``; train's default is a 4,096-entry BPE of its corpus), the sequence length
and the batch. :func:`train_gaps` names what a plan assumed that no config key gives (the
ZeRO paper's 16-bit states, a fused cross-entropy, a GELU MLP, tensor-parallel overlap): with
any, the words run meshlm's nearest run, not the plan's.

Torch-free; no communication; no memory beyond the words.
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import fields
from typing import Any

from ..layout import CONFIG_KEYS, Layout
from ..models.config import ModelConfig
from ..models.presets import PRESETS
from .workload import Workload

# Layout fields always written (the rest only when they differ from the config's default):
# dp, whose config default (0) is "inferred from the world"
_ALWAYS = ("dp",)
# The order the layout's words are written in (others after them): data parallelism, tensor,
# pipeline, context, expert parallelism, then where the optimizer states live
_ORDER = ("micro_batch", "recompute", "dp", "dp_shard", "zero", "tp", "sp", "pp", "pp_schedule",
          "pp_virtual", "pp_layers", "cp", "cp_attention", "ep", "offload", "islands")
# Model fields that are not [model] keys: the name, and the vocabulary (data.vocab_size)
_NOT_MODEL_KEYS = ("name", "vocab_size")


@functools.cache
def declared_keys() -> frozenset[str]:
    """Every ``section.key`` of ``meshlm train`` (what ``meshlm train --keys`` lists)."""
    from ..config import SECTIONS
    from ..schema import section_keys

    return frozenset(f"{name}.{key}" for name, f in SECTIONS.items()
                     for key in section_keys(f.default_factory))  # type: ignore[arg-type]


def _text(value: Any) -> str:
    """A value as ``meshlm train`` reads it from ``--key=value``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _shape_changes(base: ModelConfig, model: ModelConfig) -> dict[str, Any]:
    """The fields of ``model`` that differ from ``base`` (name and vocabulary aside)."""
    return {f.name: getattr(model, f.name) for f in fields(ModelConfig)
            if f.name not in _NOT_MODEL_KEYS and getattr(model, f.name) != getattr(base, f.name)}


def model_items(model: ModelConfig) -> list[tuple[str, Any]]:
    """``model.preset`` (the model's own, else the preset nearest in shape) and every shape
    field that differs from it, then ``data.vocab_size``: the model's vocabulary."""
    name = model.name if model.name in PRESETS else min(
        PRESETS, key=lambda n: len(_shape_changes(PRESETS[n], model)))
    changes = _shape_changes(PRESETS[name], model)
    return [("model.preset", name), *((f"model.{k}", v) for k, v in changes.items()),
            ("data.vocab_size", model.vocab_size)]


def _config_default(key: str) -> Any:
    """The value ``meshlm train`` gives ``section.key`` when it is not set."""
    from ..config import Config

    section, _, name = key.partition(".")
    return getattr(getattr(Config(), section), name)


def meshlm_ep(layout: Layout) -> int:
    """The expert parallelism meshlm runs for ``layout``: its ep, or -- for an expert group
    folded over tp (``Layout.ep_over_tp``) -- the largest group inside dp x cp that divides
    it (meshlm carves ep from dp x cp)."""
    if not layout.ep_over_tp:
        return layout.ep
    ranks = layout.dp * layout.cp
    return max(d for d in range(1, layout.ep + 1) if layout.ep % d == 0 and ranks % d == 0)


def layout_items(layout: Layout) -> list[tuple[str, Any]]:
    """The layout's config keys (:data:`~meshlm.layout.CONFIG_KEYS`): dp always, the others
    where they differ from the config's default (the micro-batch's is 0: derived), and the
    schedule whenever there is a pipeline."""
    out = []
    values = layout.as_dict()
    values["ep"] = meshlm_ep(layout)
    for name in sorted(values, key=lambda n: _ORDER.index(n) if n in _ORDER else len(_ORDER)):
        key, value = CONFIG_KEYS.get(name), values[name]
        if key is None:
            continue  # (tp_overlap, ep_over_tp: not config keys; train_gaps says so)
        if (name in _ALWAYS or value != _config_default(key)
                or (name == "pp_schedule" and layout.pp > 1)):
            out.append((key, value))
    return out


def workload_items(work: Workload, layout: Layout) -> list[tuple[str, Any]]:
    """The run's keys that the plan's workload sets: sequence, global batch and precision
    (always), and the loss, compile and AdamW kernels, fp8's rest and DiLoCo's when not the
    config's defaults."""
    out: list[tuple[str, Any]] = [
        ("data.seq_len", work.seq_len), ("train.global_batch", work.global_batch),
        ("precision.dtype", work.dtype)]
    if work.loss == "chunked":
        out.append(("train.loss", "chunked"))
        if work.loss_chunk != Workload.loss_chunk:
            out.append(("train.loss_chunk", work.loss_chunk))
    if work.kernels == "fused":
        out.append(("train.compile", True))
    if work.optimizer == "foreach":
        out.append(("train.adamw_impl", "foreach"))
    if work.dtype == "fp8" and work.fp8_rest != Workload.fp8_rest:
        out.append(("precision.fp8_rest", work.fp8_rest))
    if layout.islands > 1:
        if work.inner_steps != Workload.inner_steps:
            out.append(("diloco.inner_steps", work.inner_steps))
        if work.island_dtype != Workload.island_dtype:
            out.append(("diloco.reduce_dtype", work.island_dtype))
    return out


# Workload fields train_items maps to config keys (or that meshlm's trainer always has);
# another field away from its default has no config key (train_gaps)
_MAPPED = ("model", "seq_len", "global_batch", "dtype", "loss", "loss_chunk", "kernels",
           "optimizer", "fp8_rest", "inner_steps", "island_dtype", "states")


def train_items(work: Workload, layout: Layout) -> list[tuple[str, Any]]:
    """(``section.key``, value) of every word :func:`train_args` writes, in its order: the
    model, the layout, then the rest of the run."""
    model = model_items(work.model.config)
    lay = layout_items(layout)
    rest = workload_items(work, layout)
    # the micro-batch and recomputation (train.*) after the batch they divide
    return [*model, *rest[:2], *(i for i in lay if i[0].startswith("train.")), *rest[2:],
            *(i for i in lay if not i[0].startswith("train."))]


def train_args(work: Workload, layout: Layout) -> list[str]:
    """``meshlm train`` words (``--section.key=value``) that run ``layout`` on ``work``."""
    return [f"--{key}={_text(value)}" for key, value in train_items(work, layout)]


def train_line(work: Workload, layout: Layout) -> str:
    """``meshlm train ...``: :func:`train_args` as one shell command."""
    return shlex.join(["meshlm", "train", *train_args(work, layout)])


def train_gaps(work: Workload, layout: Layout) -> list[str]:
    """What the plan assumed that :func:`train_args` cannot give meshlm's trainer (empty: the
    words run the plan): a key the config does not have or a value its rule refuses."""
    from ..config import RULES

    out = []
    if work.states != "fp32":
        out.append(f"--states {work.states}: meshlm keeps fp32 weights, gradients and Adam "
                   "moments (16 bytes/parameter)")
    if work.loss not in ("torch", "chunked"):
        out.append(f"--loss {work.loss}: meshlm's cross-entropy is torch or chunked "
                   "(train.loss)")
    if not work.model.gated_mlp:
        out.append(f"model {work.model.name}: a two-matrix GELU MLP; meshlm's block is SwiGLU")
    if layout.tp_overlap:
        out.append("tp_overlap: meshlm does not overlap tensor-parallel collectives with GEMMs")
    if layout.ep_over_tp:
        out.append(f"ep_over_tp: meshlm places the expert group inside dp x cp, not folded over "
                   f"tp: ep={meshlm_ep(layout)} for the plan's {layout.ep}")
    if work.doc_len > 0:
        out.append(f"documents of {work.doc_len:g} tokens: data.doc_mask=true masks the data's "
                   "own documents")
    default = {f.name: f.default for f in fields(Workload)}
    out += [f"workload {name}={getattr(work, name)!r} has no meshlm train key"
            for name in default if name not in (*_MAPPED, "doc_len")
            and getattr(work, name) != default[name]]
    keys = declared_keys()
    for key, value in train_items(work, layout):
        if key not in keys:
            out.append(f"{key} is not a meshlm train key")
        elif key in RULES and (why := RULES[key].problem(key, value)):
            out.append(why)
    return out
