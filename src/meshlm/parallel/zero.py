"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020): optimizer states, then gradients, sharded.

Parameters sit in flat buckets (as in DDP) padded to a multiple of the dp size ``n``; rank r
owns shard r of every bucket and runs AdamW on that shard only (:class:`ShardedAdamW`). After
the step, each bucket's parameters are all-gathered from the shards.

- **Stage 1** keeps full gradient buckets; on the last micro-batch each bucket is reduce-scattered
  as soon as backward finishes it (overlapped, as DDP's all-reduce), into the owner's shard;
  at most two reduce-scatters are in flight (gloo holds a transient of ~1.25x each input).
- **Stage 2** keeps only the gradient shard: every micro-batch's bucket is copied into a
  transient buffer as its gradients arrive and reduce-scattered at once (at most two buckets
  in flight), and the result is accumulated into the shard.

Communication per optimizer step with ``m`` micro-batches per rank (comm log, fp32, padded
Ψ): stage 1 -- reduce-scatter 4Ψ + all-gather 4Ψ; stage 2 -- reduce-scatter 4Ψ per micro-batch
(``m`` x 4Ψ) + all-gather 4Ψ. Both add one 8-byte all-reduce: the squared gradient norm of
the shards, for clipping by the global norm.
Buckets never mix reduction groups (shard spec ``reduce_axis``): each group is sharded over
its own axis, and each bucket records in its parameters' specs which flat range this rank owns.
The buckets, hooks and reduce-scatters are :mod:`~meshlm.parallel.grad_reduce`'s: stage 1
declares sharded optimizer states, stage 2 sharded gradients as well.

Hybrid sharding (``parallel.dp_shard`` < dp): each group is sharded over its shard axis
(``dp_shard``, ``dp_shard_cp``, ``edp_shard``) instead of its whole reduce axis; gradient shards
are all-reduced across the replicas (``dp_rep``) once per step, 4Ψ/dp_shard bytes (x 1/cp over
``dp_shard_cp``), and the after-step all-gather stays within the shard group. Optimizer states
(and stage 2's gradients) are then 1/dp_shard (x 1/cp) of the whole per rank.

Memory per rank (weights + gradients + Adam moments): stage 1 -- 4Ψ + 4Ψ + 8Ψ/n;
stage 2 -- 4Ψ + 4Ψ/n + 8Ψ/n (plus two transient buckets during backward).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainSection
from ..distributed.comm import Comm
from ..distributed.spec import (
    ParamGroup,
    ShardSpec,
    attach_specs,
    norm_axes,
    reduction_groups,
    spec_of,
)
from ..optim import adamw, decayed, set_lr
from .engine import Engine, Owned, clip_by_global_norm, optimizer_state_bytes
from .flat import FlatGroup, split_by_size, unique_trainable
from .grad_reduce import STAGES, GradBucket, GradReducer


def flat_groups(model: nn.Module, comm: Comm, bucket_mb: float,
                groups: list[ParamGroup] | None) -> list[tuple[FlatGroup, str]]:
    """Buckets of at most ``bucket_mb`` per reduction group, each with the group's reduce
    axis, sharded over the group's shard axis (its whole axis, or the shard group under
    hybrid sharding: :meth:`~meshlm.distributed.mesh.Mesh.shard_axis`)."""
    if groups is None:  # ~ backward order
        groups = reduction_groups(unique_trainable(list(model.named_parameters()))[::-1])
    out = []
    for group in groups:
        shard_axis = comm.mesh.shard_axis(group.axis)
        out += [(FlatGroup([p for _, p in g], [n for n, _ in g], comm.size(shard_axis),
                           shard_axis), group.axis)
                for g in split_by_size(group.named, int(bucket_mb * 2**20))]
    return out


class ShardedAdamW:
    """AdamW over this rank's pieces of a list of flat groups (views of shard tensors)."""

    def __init__(self, model: nn.Module, cfg: TrainSection, groups: list[FlatGroup],
                 shard_params: list[torch.Tensor], shard_grads: list[torch.Tensor],
                 comm: Comm) -> None:
        self.model, self.cfg, self.groups, self.comm = model, cfg, groups, comm
        self.ranks = [comm.rank(g.axis) for g in groups]
        self.shard_params, self.shard_grads = shard_params, shard_grads
        self.pieces: list[tuple[int, int, int, int, nn.Parameter]] = []  # (g, index, lo, hi, t)
        by_decay: dict[bool, list[nn.Parameter]] = {True: [], False: []}
        for gi, g in enumerate(groups):
            g.own(self.ranks[gi])
            s0, _ = g.shard_range(self.ranks[gi])
            for pc in g.pieces(self.ranks[gi]):
                t = nn.Parameter(shard_params[gi][pc.lo - s0 : pc.hi - s0])  # shares storage
                t.grad = shard_grads[gi][pc.lo - s0 : pc.hi - s0]
                self.pieces.append((gi, pc.index, pc.lo, pc.hi, t))
                by_decay[decayed(g.params[pc.index])].append(t)
        self.optimizer = adamw(by_decay[True], by_decay[False], cfg)
        self.norm_axes = norm_axes([spec_of(p) for g in groups for p in g.params], comm.mesh)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm over every shard of every rank; scale if above max_norm."""
        pairs = [(spec_of(self.groups[gi].params[index]), t.grad)
                 for gi, index, _, _, t in self.pieces]
        return clip_by_global_norm(pairs, max_norm, self.comm, self.norm_axes)

    def step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        # re-point piece grads: stage 1 re-attaches bucket views, the shards stay the same
        for gi, _, lo, hi, t in self.pieces:
            s0, _ = self.groups[gi].shard_range(self.ranks[gi])
            t.grad = self.shard_grads[gi][lo - s0 : hi - s0]
        self.optimizer.step()

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)

    def owned(self) -> list[Owned]:
        """Every piece this rank steps, as a flat range of its parameter's local tensor."""
        out = []
        for gi, index, lo, hi, t in self.pieces:
            g = self.groups[gi]
            a, _ = g.span(index)
            out.append(Owned(spec_of(g.params[index]), lo - a, hi - a, t.detach(), t))
        return out


class ZeroEngine(Engine):
    """ZeRO stage 1 or 2, each group over its shard axis (see module docstring)."""

    def __init__(self, model: nn.Module, cfg: TrainSection, comm: Comm, stage: int,
                 bucket_mb: float = 25.0, groups: list[ParamGroup] | None = None) -> None:
        assert stage in (1, 2)
        self.model, self.cfg, self.comm, self.stage = model, cfg, comm, stage
        attach_specs(model, comm.mesh)  # (no-op for parameters a technique already placed)
        declared = STAGES[stage]
        self.param_bufs, shard_params, buckets = [], [], []
        for g, reduce_axis in flat_groups(model, comm, bucket_mb, groups):
            buf = g.flatten([p.detach() for p in g.params])
            for p, v in zip(g.params, g.views(buf), strict=True):
                p.data = v  # parameters become views of the flat buffer
            s0, s1 = g.shard_range(comm.rank(g.axis))
            self.param_bufs.append(buf)
            shard_params.append(buf[s0:s1])
            buckets.append(GradBucket(g, reduce_axis, comm, declared))
        self.groups = [b.group for b in buckets]
        self.shard_grads = [b.grad for b in buckets]
        self.reducer = GradReducer(comm, declared, buckets, lambda: self.reduce_dtype)
        self.opt = ShardedAdamW(model, cfg, self.groups, shard_params, self.shard_grads, comm)
        self.optimizer = self.opt.optimizer
        self.zero_grad()

    def set_sync(self, sync: bool) -> None:
        self.reducer.sync = sync

    def finish_grads(self) -> None:
        self.reducer.finish()

    # -- step --------------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float) -> float:
        return self.opt.clip_grad_norm(max_norm)

    def grad_tensors(self) -> list[torch.Tensor]:
        return list(self.shard_grads)

    def step(self, lr: float) -> None:
        self.opt.step(lr)
        self.sync_held()

    def sync_held(self) -> None:
        """All-gather every rank's updated shard into the whole (local) parameters, within
        the shard group."""
        handles = []
        for gi, g in enumerate(self.groups):
            s0, s1 = g.shard_range(self.opt.ranks[gi])
            mine = self.param_bufs[gi][s0:s1].clone()  # the input must not alias the output
            handles.append(self.comm.all_gather(self.param_bufs[gi], mine, g.axis,
                                                async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    # -- accounting and checkpoints ----------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        return {
            "params": sum(b.numel() * b.element_size() for b in self.param_bufs),
            "grads": self.reducer.state_bytes(),
            "optim": self.opt.state_bytes(),
        }

    def owned(self) -> list[Owned]:
        return self.opt.owned()

    def held(self) -> list[tuple[ShardSpec, int, int, torch.Tensor]]:
        """Whole (local) parameters: every dp rank keeps them (views of the flat buffers)."""
        return [(spec_of(p), 0, p.numel(), p.detach().view(-1))
                for g in self.groups for p in g.params]
