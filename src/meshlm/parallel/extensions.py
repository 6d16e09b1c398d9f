"""The one place where a model's run-time choices are applied: attention kernel, activation
recomputation, ``torch.compile`` and the precision (its name, and the model converter it
registers: under ``fp8`` the decoder blocks' linears become float8 linears, ``float8.py``).

Each choice is a name from a registry (``registry.py``). :func:`apply_choices` merges the given
choices into those the model already has and rebuilds every extension point from them, always
in the same order, so applying choices one by one in any order gives the same model:

1. attention kernel: the registered kernel ``attention`` names (``models/attention.py``, with
   the model's sliding window), inside context parallelism's ring / all-to-all when ``context``
   names a cp mode (``context.py``: it needs the ``cp`` helper), then, when compiled,
   :class:`~.compile.Uncompiled` around a kernel that must run eagerly (one that communicates:
   a graph break by design), then :class:`~.recompute.Checkpointed` around it when the
   recompute plan recomputes the kernel (selective; op on a MoE layer);
2. feed-forward: a MoE layer runs eagerly inside a compiled block (``Block.run_ffn``);
3. layer: ``Block.layer`` compiled, then recomputed around the compiled function (full, op)
   (``Block.run_layer``);
4. head: the final norm + head compiled (``Transformer.run_head``).

0. precision: the converter its registration names (``registry.PRECISION``), with the recipe
   ``fp8_recipe``, converts the model -- a no-op when ``parallelize`` already did, before any
   parallelism -- or the previous precision's converter reverts it; then the converted modules
   are bound to the axes that shard them (``comm``, ``registry.bind_shards``);

The names show in ``print(model)``: each block's repr reads e.g. ``attention=sdpa,
context=zigzag, recompute=selective, compiled=True``, the kernel's wrappers are its child modules, and the
model's own repr lists the choices (with ``precision`` when ``parallelize`` was told it).

Applied to the layers this rank holds (after the pipeline split), after tensor parallelism
(whose module hooks then stay outside compiled and recomputed functions). Communication and
memory: those of the choices (see their modules); none added.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from torch import nn

from ..distributed.comm import Comm
from ..dtypes import FP8_RECIPES
from ..models.attention import ATTENTION, build_kernel
from ..models.llama import Block, Transformer
from ..models.moe import MoE
from .compile import Uncompiled, compile_fn, run_ffn
from .context import ContextParallel, ContextParallelAttention, check_mode
from .recompute import Checkpointed, Recompute
from .registry import PRECISION, RECOMPUTE, ModelConverter, bind_shards

_WRAPPERS = (Uncompiled, Checkpointed, ContextParallelAttention)


@dataclass(frozen=True)
class Choices:
    """Names of a model's run-time choices (each a registry's key; ``precision`` None: not
    told, the trainer's autocast decides)."""

    attention: str = "sdpa"
    context: str | None = None  # a cp mode (ring | zigzag | ulysses) around the kernel
    recompute: str = "none"
    compiled: bool = False
    precision: str | None = None
    # the recipe of a precision with a model converter (fp8; default: tensorwise)
    fp8_recipe: str | None = None

    def check(self) -> None:
        ATTENTION[self.attention]
        if self.context is not None:
            check_mode(self.context)
        RECOMPUTE[self.recompute]
        if self.precision is not None:
            PRECISION[self.precision]
        if self.fp8_recipe is not None and self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8 recipe {self.fp8_recipe!r} is not one of "
                             f"{', '.join(FP8_RECIPES)}")

    def converter(self) -> ModelConverter | None:
        """The model converter of the precision (None: the model is left as it is)."""
        if self.precision is None or (make := PRECISION[self.precision].converter) is None:
            return None
        return make(self.fp8_recipe or FP8_RECIPES[0])


def choices_of(model: Transformer) -> Choices:
    """The choices applied to ``model`` so far (the model's own kernel when none)."""
    names = {f.name for f in fields(Choices)}
    given = {k: v for k, v in model.choices.items() if k in names}
    return Choices(**{"attention": model.cfg.attention, **given})


def base_kernel(kernel: nn.Module) -> nn.Module:
    """The registered kernel inside its wrappers."""
    while isinstance(kernel, _WRAPPERS):
        kernel = kernel.inner
    return kernel


def apply_choices(model: Transformer, cp: object | None = None, comm: Comm | None = None,
                  **changes: object) -> Choices:
    """Apply ``changes`` (fields of :class:`Choices`) on top of ``model``'s current choices to
    every layer it holds, in the fixed order of the module docstring; returns the choices.

    ``cp``: the context-parallel helper the ``context`` mode runs on (needed when ``context``
    changes to a mode; kept from the current kernel otherwise).
    ``comm``: the communicator converted modules reduce over the axes that shard them (float8
    scales: a linear's tp shards, its tokens' cp shards); None on one process.
    """
    before = choices_of(model)
    choices = replace(before, **changes)
    converts = choices.precision is not None and PRECISION[choices.precision].converter
    choices = replace(choices, fp8_recipe=(choices.fp8_recipe or FP8_RECIPES[0]) if converts
                      else None)
    choices.check()
    converter = choices.converter()
    if converter is not None:
        converter.convert(model)
        bind_shards(model, comm)
    elif (previous := before.converter()) is not None:
        previous.revert(model)
    for block in model.blocks().values():  # (the extra training heads' blocks too)
        assert isinstance(block, Block)
        plan = RECOMPUTE[choices.recompute]
        assert isinstance(plan, Recompute)
        plan = plan.for_layer(isinstance(block.feed_forward, MoE))
        block.attention.kernel = _kernel(block, choices, plan, cp)
        block.run_ffn = run_ffn(block) if choices.compiled else None
        layer = compile_fn(block.layer) if choices.compiled else block.layer
        block.run_layer = plan.run_layer(layer) or (layer if choices.compiled else None)
        block.choices = {"attention": choices.attention,
                         **({"context": choices.context} if choices.context else {}),
                         "recompute": plan.name, "compiled": choices.compiled}
    model.run_head = compile_fn(model.final) if choices.compiled else None
    model.choices = {k: v for k, v in asdict(choices).items() if v is not None}
    return choices


def _context_of(kernel: nn.Module) -> ContextParallel | None:
    """The context-parallel helper of the kernel's ring / all-to-all (None: none)."""
    while isinstance(kernel, _WRAPPERS):
        if isinstance(kernel, ContextParallelAttention):
            return kernel.cp
        kernel = kernel.inner
    return None


def _kernel(block: Block, choices: Choices, plan: Recompute, cp: object | None) -> nn.Module:
    att = block.attention
    base = base_kernel(att.kernel)
    same = getattr(base, "name", None) == choices.attention
    kernel = base if same else build_kernel(choices.attention, att.window)
    att.kernel_name = choices.attention
    if choices.context is not None:
        cp = cp if cp is not None else _context_of(att.kernel)
        if not isinstance(cp, ContextParallel) or cp.mode != choices.context:
            raise ValueError(f"attention context {choices.context!r} needs context parallelism "
                             f"in mode {choices.context!r} (parallel.cp > 1, "
                             f"parallel.cp_attention={choices.context})")
        kernel = ContextParallelAttention(cp, kernel)
    if choices.compiled and not getattr(kernel, "compilable", True):
        kernel = Uncompiled(kernel)
    if plan.kernel:
        kernel = Checkpointed(kernel)
    return kernel


__all__ = ["Choices", "apply_choices", "base_kernel", "choices_of"]
