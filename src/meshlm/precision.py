"""Mixed precision: autocast compute dtype over fp32 master weights, loss scaling for fp16.

``fp32``: everything in fp32. ``bf16``: matmuls in bf16 under autocast, weights, gradients and
optimizer states in fp32 (bf16 has fp32's exponent range, so no loss scaling). ``fp8``: the
decoder blocks' linear layers in float8 with dynamic scales (``meshlm.parallel.float8``), the
rest as ``precision.fp8_rest`` (bf16, or fp32) under autocast; no loss scaling (the gradient
casts are scaled per tensor or per row). ``fp16``: as bf16
plus dynamic loss scaling (Micikevicius et al. 2018), in every layout: the loss is multiplied by
the scale before backward; after the gradients are reduced, every rank unscales the gradients
(or gradient shards) it holds and checks them for inf/nan in one fused kernel, and the flag is
all-reduced (max) over the whole world -- ZeRO shards, tensor-parallel slices and pipeline
stages each see only part of the gradients, so an overflow anywhere skips the step everywhere.
The flag is a tensor on the rank's device even on a rank that holds no gradients (NCCL reduces
device tensors only).
A skipped step leaves weights and AdamW moments untouched and halves the scale; after
``loss_scale_window`` good steps in a row the scale doubles (Megatron's and torch's rules).
Communication: one 4-byte all-reduce over the world per fp16 step. Memory: none.

:class:`PrecisionPlan` is the ``[precision]`` section resolved once (by the trainer, when it
builds its parts): the compute dtype, the float8 recipe, the gradient-reduction dtype and the
loss-scaling settings. The model part (parallelisation, gradient reduction), the optimizer
part (its :class:`Precision`: autocast and the fp16 scaler) and the recorder (MFU's peak, the
bf16 warning) read it; none of them reads the section's strings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .dtypes import AUTOCAST_NAMES, FP8_RECIPES, FP8_REST, PRECISIONS  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from .config import PrecisionSection

DTYPES = dict(zip(AUTOCAST_NAMES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


def autocast_name(dtype: str, fp8_rest: str = "bf16") -> str:
    """The name of ``precision.dtype``'s autocast compute dtype (under fp8: ``fp8_rest``): the
    dtype of everything but float8 matmuls, and of MFU's peak (as torchtitan counts fp8 runs
    against the 16-bit peak)."""
    return fp8_rest if dtype == "fp8" else dtype


@dataclass(frozen=True)
class PrecisionPlan:
    """How a run computes, resolved once from ``[precision]`` and passed to what needs it.

    ``name``: ``precision.dtype`` (``fp32 | bf16 | fp16 | fp8``), the key of the precision's
    registration (``parallel/registry.py``: its model converter, if any);
    ``compute``: the autocast dtype's name -- of everything under fp32/bf16/fp16, of everything
    but the float8 matmuls under fp8 (``precision.fp8_rest``);
    ``fp8_recipe``: the float8 scaling recipe under fp8, None otherwise;
    ``grad_reduce``: the dtype gradients are reduced in (``precision.grad_reduce_dtype``);
    ``loss_scale``, ``loss_scale_window``: fp16's dynamic loss scaler (initial scale, clean
    steps before it doubles), read only when :attr:`scaled`.
    No communication, no memory.
    """

    name: str = "fp32"
    compute: str = "fp32"
    fp8_recipe: str | None = None
    grad_reduce: str = "fp32"
    loss_scale: float = 65536.0
    loss_scale_window: int = 1000

    @classmethod
    def resolve(cls, dtype: str, fp8_rest: str = "bf16", fp8_recipe: str = FP8_RECIPES[0],
                grad_reduce: str = "fp32", loss_scale: float = 65536.0,
                loss_scale_window: int = 1000) -> PrecisionPlan:
        """The plan of these ``precision.*`` values (each as its config key takes it)."""
        fp8 = dtype == "fp8"
        return cls(dtype, autocast_name(dtype, fp8_rest), fp8_recipe if fp8 else None,
                   grad_reduce, float(loss_scale), loss_scale_window)

    @classmethod
    def from_section(cls, section: PrecisionSection) -> PrecisionPlan:
        """The plan of a validated ``[precision]`` section."""
        return cls.resolve(section.dtype, section.fp8_rest, section.fp8_recipe,
                           section.grad_reduce_dtype, section.loss_scale,
                           section.loss_scale_window)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The autocast compute dtype (also that of pipeline activations on the wire)."""
        return DTYPES[self.compute]

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.grad_reduce]

    @property
    def compute_key(self) -> str:
        """The config key that chose :attr:`compute` (what a message about it names)."""
        return "precision.fp8_rest" if self.name == "fp8" else "precision.dtype"

    @property
    def scaled(self) -> bool:
        """Whether the loss is scaled (fp16's dynamic loss scaling)."""
        return self.name == "fp16"


