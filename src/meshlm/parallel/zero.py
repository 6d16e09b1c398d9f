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

Memory per rank (weights + gradients + Adam moments): stage 1 -- 4Ψ + 4Ψ + 8Ψ/n;
stage 2 -- 4Ψ + 4Ψ/n + 8Ψ/n (plus two transient buckets during backward).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainSection
from ..distributed.comm import Comm, Handle
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


def flat_groups(model: nn.Module, comm: Comm, bucket_mb: float,
                groups: list[ParamGroup] | None) -> list[FlatGroup]:
    """Buckets of at most ``bucket_mb`` per reduction group, sharded over the group's axis."""
    if groups is None:  # ~ backward order
        groups = reduction_groups(unique_trainable(list(model.named_parameters()))[::-1])
    return [FlatGroup([p for _, p in g], [n for n, _ in g], comm.size(group.axis), group.axis)
            for group in groups for g in split_by_size(group.named, int(bucket_mb * 2**20))]


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
    """ZeRO stage 1 or 2 over ``axis`` (see module docstring)."""

    def __init__(self, model: nn.Module, cfg: TrainSection, comm: Comm, stage: int,
                 bucket_mb: float = 25.0, groups: list[ParamGroup] | None = None) -> None:
        assert stage in (1, 2)
        self.model, self.cfg, self.comm, self.stage = model, cfg, comm, stage
        attach_specs(model, comm.mesh)  # (no-op for parameters a technique already placed)
        self.groups = flat_groups(model, comm, bucket_mb, groups)
        self.param_bufs, self.grad_bufs, shard_params, shard_grads = [], [], [], []
        self._where: dict[int, tuple[int, int]] = {}
        for gi, g in enumerate(self.groups):
            buf = g.flatten([p.detach() for p in g.params])
            for p, v in zip(g.params, g.views(buf), strict=True):
                p.data = v  # parameters become views of the flat buffer
            s0, s1 = g.shard_range(comm.rank(g.axis))
            self.param_bufs.append(buf)
            shard_params.append(buf[s0:s1])
            if stage == 1:
                grad = torch.zeros_like(buf)
                self.grad_bufs.append(grad)
                shard_grads.append(grad[s0:s1])
            else:
                shard_grads.append(torch.zeros(g.shard_size, dtype=buf.dtype, device=buf.device))
            for i, p in enumerate(g.params):
                self._where[id(p)] = (gi, i)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.shard_grads = shard_grads
        self.opt = ShardedAdamW(model, cfg, self.groups, shard_params, shard_grads, comm)
        self.optimizer = self.opt.optimizer
        self.sync = True
        self.ready = [0] * len(self.groups)
        self.transient: list[torch.Tensor | None] = [None] * len(self.groups)
        self.inflight: list[tuple[int, Handle, torch.Tensor]] = []
        self.launched: set[int] = set()  # buckets reduce-scattered since the last finish_grads
        self.zero_grad()

    def set_sync(self, sync: bool) -> None:
        self.sync = sync

    # -- backward hooks ---------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        gi, i = self._where[id(p)]
        g = self.groups[gi]
        if self.stage == 1:
            view = g.views(self.grad_bufs[gi])[i]
            if p.grad is not view:
                view.copy_(p.grad)
                p.grad = view
            if not self.sync:
                return
            source = self.grad_bufs[gi]
        else:
            if self.transient[gi] is None:
                self.transient[gi] = torch.zeros(g.padded, dtype=p.dtype, device=p.device)
            a, b = g.span(i)
            self.transient[gi][a:b].copy_(p.grad.reshape(-1))
            p.grad = None  # the full gradient is not kept (stage 2)
            source = self.transient[gi]
        self.ready[gi] += 1
        if self.ready[gi] == len(g.params):
            self._launch(gi, source)

    def _launch(self, gi: int, source: torch.Tensor) -> None:
        self.ready[gi] = 0
        g = self.groups[gi]
        if source.dtype != self.reduce_dtype:
            source = source.to(self.reduce_dtype)
        out = torch.empty(g.shard_size, dtype=source.dtype, device=source.device)
        self.inflight.append((gi, self.comm.reduce_scatter(out, source, g.axis, async_op=True),
                              out))
        self.transient[gi] = None
        self.launched.add(gi)
        while len(self.inflight) > 2:  # bound transient memory (gloo holds ~1.25x the input)
            self._complete(self.inflight.pop(0))

    def _complete(self, item: tuple[int, Handle, torch.Tensor]) -> None:
        gi, handle, out = item
        handle.wait()
        if self.stage == 1:
            self.shard_grads[gi].copy_(out)
        else:
            self.shard_grads[gi].add_(out)

    def finish_grads(self) -> None:
        for gi in range(len(self.groups)):
            if self.ready[gi] or (self.stage == 1 and gi not in self.launched):
                src = self.grad_bufs[gi] if self.stage == 1 else self.transient[gi]
                if src is not None:  # parameters without gradient: reduce what there is
                    self._launch(gi, src)
        while self.inflight:
            self._complete(self.inflight.pop(0))
        for g, grad in zip(self.groups, self.shard_grads, strict=True):
            if self.comm.mesh.grad_divisor(g.axis) > 1:
                grad.div_(self.comm.mesh.grad_divisor(g.axis))
        self.launched = set()

    # -- step --------------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float) -> float:
        return self.opt.clip_grad_norm(max_norm)

    def grad_tensors(self) -> list[torch.Tensor]:
        return list(self.shard_grads)

    def step(self, lr: float) -> None:
        self.opt.step(lr)
        self.sync_held()

    def sync_held(self) -> None:
        """All-gather every rank's updated shard into the whole (local) parameters."""
        handles = []
        for gi, g in enumerate(self.groups):
            s0, s1 = g.shard_range(self.opt.ranks[gi])
            mine = self.param_bufs[gi][s0:s1].clone()  # the input must not alias the output
            handles.append(self.comm.all_gather(self.param_bufs[gi], mine, g.axis,
                                                async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        for gi, g in enumerate(self.groups):
            if self.stage == 1:
                self.grad_bufs[gi].zero_()
                for p, v in zip(g.params, g.views(self.grad_bufs[gi]), strict=True):
                    p.grad = v
            else:
                self.shard_grads[gi].zero_()
                for p in g.params:
                    p.grad = None
        self.ready = [0] * len(self.groups)

    # -- accounting and checkpoints ----------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        grads = self.grad_bufs if self.stage == 1 else self.shard_grads
        return {
            "params": sum(b.numel() * b.element_size() for b in self.param_bufs),
            "grads": sum(b.numel() * b.element_size() for b in grads),
            "optim": self.opt.state_bytes(),
        }

    def owned(self) -> list[Owned]:
        return self.opt.owned()

    def held(self) -> list[tuple[ShardSpec, int, int, torch.Tensor]]:
        """Whole (local) parameters: every dp rank keeps them (views of the flat buffers)."""
        return [(spec_of(p), 0, p.numel(), p.detach().view(-1))
                for g in self.groups for p in g.params]
