"""FP8 training of the decoder blocks' linear layers, with scales every layout agrees on.

``precision.dtype=fp8``: every linear layer of a decoder block -- attention q, k, v, o; the
MLP's gate, up and down projections; a MoE layer's shared expert -- becomes a
:class:`Float8Linear` holding the same parameters (names, state dict and shard specs unchanged).
The router, the stacked experts, the embedding and the LM head stay in the autocast dtype
(``precision.fp8_rest``, bf16 by default), as do attention, norms and the loss. Weights,
gradients and optimizer states stay fp32 master copies. The swap is a model converter
(:class:`Float8Converter`, registered as the ``fp8`` precision in ``registry.py``) that
``parallelize`` applies to the plain model before any parallelism: tensor parallelism shards a
float8 linear's weight as it shards a plain linear's, and once the layout is applied each
linear's ``bind_shards`` sets up the scale reductions over the axes that shard it (below).

Each of a linear's three matmuls -- ``y = x W^T``, ``dx = dy W``, ``dW = dy^T x`` -- takes float8
operands, cast dynamically with torchao's float8 training casts and recipes
(``Float8LinearConfig.from_recipe_name``). On CUDA the matmul is ``torch._scaled_mm`` (GPU-only
path: float8 tensor cores, sm89 and later); elsewhere (CPU) torchao's emulation: the same
float8 operands dequantised and multiplied in fp32, the product written in the requested
dtype (``torch._scaled_mm``'s rowwise kernels write bf16 whatever is asked):

- ``tensorwise``: one scale per tensor; e4m3 for ``x`` and ``W``, e5m2 for ``dy``;
- ``rowwise``: one scale per row of each operand along the dimension its matmul reduces over;
  e4m3 everywhere, scales rounded down to a power of two.

Agreement across layouts. A scale is ``max |t|`` over the elements it covers. Where those span
a dimension this rank holds only part of, the local maximum is all-reduced (max) over the axis
that shards it, so every shard casts with the scale the one-process run uses:

- tp, column parallel (output features ``N`` sharded): tensorwise ``W`` and ``dy``; rowwise the
  ``dx`` operands, which reduce over ``N``;
- tp, row parallel (input features ``K`` sharded): tensorwise ``x`` and ``W``; rowwise the
  forward operands, which reduce over ``K``;
- cp (tokens ``M`` sharded): tensorwise ``x`` and ``dy``; rowwise the ``dW`` operands.

Data-parallel, ZeRO, pipeline and expert-parallel ranks hold whole micro-batches and (after
ZeRO-3's gather, which moves the weights in their fp32 storage dtype) whole weights: their
scales are local, and equal those of the one-process micro-batch holding the same samples.

Zero-bubble pipelines: a float8 linear defers its weight gradient when the executor asks it
to (``Float8Linear.defer_weight_grad``, the protocol of ``split_linear.py``); its
``weight_grad`` is the ``dW`` matmul alone (:func:`weight_grad`), which the executor's ``W``
action calls with the captured input and output gradient, and the linear's backward in ``I``
forms only ``dx`` -- eager through the executor's module hooks (which capture), in compiled
blocks as custom ops like ``split_linear.py``'s (:func:`split_linear`: the backward captures).

Communication: per linear and micro-batch, tensorwise, two one-element all-reduces (max) over
tp (``W``, and ``x`` or ``dy``: a scale is computed once per tensor) and two over cp; rowwise,
two vectors of one value per row (``M`` or ``K``/``N`` values) over tp and two over cp -- none
on one process.
Memory: the float8 copies of the operands are transient (one byte per value); saved for
backward, ``x`` and ``W`` as a bf16 linear saves them, and under tensorwise their two
one-element scales.

torchao is an optional dependency (``pip install "meshlm[fp8]"``); :func:`require_torchao`
gives the one-line error when it is missing.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..distributed import traceable
from ..distributed.comm import Comm
from ..distributed.spec import ATTR, spec_of
from ..precision import FP8_RECIPES

RECIPES = FP8_RECIPES
# the linear layers of a decoder block that compute in float8 (paths inside the block): the
# attention layer's matmul linears, which it declares (``KernelSlot.linears``), then these
FP8_LINEARS = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
               "feed_forward.shared.w1", "feed_forward.shared.w2", "feed_forward.shared.w3")
INSTALL_HINT = 'pip install "meshlm[fp8]"'


def require_torchao() -> Any:
    """The ``torchao.float8`` module, or a ValueError saying how to install it."""
    try:
        # torchao logs failed loads of GPU-only extensions at import, and torch a deprecation
        # of how it registers an enum: neither concerns fp8 training
        quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.CRITICAL)
        try:
            import torchao.float8 as f8
        finally:
            for q, level in zip(quiet, levels, strict=True):
                q.setLevel(level)
    except ImportError as exc:
        raise ValueError(f"precision.dtype=fp8 needs torchao, which is not installed "
                         f"({INSTALL_HINT})") from exc
    return f8


def torchao_available() -> bool:
    try:
        require_torchao()
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Fp8Plan:
    """How one linear casts: the recipe's configs and which axes shard which of its dims
    (``M`` tokens, ``K`` input features, ``N`` output features)."""

    recipe: str
    config: Any  # torchao Float8LinearConfig
    mm: Any  # torchao LinearMMConfig: torch._scaled_mm (CUDA)
    mm_emulated: Any  # ... torchao's emulation (other devices: CPU)
    sharded: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (dim, axes)
    key: int = 0  # the Comm's trace key (traceable collectives); 0: no communication
    defer_weight_grad: bool = False  # zero-bubble: dW formed later by weight_grad

    def axes(self, dim: str) -> tuple[str, ...]:
        return next((axes for d, axes in self.sharded if d == dim), ())


def make_plan(recipe: str, sharded: tuple[tuple[str, tuple[str, ...]], ...] = (),
              key: int = 0) -> Fp8Plan:
    f8 = require_torchao()
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    if recipe not in RECIPES:
        raise ValueError(f"precision.fp8_recipe={recipe!r} is not one of {', '.join(RECIPES)}")
    config = f8.Float8LinearConfig.from_recipe_name(recipe)

    def mm_config(emulate: bool) -> Any:
        return LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False,
                                               config.pad_inner_dim)
                                for g in (config.gemm_config_output,
                                          config.gemm_config_grad_input,
                                          config.gemm_config_grad_weight)))

    return Fp8Plan(recipe, config, mm_config(False), mm_config(True), sharded, key)


# operand -> (its dims, the config field of its cast, the dim an axiswise scale covers, role)
_OPERANDS = {
    "x": (("M", "K"), "cast_config_input", -1, "INPUT"),
    "w": (("K", "N"), "cast_config_weight", 0, "WEIGHT"),  # W^T, (K, N)
    "dy": (("M", "N"), "cast_config_grad_output", -1, "GRAD_OUTPUT"),
    "w_dx": (("K", "N"), "cast_config_weight_for_grad_input", -1, "WEIGHT"),
    "dy_dw": (("M", "N"), "cast_config_grad_output_for_grad_weight", 0, "GRAD_OUTPUT"),
    "x_dw": (("M", "K"), "cast_config_input_for_grad_weight", 0, "INPUT"),
}


def scale_of(t: torch.Tensor, operand: str, plan: Fp8Plan) -> torch.Tensor:
    """The float8 scale of ``t`` (2-D) for its role in ``plan``'s recipe, the maximum taken
    over every shard of the dims it covers."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import amax_to_scale

    dims, field, axis, _ = _OPERANDS[operand]
    cc = getattr(plan.config, field)
    if cc.scaling_granularity is ScalingGranularity.AXISWISE:
        amax, covered = t.abs().amax(dim=axis, keepdim=True), (dims[axis],)
    else:
        amax, covered = t.abs().amax(), dims
    amax = amax.float()
    for d in covered:
        for ax in plan.axes(d):
            amax = traceable.all_reduce_max(amax, plan.key, ax)
    return amax_to_scale(amax, cc.target_dtype, plan.config.round_scales_to_power_of_2)


