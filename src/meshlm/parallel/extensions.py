"""The one place where a model's run-time choices are applied: attention kernel, activation
recomputation, ``torch.compile`` and the precision (its name; under ``fp8`` the decoder
blocks' linears become float8 linears, ``float8.py``).

Each choice is a name from a registry (``registry.py``). :func:`apply_choices` merges the given
choices into those the model already has and rebuilds every extension point from them, always
in the same order, so applying choices one by one in any order gives the same model:

1. attention kernel: the registered base kernel (``registry.ATTENTION``; a context-parallel one
   needs the ``cp`` helper), then, when compiled, :class:`~.compile.Uncompiled` around a kernel
   that communicates (graph break by design), then :class:`~.recompute.Checkpointed` around it
   when the recompute plan recomputes the kernel (selective; op on a MoE layer);
2. feed-forward: a MoE layer runs eagerly inside a compiled block (``Block.run_ffn``);
3. layer: ``Block.layer`` compiled, then recomputed around the compiled function (full, op)
   (``Block.run_layer``);
4. head: the final norm + head compiled (``Transformer.run_head``).

0. precision: each block's linears float8 (recipe ``fp8_recipe``) under ``fp8``, plain
   linears otherwise; amax reductions over the axes that shard them (``comm``);

The names show in ``print(model)``: each block's repr reads e.g. ``attention=zigzag,
recompute=selective, compiled=True``, the kernel's wrappers are its child modules, and the
model's own repr lists the choices (with ``precision`` when ``parallelize`` was told it).

Applied to the layers this rank holds (after the pipeline split), after tensor parallelism
(whose module hooks then stay outside compiled and recomputed functions). Communication and
memory: those of the choices (see their modules); none added.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from torch import nn

from ..distributed.comm import Comm
from ..models.llama import Block, Transformer
from ..models.moe import MoE
from . import context as _context  # noqa: F401  (registers the context-parallel kernels)
from .compile import Uncompiled, compile_fn, run_ffn
from .float8 import RECIPES, set_block_precision
from .recompute import Checkpointed, Recompute
from .registry import ATTENTION, PRECISION, RECOMPUTE

_WRAPPERS = (Uncompiled, Checkpointed)


@dataclass(frozen=True)
class Choices:
    """Names of a model's run-time choices (each a registry's key; ``precision`` None: not
    told, the trainer's autocast decides)."""

    attention: str = "sdpa"
    recompute: str = "none"
    compiled: bool = False
    precision: str | None = None
    fp8_recipe: str | None = None  # under precision fp8 (default: tensorwise)

    def check(self) -> None:
        ATTENTION[self.attention]
        RECOMPUTE[self.recompute]
        if self.precision is not None:
            PRECISION[self.precision]
        if self.fp8_recipe is not None and self.fp8_recipe not in RECIPES:
            raise ValueError(f"fp8 recipe {self.fp8_recipe!r} is not one of "
                             f"{', '.join(RECIPES)}")

    @property
    def float8(self) -> bool:
        return self.precision is not None and PRECISION[self.precision].float8


def choices_of(model: Transformer) -> Choices:
    """The choices applied to ``model`` so far (the defaults when none)."""
    names = {f.name for f in fields(Choices)}
    return Choices(**{k: v for k, v in model.choices.items() if k in names})


def base_kernel(kernel: nn.Module) -> nn.Module:
    """The registered kernel inside its wrappers."""
    while isinstance(kernel, _WRAPPERS):
        kernel = kernel.inner
    return kernel


def apply_choices(model: Transformer, cp: object | None = None, comm: Comm | None = None,
                  **changes: object) -> Choices:
    """Apply ``changes`` (fields of :class:`Choices`) on top of ``model``'s current choices to
    every layer it holds, in the fixed order of the module docstring; returns the choices.

    ``cp``: the context-parallel helper a context-parallel kernel is built with (needed when the
    attention kernel changes to one; kept from the current kernel otherwise).
    ``comm``: the communicator float8 scales are reduced with over the axes that shard a
    linear (tp) or its tokens (cp); None on one process.
    """
    choices = replace(choices_of(model), **changes)
    if choices.float8 and choices.fp8_recipe is None:
        choices = replace(choices, fp8_recipe=RECIPES[0])
    if not choices.float8:
        choices = replace(choices, fp8_recipe=None)
    choices.check()
    token_axes = ("cp",) if comm is not None and comm.size("cp") > 1 else ()
    for block in model.layers.values():
        assert isinstance(block, Block)
        set_block_precision(block, choices.fp8_recipe, comm, token_axes)
        plan = RECOMPUTE[choices.recompute]
        assert isinstance(plan, Recompute)
        plan = plan.for_layer(isinstance(block.feed_forward, MoE))
        block.attention.kernel = _kernel(block, choices, plan, cp)
        block.run_ffn = run_ffn(block) if choices.compiled else None
        layer = compile_fn(block.layer) if choices.compiled else block.layer
        block.run_layer = plan.run_layer(layer) or (layer if choices.compiled else None)
        block.choices = {"attention": choices.attention, "recompute": plan.name,
                         "compiled": choices.compiled}
    model.run_head = compile_fn(model.final) if choices.compiled else None
    model.choices = {k: v for k, v in asdict(choices).items() if v is not None}
    return choices


def _kernel(block: Block, choices: Choices, plan: Recompute, cp: object | None) -> nn.Module:
    base = base_kernel(block.attention.kernel)
    same = getattr(base, "name", None) == choices.attention and (
        cp is None or getattr(base, "cp", cp) is cp)
    kernel = base if same else ATTENTION[choices.attention](cp)
    if choices.compiled and getattr(kernel, "communicates", False):
        kernel = Uncompiled(kernel)
    if plan.kernel:
        kernel = Checkpointed(kernel)
    return kernel


__all__ = ["Choices", "apply_choices", "base_kernel", "choices_of"]
