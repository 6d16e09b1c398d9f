"""AdamW (or SGD with momentum) with fp32 master weights and the warmup + cosine schedule.

Parameters are kept in fp32 (the master copy); lower-precision compute comes from autocast,
so the optimizer always steps fp32 tensors. Memory per rank: 4 bytes of weights + 8 bytes of
Adam moments per parameter (Ψ(4+8) in the ZeRO paper's notation, plus 4Ψ of fp32 gradients).
Weight decay applies to matrices only (not to norm weights), as in GPT-2/Llama training.
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


def adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: TrainSection
          ) -> torch.optim.Optimizer:
    """``train.optimizer`` over two groups, decayed then not (``foreach`` kernels: one launch
    per group): AdamW, or SGD with momentum ``beta1``."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, momentum=cfg.beta1, foreach=True)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True,
    )


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