def cast(t: torch.Tensor, operand: str, plan: Fp8Plan, scale: torch.Tensor | None = None
         ) -> torch.Tensor:
    """``t`` (2-D) as a torchao float8 tensor scaled for its role in ``plan``'s recipe
    (``scale``: :func:`scale_of`'s, when already known)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8

    _, field, axis, role = _OPERANDS[operand]
    cc = getattr(plan.config, field)
    axiswise = axis if cc.scaling_granularity is ScalingGranularity.AXISWISE else None
    if scale is None:
        scale = scale_of(t, operand, plan)
    mm = plan.mm if t.is_cuda else plan.mm_emulated
    return hp_tensor_and_scale_to_float8(t, scale, cc.target_dtype, mm, GemmInputRole[role],
                                         axiswise)


def shares_scale(plan: Fp8Plan, a: str, b: str) -> bool:
    """Whether operands ``a`` and ``b`` of the same tensor take one scale: the same cast
    config, tensorwise (a rowwise scale runs along each matmul's own dim)."""
    from torchao.float8.config import ScalingGranularity

    ca, cb = getattr(plan.config, _OPERANDS[a][1]), getattr(plan.config, _OPERANDS[b][1])
    return ca == cb and ca.scaling_granularity is ScalingGranularity.TENSORWISE


def weight_grad(x: torch.Tensor, dy: torch.Tensor, plan: Fp8Plan,
                scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
                ) -> torch.Tensor:
    """``dW = dy^T x`` (N, K) in float8: the linear's third matmul alone (``scales``: those of
    ``dy`` and ``x`` when already known)."""
    x2 = x.reshape(-1, x.shape[-1]).to(dy.dtype)
    dy2 = dy.reshape(-1, dy.shape[-1])
    return torch.mm(cast(dy2, "dy_dw", plan, scales[0]).t(), cast(x2, "x_dw", plan, scales[1]))


class _Float8Matmul(torch.autograd.Function):
    """``x W^T`` with all three matmuls in float8 (module docstring). A tensorwise scale is
    computed once per tensor: ``W``'s and ``x``'s are kept from forward for backward (one
    amax pass and, when sharded, one all-reduce each fewer), ``dy``'s serves both its
    matmuls. (The compiled zero-bubble custom ops below recompute them: an op's backward
    sees only its saved tensors.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, plan: Fp8Plan  # noqa: ANN001
                ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        x8, w8 = cast(x2, "x", plan), cast(weight.t(), "w", plan)
        ctx.save_for_backward(x, weight,
                              x8._scale if shares_scale(plan, "x", "x_dw") else None,
                              w8._scale if shares_scale(plan, "w", "w_dx") else None)
        ctx.plan = plan
        y = torch.mm(x8, w8)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # noqa: ANN001, ANN205
        x, weight, sx, sw = ctx.saved_tensors
        plan: Fp8Plan = ctx.plan
        dy8 = cast(dy.reshape(-1, dy.shape[-1]), "dy", plan)
        sdy = dy8._scale if shares_scale(plan, "dy", "dy_dw") else None
        dx = torch.mm(dy8, cast(weight.t(), "w_dx", plan, sw).t())
        del dy8  # (freed before the dW matmul casts its operands)
        dw = None
        if not plan.defer_weight_grad:
            dw = weight_grad(x, dy, plan, (sdy, sx)).to(weight.dtype)
        return dx.reshape(*dy.shape[:-1], dx.shape[-1]), dw, None


# zero-bubble pipelines with compiled blocks: float8 linears run as custom ops whose backward
# forms only dx and hands (weight, x, dy) to the executor's capture list (split_linear.py);
# a custom op takes no Python object, so the plan travels as a key into this table
_SPLIT_PLANS: dict[int, Fp8Plan] = {}


def _plan_key(plan: Fp8Plan) -> int:
    """``plan``'s key in the table (registered on first use, eagerly: not while tracing)."""
    key = next((k for k, p in _SPLIT_PLANS.items() if p is plan), None)
    if key is None:
        key = len(_SPLIT_PLANS) + 1
        _SPLIT_PLANS[key] = plan
    return key


@torch.library.custom_op("meshlm::split_float8_linear", mutates_args=())
def split_linear(x: torch.Tensor, weight: torch.Tensor, plan: int) -> torch.Tensor:
    """``x W^T`` in float8 (plan ``plan``); backward: the input gradient only."""
    p = _SPLIT_PLANS[plan]
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.mm(cast(x2, "x", p), cast(weight.t(), "w", p))
    return y.reshape(*x.shape[:-1], y.shape[-1])


@split_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, plan: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("meshlm::split_float8_linear_dx", mutates_args=())
def split_linear_dx(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, plan: int
                    ) -> torch.Tensor:
    """``dy W`` in float8; ``(weight, x, dy)`` go to the open capture list."""
    from .split_linear import capture

    capture(weight, x, dy)
    p = _SPLIT_PLANS[plan]
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = torch.mm(cast(dy2, "dy", p), cast(weight.t(), "w_dx", p).t())
    return dx.reshape(*dy.shape[:-1], dx.shape[-1])


@split_linear_dx.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, plan: int) -> torch.Tensor:
    return dy.new_empty((*dy.shape[:-1], weight.shape[1]))