def rank_device(device_type: str) -> torch.device:
    """This rank's device of ``device_type``: the current CUDA device (set by
    ``launch.init_worker``) or the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())  # GPU-only path
    return torch.device(device_type)


def overflow_flag(grads: list[torch.Tensor], inv_scale: float,
                  device: torch.device) -> torch.Tensor:
    """Divide ``grads`` by the scale in place; a 1-element float flag on ``device``, > 0 when
    any of them holds an inf or nan.

    The flag is always made on ``device``, the rank's: with no gradients (a rank whose
    parameters got none) or gradients elsewhere (host copies), it is still the tensor NCCL
    all-reduces, and NCCL takes only device tensors. Each other device checks its own
    gradients with its own flag (one fused kernel per device), added into ``device``'s.
    """
    found = torch.zeros(1, dtype=torch.float32, device=device)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for where, group in by_device.items():
        flag = found if where == found.device else torch.zeros(1, dtype=torch.float32,
                                                               device=where)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=where)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
        if flag is not found:
            found += flag.to(found.device)
    return found


class LossScaler:
    """Dynamic loss scale: back off on overflow, grow after ``window`` clean steps."""

    def __init__(self, scale: float = 65536.0, window: int = 1000, backoff: float = 0.5,
                 growth: float = 2.0, device: torch.device | None = None) -> None:
        self.scale, self.window, self.backoff, self.growth = float(scale), window, backoff, growth
        self.device = device if device is not None else torch.device("cpu")  # the flag's
        self.good_steps = 0  # clean steps since the last change of the scale
        self.skipped = 0  # steps skipped for overflow, over the whole run

    def unscale_and_check(self, grads: list[torch.Tensor],
                          any_rank: Callable[[torch.Tensor], None]) -> bool:
        """Divide ``grads`` by the scale in place; True when any rank saw an inf or nan
        (``any_rank`` all-reduces the flag, a tensor on :attr:`device`, with max)."""
        found = overflow_flag(grads, 1.0 / self.scale, self.device)
        any_rank(found)
        return bool(found.item() > 0)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state.get("scale", self.scale))
        self.good_steps = int(state.get("good_steps", state.get("_growth_tracker", 0)))
        self.skipped = int(state.get("skipped", 0))


class Precision:
    """Autocast context and, for fp16, the dynamic loss scaler, for one device type: the run
    state of a :class:`PrecisionPlan` (:attr:`plan`)."""

    def __init__(self, dtype: str, device_type: str = "cpu", loss_scale: float = 65536.0,
                 loss_scale_window: int = 1000, device: torch.device | None = None,
                 fp8_rest: str = "bf16") -> None:
        """``device``: where the fp16 overflow flag lives (default: this rank's device of
        ``device_type``, :func:`rank_device`). ``fp8_rest``: the autocast dtype under fp8."""
        self._start(PrecisionPlan.resolve(dtype, fp8_rest, loss_scale=loss_scale,
                                          loss_scale_window=loss_scale_window),
                    device_type, device)

    @classmethod
    def of(cls, plan: PrecisionPlan, device_type: str = "cpu",
           device: torch.device | None = None) -> Precision:
        """The autocast context and loss scaler of ``plan`` (``device``: as for the
        constructor)."""
        self = cls.__new__(cls)
        self._start(plan, device_type, device)
        return self

    def _start(self, plan: PrecisionPlan, device_type: str, device: torch.device | None
               ) -> None:
        self.plan = plan
        self.name = plan.name
        self.dtype = plan.compute_dtype
        self.device_type = device_type
        self.scaler = (LossScaler(plan.loss_scale, plan.loss_scale_window,
                                  device=device or rank_device(device_type))
                       if plan.scaled else None)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype == torch.float32:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def overflow(self, grads: list[torch.Tensor],
                 any_rank: Callable[[torch.Tensor], None]) -> bool:
        """fp16: unscale the gradients, True (and the scale backs off) when the step must be
        skipped; otherwise the scale may grow. No-op (False) without a scaler."""
        if self.scaler is None:
            return False
        overflow = self.scaler.unscale_and_check(grads, any_rank)
        self.scaler.update(overflow)
        return overflow

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
