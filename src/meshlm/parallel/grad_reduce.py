"""Gradient reduction for every data-parallel stage: DDP and ZeRO-1/2/3 declare, this runs.

A stage declares what it shards over its shard group (:class:`Stage`): the optimizer states,
the gradients, the parameters. The rest follows from the declaration:

- the reduction: an all-reduce when every rank steps whole gradients (DDP), else a
  reduce-scatter into the owner's shard;
- what a rank keeps of a gradient: the whole flat buffer its parameters' ``.grad`` are views of
  (gradients not sharded: DDP, ZeRO-1; accumulated there and reduced once, on the last
  micro-batch), or its shard only (ZeRO-2/3: each micro-batch's gradients are copied into a
  transient flat buffer as they arrive, reduced when the last one is in, and added into the
  shard).

Gradients live in :class:`GradBucket` s, each a :class:`~meshlm.parallel.flat.FlatGroup` of one
reduction group (spec ``reduce_axis``) sharded over that group's shard axis
(:meth:`~meshlm.distributed.mesh.Mesh.shard_axis`). A post-accumulate-grad hook on every
parameter counts its bucket's ready gradients and launches the bucket's reduction,
asynchronously, when the last one arrives: it overlaps the rest of backward (Li et al. 2020,
"PyTorch Distributed", 3.2.3). At most two reduce-scatters are in flight (gloo holds a
transient of about 1.25x each input); all-reduces run in place, all in flight at once.
:meth:`GradReducer.finish` launches what the hooks did not (a parameter without a gradient; a
deferred step, reduced once after the last micro-batch as under a pipeline), waits for every
reduction and divides by :meth:`~meshlm.distributed.mesh.Mesh.grad_divisor` of the group's
reduce axis: gradients are then the global mean.

Hybrid sharding (``parallel.dp_shard`` < dp): the reduce-scatter runs within the shard group,
and each bucket's gradient shard, once complete for the step, is all-reduced across the shard
group's replicas (:meth:`~meshlm.distributed.mesh.Mesh.replica_axis`, ``dp_rep``),
asynchronously: launched as the step's last reduce-scatter of the bucket completes (on the last
micro-batch, ``set_sync(True)``), else in :meth:`GradReducer.finish`.

Communication: one all-reduce (DDP) or reduce-scatter (ZeRO) of every bucket per step, and
per micro-batch where gradients are sharded (module docstrings of ``data.py``, ``zero.py``,
``zero3.py``); hybrid sharding adds one all-reduce over ``dp_rep`` of every gradient shard per
step: 4Ψ / shard-group size bytes (fp32).
Memory: the buckets' gradients (whole buffers or shards), plus, while reductions are in
flight, at most two transient flat buffers or reduce-scatter outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..distributed.comm import Comm, Handle
from .flat import FlatGroup


@dataclass(frozen=True)
class Stage:
    """What a data-parallel stage shards across its shard group (ZeRO's stages as data)."""

    optimizer: bool  # each rank steps, and holds the optimizer states of, its shard only
    grads: bool  # each rank keeps its gradient shard only (reduced every micro-batch)
    params: bool  # parameters live as shards, gathered per unit to compute (ZeRO-3)

    @property
    def reduction(self) -> str:
        """``all_reduce`` (every rank steps whole gradients) or ``reduce_scatter``."""
        return "reduce_scatter" if self.optimizer else "all_reduce"


# DDP (zero = 0) and the ZeRO stages (Rajbhandari et al. 2020)
STAGES = {
    0: Stage(optimizer=False, grads=False, params=False),
    1: Stage(optimizer=True, grads=False, params=False),
    2: Stage(optimizer=True, grads=True, params=False),
    3: Stage(optimizer=True, grads=True, params=True),
}
MAX_IN_FLIGHT = 2  # reduce-scatters pending at once


class GradBucket:
    """The gradients of one flat group: what this rank keeps of them and their reduction.

    ``grad``: the reduced gradient this rank steps -- the whole buffer (DDP), its shard of the
    whole buffer (ZeRO-1), or a shard of its own (ZeRO-2/3; ``shard`` gives it, else zeros).
    """

    def __init__(self, group: FlatGroup, reduce_axis: str, comm: Comm, stage: Stage,
                 shard: torch.Tensor | None = None) -> None:
        mesh = comm.mesh
        self.group, self.reduce_axis = group, reduce_axis
        self.replica_axis = mesh.replica_axis(reduce_axis) if stage.optimizer else None
        self.divisor = mesh.grad_divisor(reduce_axis)
        p0 = group.params[0]
        self.full: torch.Tensor | None = None  # the whole buffer .grad views (not sharded)
        self.views: list[torch.Tensor] = []
        if not stage.grads:
            self.full = torch.zeros(group.padded, dtype=p0.dtype, device=p0.device)
            self.views = group.views(self.full)
            s0, s1 = group.shard_range(comm.rank(group.axis))
            self.grad = self.full[s0:s1] if stage.optimizer else self.full
        else:
            self.grad = shard if shard is not None else torch.zeros(
                group.shard_size, dtype=p0.dtype, device=p0.device)
        self.transient: torch.Tensor | None = None  # this micro-batch's gradients (sharded)
        self.ready = 0  # gradients accumulated since the last launch
        self.launched = False  # reduced since the last finish
        self.synced = False  # replica all-reduce launched since the last finish

    def attach(self) -> None:
        """Point every parameter's ``.grad`` at its view of the whole buffer."""
        for p, v in zip(self.group.params, self.views, strict=True):
            p.grad = v

    def nbytes(self) -> int:
        """Gradient bytes this rank holds for the bucket."""
        kept = self.full if self.full is not None else self.grad
        return kept.numel() * kept.element_size()


# a launched reduction: (bucket, handle, result, final -- the step's last for the bucket)
InFlight = tuple[GradBucket, Handle, torch.Tensor, bool]


class GradReducer:
    """Hooks, launches and completion of the gradient reductions of ``buckets``.

    ``dtype``: the dtype gradients travel in (read at each launch: the trainer sets the
    engine's ``reduce_dtype`` after construction). ``deferred``: hooks do nothing; every bucket
    is reduced once in :meth:`finish`, from its parameters' ``.grad`` (ZeRO-3 under a
    pipeline). ``on_launch``: called with each bucket whose reduction was just launched (ZeRO-3
    frees the unit's parameters).
    """

    def __init__(self, comm: Comm, stage: Stage, buckets: list[GradBucket],
                 dtype: Callable[[], torch.dtype], deferred: bool = False,
                 on_launch: Callable[[GradBucket], None] | None = None) -> None:
        self.comm, self.stage, self.buckets = comm, stage, buckets
        self.dtype, self.deferred, self.on_launch = dtype, deferred, on_launch
        self.sync = True  # the coming backward is the step's last micro-batch
        self._finishing = False
        self.inflight: list[InFlight] = []
        self.replicas: list[tuple[GradBucket, Handle, torch.Tensor]] = []
        self._where: dict[int, tuple[GradBucket, int]] = {}
        for b in buckets:
            for i, p in enumerate(b.group.params):
                self._where[id(p)] = (b, i)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # -- backward hooks -----------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self.deferred:
            return  # reduced once, in finish
        b, i = self._where[id(p)]
        if b.full is not None:
            view = b.views[i]
            if p.grad is not view:  # autograd replaced the view (e.g. after set_to_none)
                view.copy_(p.grad)
                p.grad = view
            if not self.sync:
                return  # accumulated in the whole buffer, reduced on the last micro-batch
            source = b.full
        else:
            if b.transient is None:
                b.transient = torch.zeros(b.group.padded, dtype=self.dtype(), device=p.device)
            lo, hi = b.group.span(i)
            b.transient[lo:hi].copy_(p.grad.reshape(-1))
            p.grad = None  # the whole gradient is not kept
            source = b.transient
        b.ready += 1
        if b.ready == len(b.group.params):
            self._launch(b, source)

    # -- reductions ---------------------------------------------------------------------
    def _launch(self, b: GradBucket, source: torch.Tensor) -> None:
        b.ready = 0
        dtype = self.dtype()
        wire = source if source.dtype == dtype else source.to(dtype)
        if self.stage.optimizer:
            out = torch.empty(b.group.shard_size, dtype=dtype, device=wire.device)
            handle = self.comm.reduce_scatter(out, wire, b.group.axis, async_op=True)
        else:
            out = wire
            handle = self.comm.all_reduce(wire, b.reduce_axis, async_op=True)
        b.transient = None
        b.launched = True
        self.inflight.append((b, handle, out, self.sync or self._finishing))
        if self.on_launch is not None:
            self.on_launch(b)
        if self.stage.optimizer:
            while len(self.inflight) > MAX_IN_FLIGHT:  # bound the transient memory
                self._complete(self.inflight.pop(0))

    def _complete(self, item: InFlight) -> None:
        b, handle, out, final = item
        handle.wait()
        if self.stage.grads:
            b.grad.add_(out)  # a shard accumulates each micro-batch's reduction
        elif out is not b.grad:
            b.grad.copy_(out)
        if final and b.replica_axis is not None:
            self._launch_replica(b)

    def _launch_replica(self, b: GradBucket) -> None:
        """All-reduce the bucket's complete gradient shard across the shard group's replicas."""
        b.synced = True
        dtype = self.dtype()
        wire = b.grad if b.grad.dtype == dtype else b.grad.to(dtype)
        self.replicas.append((b, self.comm.all_reduce(wire, b.replica_axis, async_op=True), wire))

    def pending(self) -> list[GradBucket]:
        """Buckets that received some of their gradients but not all."""
        return [b for b in self.buckets if b.ready]

    def finish(self) -> None:
        """Launch what the hooks did not, complete every reduction, divide to the mean."""
        self._finishing = True
        for b in self.buckets:
            if self.deferred:
                self._launch(b, self._flatten_grads(b))
            elif b.full is not None:
                if not b.launched:  # (parameters without gradients: reduce what there is)
                    self._launch(b, b.full)
            elif b.ready:
                self._launch(b, b.transient)
        while self.inflight:
            self._complete(self.inflight.pop(0))
        for b in self.buckets:
            if b.replica_axis is not None and not b.synced:
                self._launch_replica(b)
        for b, handle, wire in self.replicas:
            handle.wait()
            if wire is not b.grad:
                b.grad.copy_(wire)
        self.replicas = []
        for b in self.buckets:
            if b.divisor > 1:
                b.grad.div_(b.divisor)
            b.launched = b.synced = False
        self._finishing = False

    def _flatten_grads(self, b: GradBucket) -> torch.Tensor:
        """The parameters' accumulated ``.grad`` in one flat buffer (zeros where none);
        the parameters' gradients are dropped."""
        grads = [q.grad if q.grad is not None else torch.zeros(
            shape, dtype=b.grad.dtype, device=b.grad.device)
                 for q, shape in zip(b.group.params, b.group.shapes, strict=True)]
        flat = b.group.flatten(grads, self.dtype())
        for q in b.group.params:
            q.grad = None
        return flat

    def zero_grad(self) -> None:
        """Zero every kept gradient; whole buffers are attached to ``.grad`` again."""
        for b in self.buckets:
            if b.full is not None:
                b.full.zero_()
                b.attach()
            else:
                b.grad.zero_()
                for p in b.group.params:
                    p.grad = None
            b.ready = 0

    def state_bytes(self) -> int:
        return sum(b.nbytes() for b in self.buckets)