def _split_setup(ctx, inputs: tuple, output: torch.Tensor) -> None:  # noqa: ANN001
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.plan = inputs[2]


def _split_backward(ctx, dy: torch.Tensor) -> tuple:  # noqa: ANN001
    x, weight = ctx.saved_tensors
    return split_linear_dx(dy, x, weight, ctx.plan), None, None


split_linear.register_autograd(_split_backward, setup_context=_split_setup)


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in float8 per ``plan``, holding the same parameters
    as the linear it replaces."""

    def __init__(self, lin: nn.Linear, plan: Fp8Plan) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight
        self.register_parameter("bias", lin.bias)
        self.plan = plan
        self.split_key = 0  # compiled zero-bubble: the custom ops' plan key (dW formed by W)
        self.label = "linear"  # its name in the block (messages)

    def bind_shards(self, comm: Comm, token_axes: tuple[str, ...]) -> None:
        """Reduce the amax of every scale over the axes that shard the dims it covers: the
        weight's shard spec (tp) and ``token_axes`` (cp); see the module docstring."""
        sharded = _sharded_dims(self.weight, token_axes)
        if comm.mesh.device().type == "cuda":  # GPU-only check
            n, k = self.weight.shape
            if n % 16 or k % 16:
                raise ValueError(f"precision.dtype=fp8: {self.label} holds a {n} x {k} weight "
                                 "on this rank; float8 matmuls on GPU need both dims to be "
                                 "multiples of 16")
        self.plan = replace(self.plan, sharded=sharded,
                            key=traceable.key_of(comm) if sharded else 0)

    def defer_weight_grad(self, compiled: bool = False) -> None:
        """Zero-bubble: from now on backward forms only ``dx``; the executor's ``W`` action
        forms ``dW`` with :meth:`weight_grad`. Eager, the executor's hooks capture ``x`` and
        ``dy``; ``compiled``, the linear runs as the custom ops above, whose backward hands
        them to the capture list (``split_linear.py``)."""
        self.plan = replace(self.plan, defer_weight_grad=True)
        self.split_key = _plan_key(self.plan) if compiled else 0

    def weight_grad(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        """``dW = dy^T x`` (N, K) in float8, with the scales one process uses."""
        return weight_grad(x, dy, self.plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        # autocast must not touch the float8 operands inside (it would cast them back up)
        with torch.autocast(kind, enabled=False) if kind in ("cpu", "cuda") \
                else contextlib.nullcontext():
            if self.split_key:
                y = split_linear(x, self.weight, self.split_key)
            else:
                y = _Float8Matmul.apply(x, self.weight, self.plan)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        shards = ", ".join(f"{d} over {'+'.join(a)}" for d, a in self.plan.sharded)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fp8={self.plan.recipe}" + (f", scales reduced: {shards}" if shards else ""))


def plain_linear(lin: nn.Linear) -> nn.Linear:
    """A plain ``nn.Linear`` holding ``lin``'s parameters (``lin`` itself when it is one)."""
    if type(lin) is nn.Linear:
        return lin
    out = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(out)
    out.in_features, out.out_features = lin.in_features, lin.out_features
    out.weight = lin.weight
    out.register_parameter("bias", lin.bias)
    return out


def _block_linears(block: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of each linear of the block's attention layer
    (``attention.linears``) and of ``FP8_LINEARS`` the block has."""
    found = []
    attention = tuple(f"attention.{n}" for n in getattr(block.attention, "linears", ()))
    for path in attention + FP8_LINEARS:
        *parents, leaf = path.split(".")
        parent: nn.Module | None = block
        for name in parents:
            parent = getattr(parent, name, None)
            if parent is None:
                break
        lin = getattr(parent, leaf, None) if parent is not None else None
        if isinstance(lin, nn.Linear):
            found.append((parent, leaf, lin))
    return found


def _sharded_dims(weight: torch.Tensor, token_axes: tuple[str, ...]
                  ) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Which axes shard the tokens (M) and the weight's N (dim 0) and K (dim 1)."""
    by_dim: dict[str, list[str]] = {"M": list(token_axes), "N": [], "K": []}
    for axis, dim in spec_of(weight).shards if hasattr(weight, ATTR) else ():
        by_dim["NK"[dim]].append(axis)
    return tuple((d, tuple(a)) for d, a in by_dim.items() if a)


class Float8Converter:
    """The model converter of ``precision.dtype=fp8`` (registered as ``fp8`` in
    ``registry.py``): every block's attention linears and :data:`FP8_LINEARS` become
    :class:`Float8Linear` s of ``recipe``, before any parallelism is applied. Their scales are
    local until ``bind_shards`` tells each linear the axes that shard it (tp, cp)."""

    def __init__(self, recipe: str) -> None:
        make_plan(recipe)  # (the one-line errors: a bad recipe, torchao missing)
        self.recipe = recipe

    def convert(self, model: nn.Module) -> None:
        for block in model.blocks().values():  # (the extra training heads' too)
            for parent, name, lin in _block_linears(block):
                if isinstance(lin, Float8Linear) and lin.plan.recipe == self.recipe:
                    continue  # already so (its plan may be bound, or told to defer dW)
                f8 = Float8Linear(plain_linear(lin), make_plan(self.recipe))
                f8.label = name
                setattr(parent, name, f8)

    def revert(self, model: nn.Module) -> None:
        for block in model.blocks().values():  # (the extra training heads' too)
            for parent, name, lin in _block_linears(block):
                setattr(parent, name, plain_linear(lin))


def allow_in_compiled_graphs() -> None:
    """Let dynamo put the float8 matmul in a graph as one call (``allow_in_graph``); called
    before anything is compiled, not at import, which would import torch._dynamo everywhere."""
    torch._dynamo.allow_in_graph(_Float8Matmul)


__all__ = ["FP8_LINEARS", "RECIPES", "Float8Converter", "Float8Linear", "Fp8Plan",
           "allow_in_compiled_graphs", "cast", "make_plan", "plain_linear", "require_torchao",
           "scale_of", "shares_scale", "split_linear", "torchao_available", "weight_grad"]
