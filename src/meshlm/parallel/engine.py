"""What the trainer asks of a data-parallel strategy, and the one-process strategy.

An engine owns the gradients' life cycle and the optimizer: it decides when gradients are
communicated during backward (``set_sync``), completes the reductions (``finish_grads``), clips
by the global norm, steps AdamW and clears gradients. It also converts its state to and from
the layout-free checkpoint format -- the plain model's ``state_dict`` names and the AdamW state
dict of a one-process run -- so a checkpoint written by any layout loads into any other.

:class:`LocalEngine` (one data-parallel rank): no communication; memory 4Ψ weights, 4Ψ
gradients, 8Ψ Adam moments (fp32).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import TrainSection
from ..distributed.comm import Comm
from ..distributed.spec import ShardSpec, attach_specs, norm_axes, spec_of
from ..models.weights import check_weights
from ..optim import build_optimizer, canonical_params, set_lr
from ..precision import Precision


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes([v for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0])
               for s in optimizer.state.values())


class Engine:
    """Interface used by the trainer (see module docstring)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def set_sync(self, sync: bool) -> None:
        """Whether the coming backward is the last micro-batch of the step."""

    def begin_step(self) -> None:
        """Before the first micro-batch (ZeRO-3 under a pipeline gathers its parameters)."""

    def end_forward_only(self) -> None:
        """After an evaluation made outside a step (ZeRO-3 under a pipeline frees them)."""

    def finish_grads(self) -> None:
        """Complete every pending gradient reduction; gradients are then the global mean."""

    def clip_grad_norm(self, max_norm: float) -> float:
        raise NotImplementedError

    def step(self, lr: float, precision: Precision | None = None) -> None:
        """AdamW step at learning rate ``lr`` (through the fp16 loss scaler when there is one)."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer states."""
        raise NotImplementedError

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(full weights by name, one-process AdamW state dict) -- on every rank."""
        raise NotImplementedError

    def load_full_state(self, weights: dict[str, torch.Tensor], optim: dict[str, Any]) -> None:
        raise NotImplementedError


def clip_by_global_norm(pairs: list[tuple[ShardSpec, torch.Tensor]], max_norm: float,
                        comm: Comm, axes: tuple[str, ...]) -> float:
    """L2 norm of every gradient (shard) in the world, each element once; scale if above max.

    ``pairs`` are (spec, gradient) with the gradient possibly a shard or a flat piece of the
    parameter's; a copy replicated on an axis counts 1/copies (see ``ShardSpec``), so the
    squared sums need adding only over ``axes`` (:func:`~meshlm.distributed.spec.norm_axes`).
    """
    device = pairs[0][1].device if pairs else comm.mesh.device()
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for spec, g in pairs:
        sq += g.double().pow(2).sum() * spec.norm_weight(comm.mesh)
    for axis in axes:
        comm.all_reduce(sq, axis)
    norm = float(sq.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0 and pairs:
        torch._foreach_mul_([g for _, g in pairs], coef)
    return norm


class LocalEngine(Engine):
    """Every parameter, gradient and optimizer state held in full, no communication."""

    def __init__(self, model: nn.Module, cfg: TrainSection, comm: Comm) -> None:
        self.model, self.comm, self.cfg = model, comm, cfg
        attach_specs(model, comm.mesh)  # (no-op for parameters a technique already placed)
        self.optimizer = build_optimizer(model, cfg)
        self.params = [p for _, p, _ in canonical_params(model)]
        self.norm_axes = norm_axes([spec_of(p) for p in self.params], comm.mesh)
        self._grad_bytes = 0

    def finish_grads(self) -> None:
        # gradients are freed after each step (set_to_none); count them while they exist
        self._grad_bytes = tensor_bytes([p.grad for p in self.params if p.grad is not None])

    def clip_grad_norm(self, max_norm: float) -> float:
        if not self.norm_axes:  # every rank holds whole gradients: torch's own clipping
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        pairs = [(spec_of(p), p.grad) for p in self.params if p.grad is not None]
        return clip_by_global_norm(pairs, max_norm, self.comm, self.norm_axes)

    def step(self, lr: float, precision: Precision | None = None) -> None:
        set_lr(self.optimizer, lr)
        if precision is not None:
            precision.step(self.optimizer)
        else:
            self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict[str, int]:
        return {
            "params": tensor_bytes(self.params),
            "grads": self._grad_bytes,
            "optim": optimizer_state_bytes(self.optimizer),
        }

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        weights = {n: p.detach() for n, p, _ in canonical_params(self.model)}
        return weights, self.optimizer.state_dict()

    def load_full_state(self, weights: dict[str, torch.Tensor], optim: dict[str, Any]) -> None:
        load_weights(self.model, weights)
        self.optimizer.load_state_dict(optim)
        apply_hyperparameters(self.optimizer, self.cfg)


def apply_hyperparameters(optimizer: torch.optim.Optimizer, cfg: TrainSection) -> None:
    """The config's AdamW settings win over a checkpoint's (groups: decayed, not decayed)."""
    for group, decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0), strict=False):
        group.update(weight_decay=decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a model holding full parameters, checking names and shapes."""
    params = {n: p for n, p, _ in canonical_params(model)}
    check_weights({n: tuple(p.shape) for n, p in params.items()}, weights)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])


def adamw_template(model: nn.Module, cfg: TrainSection, lr: float) -> list[dict[str, Any]]:
    """param_groups of the one-process AdamW state dict (hyper-parameters + indices)."""
    groups = build_optimizer(model, cfg).state_dict()["param_groups"]
    for g in groups:
        g["lr"] = lr
    return groups
