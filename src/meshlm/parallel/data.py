"""Data parallelism (DDP): bucketed gradient all-reduce overlapped with backward.

Every dp rank holds the whole model and runs its own micro-batches. Gradients live in flat
*buckets* (``parallel.bucket_mb`` each, filled in reverse registration order, which is roughly
the order backward produces them); each parameter's ``.grad`` is a view into its bucket, so
autograd accumulates straight into the buffer that is communicated. When the last gradient of
a bucket is accumulated during the last micro-batch's backward, that bucket's all-reduce starts
asynchronously while backward goes on with earlier layers (Li et al. 2020, "PyTorch
Distributed", section 3.2.3). Micro-batches before the last communicate nothing.

Parameters are bucketed per reduction group (their shard spec's ``reduce_axis``: ``dp`` today,
expert-data-parallel and dense groups with expert parallelism); a bucket never mixes groups
and is all-reduced over its group's axis.

Communication per optimizer step (comm log, fp32 gradients): one all-reduce of every bucket,
``4Ψ`` bytes in total (Ψ = parameters) -- independent of gradient accumulation.
Memory per rank: weights 4Ψ + gradients 4Ψ + Adam moments 8Ψ = 16Ψ bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainSection
from ..distributed.comm import Comm, Handle
from ..distributed.spec import ParamGroup, reduction_groups
from .engine import LocalEngine
from .flat import FlatGroup, split_by_size, unique_trainable


class Bucket:
    """A flat gradient buffer shared by a group of parameters, plus its pending reduction."""

    def __init__(self, group: FlatGroup, axis: str) -> None:
        self.group, self.axis = group, axis
        p0 = group.params[0]
        self.grad = torch.zeros(group.padded, dtype=p0.dtype, device=p0.device)
        self.views = group.views(self.grad)
        self.ready = 0
        self.handle: Handle | None = None
        self.wire: torch.Tensor | None = None  # what the all-reduce runs on (reduce dtype)

    def attach(self) -> None:
        """Point every parameter's ``.grad`` at its slice of the bucket."""
        for p, v in zip(self.group.params, self.views, strict=True):
            p.grad = v


class DDPEngine(LocalEngine):
    """Full replicas; each group's gradients averaged over its axis by overlapped bucket
    all-reduces (groups: by shard spec, or given)."""

    def __init__(self, model: nn.Module, cfg: TrainSection, comm: Comm,
                 bucket_mb: float = 25.0, groups: list[ParamGroup] | None = None) -> None:
        super().__init__(model, cfg, comm)
        if groups is None:  # ~ backward order
            groups = reduction_groups(unique_trainable(list(model.named_parameters()))[::-1])
        self.buckets = [
            Bucket(FlatGroup([p for _, p in g], [n for n, _ in g], 1), group.axis)
            for group in groups for g in split_by_size(group.named, int(bucket_mb * 2**20))
        ]
        self._bucket_of: dict[int, tuple[Bucket, int]] = {}
        for b in self.buckets:
            b.attach()
            for i, p in enumerate(b.group.params):
                self._bucket_of[id(p)] = (b, i)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.sync = True

    def set_sync(self, sync: bool) -> None:
        self.sync = sync

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket, i = self._bucket_of[id(p)]
        view = bucket.views[i]
        if p.grad is not view:  # autograd replaced the view (e.g. after set_to_none)
            view.copy_(p.grad)
            p.grad = view
        if not self.sync:
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.group.params):
            self._reduce(bucket)

    def _reduce(self, b: Bucket) -> None:
        b.wire = b.grad if b.grad.dtype == self.reduce_dtype else b.grad.to(self.reduce_dtype)
        b.handle = self.comm.all_reduce(b.wire, b.axis, async_op=True)

    def finish_grads(self) -> None:
        for b in self.buckets:
            if b.handle is None:  # a parameter received no gradient this step
                self._reduce(b)
        for b in self.buckets:
            b.handle.wait()
            if b.wire is not b.grad:
                b.grad.copy_(b.wire)
            b.wire = None
            if self.comm.mesh.grad_divisor(b.axis) > 1:
                b.grad.div_(self.comm.mesh.grad_divisor(b.axis))
            b.handle, b.ready = None, 0

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()
            b.attach()

    def state_bytes(self) -> dict[str, int]:
        out = super().state_bytes()
        out["grads"] = sum(b.grad.numel() * b.grad.element_size() for b in self.buckets)
        return out
