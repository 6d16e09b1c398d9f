"""Data parallelism (DDP): bucketed gradient all-reduce overlapped with backward.

Every dp rank holds the whole model and runs its own micro-batches. Gradients live in flat
*buckets* (``parallel.bucket_mb`` each, filled in reverse registration order, which is roughly
the order backward produces them); each parameter's ``.grad`` is a view into its bucket, so
autograd accumulates straight into the buffer that is communicated. When the last gradient of
a bucket is accumulated during the last micro-batch's backward, that bucket's all-reduce starts
asynchronously while backward goes on with earlier layers (Li et al. 2020, "PyTorch
Distributed", section 3.2.3). Micro-batches before the last communicate nothing.

Buckets, hooks and all-reduces are :mod:`~meshlm.parallel.grad_reduce`'s (the stage that
shards nothing). Parameters are bucketed per reduction group (their shard spec's
``reduce_axis``: ``dp``, ``dp_cp`` with context parallelism, expert-data-parallel and dense
groups with expert parallelism); a bucket never mixes groups and is all-reduced over its
group's axis.

Communication per optimizer step (comm log, fp32 gradients): one all-reduce of every bucket,
``4Ψ`` bytes in total (Ψ = parameters) -- independent of gradient accumulation.
Memory per rank: weights 4Ψ + gradients 4Ψ + Adam moments 8Ψ = 16Ψ bytes.
"""

from __future__ import annotations

from torch import nn

from ..config import TrainSection
from ..distributed.comm import Comm
from ..distributed.spec import ParamGroup, reduction_groups
from .engine import LocalEngine
from .flat import FlatGroup, split_by_size, unique_trainable
from .grad_reduce import STAGES, GradBucket, GradReducer


class DDPEngine(LocalEngine):
    """Full replicas; each group's gradients averaged over its axis by overlapped bucket
    all-reduces (groups: by shard spec, or given)."""

    def __init__(self, model: nn.Module, cfg: TrainSection, comm: Comm,
                 bucket_mb: float = 25.0, groups: list[ParamGroup] | None = None) -> None:
        super().__init__(model, cfg, comm)
        if groups is None:  # ~ backward order
            groups = reduction_groups(unique_trainable(list(model.named_parameters()))[::-1])
        stage = STAGES[0]
        self.buckets = [
            GradBucket(FlatGroup([p for _, p in g], [n for n, _ in g], 1, group.axis),
                       group.axis, comm, stage)
            for group in groups for g in split_by_size(group.named, int(bucket_mb * 2**20))
        ]
        for b in self.buckets:
            b.attach()
        self.reducer = GradReducer(comm, stage, self.buckets, lambda: self.reduce_dtype)

    def set_sync(self, sync: bool) -> None:
        self.reducer.sync = sync

    def finish_grads(self) -> None:
        self.reducer.finish()

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def state_bytes(self) -> dict[str, int]:
        out = super().state_bytes()
        out["grads"] = self.reducer.state_bytes()
        return out
