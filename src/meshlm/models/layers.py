"""The building blocks the attention layers and the decoder share: the RMSNorm, the rotary
rotation, the attention-kernel slot, and the one list of attention layers.

An attention *layer* (the projections around the kernel: grouped-query ``Attention`` in
``models/llama.py``, or a technique's own) is a :class:`KernelSlot` registered by name in
:data:`ATTENTION_LAYERS` (:func:`register_attention_layer`); ``ModelConfig.attention_layer``
names the one every decoder block holds (:func:`build_attention_layer`). A layer whose torch-free
cost is not described in ``attention_cost.PROJECTIONS`` under the same name is refused, as a
kernel is (``models/attention.py``). Techniques' layers register when ``models/llama.py``
imports ``models/attention_layers.py``, their index.

No communication. Memory: a norm's weight (``dim`` values); the slot holds no parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from .attention import build_kernel
from .attention_cost import PROJECTIONS
from .config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` normalised and scaled in fp32, returned in ``x``'s dtype.

    Through torch's ``rms_norm``: one fused kernel each way on CUDA instead of six forward
    kernels (four full passes over fp32 activations) and about ten backward; on CPU torch runs
    the same formula, op for op. Autocast keeps ``rms_norm`` in fp32 (its fp32 list). Casts are
    skipped where the dtype is already right, so an fp32 step dispatches none.
    """
    xf = x if x.dtype == torch.float32 else x.float()
    wf = weight if weight.dtype == torch.float32 else weight.float()
    out = F.rms_norm(xf, (xf.shape[-1],), wf, eps)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 (:func:`rms_norm`)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, nh, S, hd) by position: x*cos + rotate_half(x)*sin, computed in the tables'
    dtype (fp32) and returned in ``x``'s.

    Equivalent to multiplying the complex number x[..., i] + j*x[..., i + hd/2] by
    exp(j * pos * theta^(-2i/hd)) (Su et al. 2021, eq. 34). ``signed_sin`` is the sign-folded
    table of :func:`rope_tables`, so rotate_half(x) = [-x2, x1] becomes the swap [x2, x1].
    """
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos + torch.cat([x2, x1], dim=-1) * signed_sin
    return out if out.dtype == x.dtype else out.to(x.dtype)


class _Callable(nn.Module):
    """A plain function set as the attention core (``Attention.core = fn``)."""

    name = "custom"

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                *doc_ids: torch.Tensor) -> torch.Tensor:
        return self.fn(q, k, v, *doc_ids)


class KernelSlot(nn.Module):
    """An attention layer's core slot: ``kernel``, the registered kernel ``model.attention``
    names (``models/attention.py``) with the model's sliding window, which context
    parallelism, recomputation and compilation wrap (``parallel/extensions.py``). Every
    attention layer (:data:`ATTENTION_LAYERS`) is one: it hands the kernel (B, nh, S, d)
    queries and keys and (B, nkv, S, d_v) values.

    What a layer declares for the techniques applied from outside, so they name no layer:
    ``layer_name`` (its registered name: tensor parallelism's plan for it is registered under
    the same name, ``parallel/tensor_plan.py``) and ``linears`` (the attributes of its matmul
    ``nn.Linear`` s, which a precision's model converter may swap: ``parallel/float8.py``)."""

    layer_name: ClassVar[str] = ""
    linears: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.window = cfg.sliding_window
        self.kernel_name = cfg.attention
        self.kernel: nn.Module = build_kernel(cfg.attention, cfg.sliding_window)

    @property
    def core(self) -> Callable[..., torch.Tensor]:
        """The attention core as a function of (q, k, v): the ``kernel`` module. Setting a
        function makes it the kernel; deleting restores the model's own (``model.attention``)."""
        return self.kernel

    @core.setter
    def core(self, fn: Callable[..., torch.Tensor]) -> None:
        self.kernel = fn if isinstance(fn, nn.Module) else _Callable(fn)

    @core.deleter
    def core(self) -> None:
        self.kernel = build_kernel(self.kernel_name, self.window)


S = TypeVar("S", bound=type[KernelSlot])
# The attention layers by name (``ModelConfig.attention_layer``): name -> class taking the
# model config
ATTENTION_LAYERS: dict[str, type[KernelSlot]] = {}


def register_attention_layer(name: str) -> Callable[[S], S]:
    """Class decorator: register an attention layer under ``name`` (its torch-free cost must
    already be in ``attention_cost.PROJECTIONS``, under the same name)."""

    def add(cls: S) -> S:
        if name not in PROJECTIONS:
            raise ValueError(f"attention layer {name!r} has no cost in attention_cost.PROJECTIONS")
        if name in ATTENTION_LAYERS:
            raise ValueError(f"attention layer {name!r} is registered twice")
        cls.layer_name = name
        ATTENTION_LAYERS[name] = cls
        return cls

    return add


def build_attention_layer(cfg: ModelConfig) -> KernelSlot:
    """The attention layer ``cfg.attention_layer`` names, built for ``cfg``."""
    name = cfg.attention_layer
    if name not in ATTENTION_LAYERS:
        raise ValueError(f"attention layer {name!r} is not one of {', '.join(ATTENTION_LAYERS)}")
    return ATTENTION_LAYERS[name](cfg)
