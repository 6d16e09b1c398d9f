"""What the trainer asks of a data-parallel strategy, and the one-process strategy.

An engine owns the gradients' life cycle and the optimizer: it decides when gradients are
communicated during backward (``set_sync``), completes the reductions (``finish_grads``), clips
by the global norm, steps AdamW and clears gradients. For checkpoints it lists what it holds
(:meth:`Engine.held`: the weights in memory) and what it owns (:meth:`Engine.owned`: ranges of
parameters whose AdamW moments live here), each as a flat range of a parameter's local tensor
described by its shard spec -- so a checkpoint written by any layout loads into any other.

:class:`LocalEngine` (one data-parallel rank): no communication; memory 4Ψ weights, 4Ψ
gradients, 8Ψ Adam moments (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import TrainSection
from ..distributed.comm import Comm
from ..distributed.spec import ShardSpec, attach_specs, norm_axes, spec_of
from ..optim import (
    STATE_KINDS,
    build_optimizer,
    canonical_params,
    set_lr,
    state_kinds,
    step_tensor,
)


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of AdamW state this process holds in memory: an offloaded optimizer
    (``parallel/offload.py``) reports what is resident -- host bytes for ``cpu``, the mapped
    pages of its file (0 between steps) for ``disk``."""
    if hasattr(optimizer, "resident_bytes"):
        return optimizer.resident_bytes()
    return sum(tensor_bytes([v for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0])
               for s in optimizer.state.values())


@dataclass
class Owned:
    """The flat range ``[lo, hi)`` of one parameter's local tensor whose optimizer state this
    rank holds: ``weight`` is a 1-D view of those weights, ``key`` the tensor AdamW steps for it
    (its state's key in ``optimizer.state``)."""

    spec: ShardSpec
    lo: int
    hi: int
    weight: torch.Tensor
    key: torch.Tensor


MOMENTS = STATE_KINDS["adamw"]
# every per-parameter optimizer state a checkpoint may hold
STATE_TENSORS = tuple(dict.fromkeys(k for kinds in STATE_KINDS.values() for k in kinds))


class Engine:
    """Interface used by the trainer (see module docstring)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    # dtype gradients travel in (``precision.grad_reduce_dtype``): bf16 halves the bytes of
    # every gradient all-reduce / reduce-scatter; accumulation and the step stay fp32
    reduce_dtype: torch.dtype = torch.float32

    def set_sync(self, sync: bool) -> None:
        """Whether the coming backward is the last micro-batch of the step."""

    def begin_step(self) -> None:
        """Before the first micro-batch (ZeRO-3 under a pipeline gathers its parameters)."""

    def end_forward_only(self) -> None:
        """After an evaluation made outside a step (ZeRO-3 under a pipeline frees them)."""

    def end_evaluation(self) -> None:
        """After the evaluation batches (ZeRO-3 frees a root unit a chunked loss kept)."""

    def finish_grads(self) -> None:
        """Complete every pending gradient reduction; gradients are then the global mean."""

    def clip_grad_norm(self, max_norm: float) -> float:
        raise NotImplementedError

    def step(self, lr: float) -> None:
        """AdamW step at learning rate ``lr`` (the trainer skips it on an fp16 overflow)."""
        raise NotImplementedError

    def sync_held(self) -> None:
        """After owned weight ranges were changed in place (DiLoCo's outer step), bring every
        held copy up to date (ZeRO-1/2: all-gather the shards; no-op where held is owned)."""

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradients (or gradient shards) this rank steps, after ``finish_grads``: what
        fp16 loss scaling unscales and checks for overflow."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer states."""
        raise NotImplementedError

    # -- checkpoints ------------------------------------------------------------------------
    def owned(self) -> list[Owned]:
        """Ranges of parameters whose optimizer state this rank holds (each element of every
        parameter is owned by exactly one rank per copy)."""
        raise NotImplementedError

    def held(self) -> list[tuple[ShardSpec, int, int, torch.Tensor]]:
        """(spec, lo, hi, 1-D view) of every weight range this rank keeps in memory."""
        return [(o.spec, o.lo, o.hi, o.weight) for o in self.owned()]

    def state_kinds(self) -> tuple[str, ...]:
        """The optimizer's per-parameter state tensors (AdamW: two moments; SGD: momentum)."""
        return state_kinds(self.optimizer)

    def moments(self, o: Owned) -> dict[str, torch.Tensor] | None:
        """Optimizer state of an owned range as 1-D tensors (None before the first step)."""
        state = self.optimizer.state.get(o.key)
        kinds = self.state_kinds()
        if not state or any(state.get(k) is None for k in kinds):
            return None
        return {k: state[k].reshape(-1) for k in kinds}

    def adam_step(self) -> int:
        """Optimizer steps taken (every parameter's AdamW step count is the same)."""
        for state in self.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
        return 0

    def use_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Replace the AdamW built at construction, before its first step, by an equivalent
        one over the same groups (states offloaded: ``parallel/offload.py``)."""
        self.optimizer = optimizer
        sharded = getattr(self, "opt", None)  # ZeRO engines step through their ShardedAdamW
        if sharded is not None:
            sharded.optimizer = optimizer

    def set_moments(self, o: Owned, step: int, values: dict[str, torch.Tensor]) -> None:
        """Install optimizer state for an owned range (1-D tensors of ``hi - lo`` elements)."""
        kinds = self.state_kinds()
        self.optimizer.state[o.key] = {
            **({"step": step_tensor(self.optimizer, step, o.key.device)}
               if "exp_avg" in kinds else {}),
            **{k: values[k].to(o.key.device).view(o.key.shape).clone() for k in kinds}}


def clip_by_global_norm(pairs: list[tuple[ShardSpec, torch.Tensor]], max_norm: float,
                        comm: Comm, axes: tuple[str, ...]) -> float:
    """L2 norm of every gradient (shard) in the world, each element once; scale if above max.

    ``pairs`` are (spec, gradient) with the gradient possibly a shard or a flat piece of the
    parameter's; a copy replicated on an axis the sums are added over counts 1/copies (see
    ``ShardSpec.norm_weight``), so the squared sums need adding only over ``axes``
    (:func:`~meshlm.distributed.spec.norm_axes`): on the other axes every rank holds them whole
    (a tensor-parallel shard under DDP is replicated over dp, which is not among the axes).
    """
    device = pairs[0][1].device if pairs else comm.mesh.device()
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for spec, g in pairs:  # (one fp64 reduction a tensor: no fp64 square kept; ~3x faster)
        sq += torch.linalg.vector_norm(g, dtype=torch.float64).square() * spec.norm_weight(
            comm.mesh, axes)
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

    def step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict[str, int]:
        return {
            "params": tensor_bytes(self.params),
            "grads": self._grad_bytes,
            "optim": optimizer_state_bytes(self.optimizer),
        }

    def owned(self) -> list[Owned]:
        return [Owned(spec_of(p), 0, p.numel(), p.detach().view(-1), p) for p in self.params]
