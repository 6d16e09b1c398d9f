"""AdamW (or SGD with momentum) with fp32 master weights and the warmup + cosine schedule.

Parameters are kept in fp32 (the master copy); lower-precision compute comes from autocast,
so the optimizer always steps fp32 tensors. Memory per rank: 4 bytes of weights + 8 bytes of
Adam moments per parameter (Ψ(4+8) in the ZeRO paper's notation, plus 4Ψ of fp32 gradients).
Weight decay applies to matrices only (not to norm weights), as in GPT-2/Llama training.

AdamW's kernels (``train.adamw_impl``): ``fused`` is torch's single-kernel AdamW
(``fused=True``: one pass over weights, gradient and both moments, no temporaries; CUDA and
CPU), ``foreach`` its multi-tensor one (about ten kernels per group, and ``_foreach_sqrt``
allocates a temporary as large as the moments it steps: 4 bytes per parameter of the group);
``auto`` takes ``fused`` wherever torch has it for the parameters' device. Both keep the same
state (``step``, ``exp_avg``, ``exp_avg_sq``), so a checkpoint written under one resumes under
the other; the fused kernel keeps ``step`` on the parameters' device.
With ``parallel.offload`` = ``cpu`` or ``disk`` the engines' AdamW is swapped for
``parallel.offload.OffloadedAdamW``: the same groups and hyper-parameters, the moments off the
device.

``train.optimizer = sgd``: torch's SGD with momentum ``beta1`` (4 bytes of state per
parameter) and L2 weight decay on the same groups -- linear in the gradient, so averaging
the updates of several replicas equals one update on their averaged gradients.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import TrainSection


def decayed(p: torch.Tensor) -> bool:
    """Weight decay applies to matrices (ndim >= 2), not to norm weights (GPT-2/Llama)."""
    return p.ndim >= 2


def canonical_params(model: nn.Module) -> list[tuple[str, nn.Parameter, bool]]:
    """(name, parameter, decayed?) in the order of :func:`build_optimizer`'s state dict.

    Decayed parameters first, each once (a tied weight keeps its first name). This order
    defines the layout-free optimizer checkpoint: every data-parallel engine converts its
    (possibly sharded) AdamW state to and from it.
    """
    seen: set[int] = set()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if decayed(p) else no_decay).append((name, p, decayed(p)))
    return decay + no_decay


# optimizer-state tensors per parameter, by optimizer (what checkpoints store besides weights)
STATE_KINDS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def state_kinds(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """Names of the per-parameter state tensors of ``optimizer`` (AdamW's moments, SGD's
    momentum buffer)."""
    return STATE_KINDS["sgd" if isinstance(optimizer, torch.optim.SGD) else "adamw"]


def fused_supported(device: torch.device) -> bool:
    """Whether torch has a fused AdamW kernel for parameters on ``device``."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return device.type in _get_fused_kernels_supported_devices()


def adamw_impl(cfg: TrainSection, device: torch.device) -> str:
    """The AdamW kernels ``train.adamw_impl`` picks for parameters on ``device``: ``fused`` or
    ``foreach`` (``auto``: fused where torch has it)."""
    if cfg.adamw_impl == "auto":
        return "fused" if fused_supported(device) else "foreach"
    if cfg.adamw_impl == "fused" and not fused_supported(device):
        raise ValueError(f"train.adamw_impl=fused: torch has no fused AdamW for {device.type} "
                         "parameters (use auto or foreach)")
    return cfg.adamw_impl


def adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: TrainSection
          ) -> torch.optim.Optimizer:
    """``train.optimizer`` over two groups, decayed then not: AdamW with the kernels of
    :func:`adamw_impl` (fused: one kernel per group), or SGD with momentum ``beta1``."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, momentum=cfg.beta1, foreach=True)
    first = next((p for p in (*decay, *no_decay)), None)
    impl = adamw_impl(cfg, first.device if first is not None else torch.device("cpu"))
    kernels = {"fused": True} if impl == "fused" else {"foreach": True}
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernels,
    )


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps with torch's fused kernels (its ``step`` lives on the
    parameters' device)."""
    return any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)


def step_tensor(optimizer: torch.optim.Optimizer, step: int | float, device: torch.device
                ) -> torch.Tensor:
    """AdamW's ``step`` state as ``optimizer`` keeps it: a float32 scalar on the parameters'
    device for the fused kernels, a CPU scalar of the default dtype for foreach (what torch
    makes at the first step; a checkpoint stores the count, not the tensor)."""
    from torch.optim.optimizer import _get_scalar_dtype

    if is_fused(optimizer):
        return torch.tensor(float(step), dtype=_get_scalar_dtype(is_fused=True), device=device)
    return torch.tensor(float(step), dtype=_get_scalar_dtype())


def build_optimizer(model: nn.Module, cfg: TrainSection) -> torch.optim.Optimizer:
    """``train.optimizer`` over the model's parameters in :func:`canonical_params` order."""
    named = canonical_params(model)
    return adamw([p for _, p, d in named if d], [p for _, p, d in named if not d], cfg)


def lr_at(step: int, cfg: TrainSection) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup, then cosine to min_lr."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
