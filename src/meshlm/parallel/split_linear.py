"""Linear layers whose backward forms only the input gradient: zero-bubble ``I``/``W`` split
inside compiled blocks.

Eager ZB-H1 (``pipeline.py``) splits a linear layer's backward with module hooks: ``I`` runs
autograd for everything but the linear weights, ``W`` forms ``dW = dy^T x`` later. Inside a
compiled block there are no per-module hooks and the output gradients ``dy`` exist only inside
the compiled backward, which would form every weight gradient at once. Here the linear is a
custom op (:func:`linear`) whose registered backward returns the input gradient and no weight
gradient; it calls a second opaque op (:func:`linear_dx`) that computes ``dx = dy W`` and hands
``(weight, x, dy)`` to the capture list the executor opened for the pass (:func:`capture_into`).
``W`` then forms ``dy^T x`` from the list, exactly as eager ZB does. The executor puts a
:class:`SplitLinear` (an ``nn.Linear`` holding the same parameters, printed as such) in place of
each linear of its stages. (The weight is the tensor
the backward was given: the parameter, or, when the block is recomputed, a detached alias of
it; the executor matches it to its parameter by storage.) Dynamo, AOTAutograd and
inductor see two graph nodes of known shape: a block is still one graph (no break), and
``linear_dx`` cannot be dropped (its output is the input gradient).

A module that forms its weight gradient its own way (a float8 linear) says so through
:class:`DefersWeightGrad`: the executor tells it to defer (``defer_weight_grad``) and ``W`` asks
it for ``dW`` (``weight_grad(x, dy)``) instead of forming ``dy^T x`` itself.

The capture list is module state, open only for the duration of one ``I`` pass (backward may
run on another thread than the caller's on accelerators, so it is not thread-local). A
backward through a split linear with no list open is an error: its weight gradient would be
lost.

Communication: none. Memory: ``x`` and ``dy`` of each linear are kept from ``I`` until ``W``,
as eager ZB keeps them. They are copied when captured: inductor may reuse the storage of a
graph's intermediate buffer (``dy``) or donated saved tensor (``x``) once its last known user
(this op) has run, so a reference alone could be overwritten later in the same backward
(measured on torch 2.13 without the copy: the attention output projection's weight gradient
was wrong by 60-90 %). The copy moves ``b s (h_in + h_out)`` values per linear and micro-batch (no FLOPs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

_sink: list | None = None  # the open capture list: [weight, x, dy] records


@runtime_checkable
class DefersWeightGrad(Protocol):
    """A linear layer (``weight`` (N, K)) that forms its own weight gradient on request.

    ``defer_weight_grad(compiled)``: from now on its backward forms only the input gradient
    and its ``(weight, x, dy)`` reach the executor -- through the executor's forward hooks
    when eager, through :func:`capture` from its own backward when ``compiled``;
    ``weight_grad(x, dy)``: its ``dW`` (N, K) from a captured input and output gradient."""

    weight: nn.Parameter

    def defer_weight_grad(self, compiled: bool = False) -> None: ...

    def weight_grad(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor: ...


@contextlib.contextmanager
def capture_into(records: list) -> Iterator[None]:
    """Split linears' backwards inside this block append ``[weight, x, dy]`` to ``records``."""
    global _sink
    saved, _sink = _sink, records
    try:
        yield
    finally:
        _sink = saved


@torch.library.custom_op("meshlm::split_linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x W^T`` with ``W`` cast to ``x``'s dtype; backward: input gradient only."""
    return F.linear(x, weight.to(x.dtype))


@linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def capture(weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
    """Hand ``(weight, x, dy)`` of a split linear's backward to the open capture list."""
    if _sink is None:
        raise RuntimeError("split linear backward with no capture list open: its weight "
                           "gradient would be lost (run it inside capture_into)")
    _sink.append([weight, x.detach().clone(), dy.detach().clone()])  # (see module docstring)


@torch.library.custom_op("meshlm::split_linear_dx", mutates_args=())
def linear_dx(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``dy W`` (the input gradient); ``(weight, x, dy)`` go to the open capture list."""
    capture(weight, x, dy)
    return dy @ weight.to(dy.dtype)


@linear_dx.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return dy.new_empty((*dy.shape[:-1], weight.shape[1]))


def _setup(ctx, inputs: tuple, output: torch.Tensor) -> None:  # noqa: ANN001
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
    x, weight = ctx.saved_tensors
    return linear_dx(dy, x, weight), None


linear.register_autograd(_backward, setup_context=_setup)


def split_forward(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` through :func:`linear`: the same result, backward with no weight gradient."""
    # autocast does not reach into the custom op: cast the input as F.linear would
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    y = linear(x, lin.weight)
    return y if lin.bias is None else y + lin.bias.to(y.dtype)  # (bias: in I)


class SplitLinear(nn.Linear):
    """An ``nn.Linear`` run through :func:`split_forward`, holding the same parameters as the
    linear it replaces (names, state dict and shard specs unchanged)."""

    def __init__(self, lin: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight
        self.register_parameter("bias", lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_forward(self, x)


def split_linears(root: nn.Module, modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Replace every ``nn.Linear`` inside ``modules`` (each a module of ``root``, or itself a
    linear) by a :class:`SplitLinear` of the same parameters, in its parent within ``root``;
    returns their weights."""
    chosen = {id(lin) for mod in modules for lin in mod.modules() if type(lin) is nn.Linear}
    weights = []
    for parent in list(root.modules()):
        for name, lin in list(parent.named_children()):
            if id(lin) in chosen:
                setattr(parent, name, SplitLinear(lin))
                weights.append(lin.weight)
    return weights


__all__ = ["DefersWeightGrad", "SplitLinear", "capture", "capture_into", "linear", "linear_dx", "split_forward",
           "split_linears"]
