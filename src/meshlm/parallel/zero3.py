"""ZeRO stage 3 (Rajbhandari et al. 2020; PyTorch FSDP, Zhao et al. 2023): parameters sharded too.

The model is cut into *units*: each decoder layer, plus a root unit holding the embedding, the
final norm and the LM head. Each unit's parameters live as one flat fp32 shard per rank (1/n of
the padded unit); the full parameters exist only while the unit computes:

- forward: the unit's shard is all-gathered just before its forward (the next unit's gather is
  started at the same time -- prefetch) and freed right after it;
- backward: a hook on the unit's output gathers it again before its backward (prefetching the
  unit that runs next in backward); when the last gradient of the unit is accumulated, the
  gradients are reduce-scattered into the owner's shard (at most two in flight) and the full
  parameters and gradients are freed.

A layer whose parameters belong to several reduction groups (shard spec ``reduce_axis``) is
split into one unit per group, each sharded and reduced over its own axis. The gradient hooks,
reduce-scatters and their in-flight bound are :mod:`~meshlm.parallel.grad_reduce`'s (the stage
that shards optimizer states, gradients and parameters).

Hybrid sharding (``parallel.dp_shard`` < dp): units are sharded, gathered and reduce-scattered
within the shard group (``dp_shard``, ``dp_shard_cp``, ``edp_shard``), and each gradient shard
is all-reduced across the replicas (``dp_rep``) once per step: 4Ψ/dp_shard bytes (x 1/cp over
``dp_shard_cp``). Memory per rank: (4 + 4 + 8) Ψ / dp_shard (x 1/cp) bytes.

Freeing resizes the storage of the unit's one full buffer to zero (as FSDP2 does) instead of
dropping the buffer: the weight views autograd saves in forward would otherwise keep every
freed layer's gathered parameters alive until its backward -- the whole model at the end of
forward. Re-gathering fills the same storage, so those views see it again in backward.

The root unit is gathered once per micro-batch and kept until its backward ends (it is used at
both ends of the forward). Evaluation (no grad) frees every unit after its forward.

Communication per micro-batch (comm log, fp32, padded): all-gather 4(2 Ψ_layers + Ψ_root),
reduce-scatter 4Ψ, with Ψ = Ψ_layers + Ψ_root; gradient accumulation repeats both per micro-batch.
Per step, one 8-byte all-reduce of the squared gradient norm (clipping by the global norm).
Memory per rank: (4 + 4 + 8) Ψ / n bytes, plus the full parameters of at most two layers and
the root unit while they compute. Under bf16 autocast, each layer's bf16 weight copies are kept
for its backward until that backward runs (about 2 Ψ_layers bytes more at the peak).
Construction from meta parameters (shard-only) holds the shards plus one piece being read (and,
for initial values, one global parameter: see ``InitSource``); the model is never whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import TrainSection
from ..distributed.comm import Comm, Handle
from ..distributed.source import TensorSource, assign, read_local
from ..distributed.spec import ParamGroup, attach_specs, reduction_groups, spec_of
from .engine import Engine, Owned
from .flat import FlatGroup, unique_trainable
from .grad_reduce import STAGES, GradBucket, GradReducer
from .zero import ShardedAdamW


class Unit:
    """One sharded unit: its flat layout, shard, gradient shard and gather state.

    The shard is filled piece by piece -- from the parameters when they hold values, else
    (meta parameters: shard-only construction) from ``source`` -- so building a unit never
    needs its whole parameters.
    """

    def __init__(self, name: str, named: list[tuple[str, nn.Parameter]], axis: str, comm: Comm,
                 source: TensorSource | None = None) -> None:
        """``axis``: the reduction axis of the unit's parameters; the unit is sharded (and
        gathered) over its shard axis (:meth:`~meshlm.distributed.mesh.Mesh.shard_axis`)."""
        self.name, self.reduce_axis = name, axis
        self.axis = comm.mesh.shard_axis(axis)
        n, rank = comm.size(self.axis), comm.rank(self.axis)
        self.group = FlatGroup([p for _, p in named], [nm for nm, _ in named], n, self.axis)
        self.shapes = [p.shape for p in self.group.params]
        s0, s1 = self.group.shard_range(rank)
        device = comm.mesh.device()
        self.shard = torch.zeros(s1 - s0, dtype=torch.float32, device=device)
        for pc in self.group.pieces(rank):
            p = self.group.params[pc.index]
            a, _ = self.group.span(pc.index)
            if p.is_meta:
                if source is None:
                    raise ValueError(f"{self.group.names[pc.index]} is on the meta device and "
                                     "no value source was given")
                values = read_local(source, spec_of(p), pc.lo - a, pc.hi - a, device)
            else:
                values = p.detach().reshape(-1)[pc.lo - a : pc.hi - a]
            self.shard[pc.lo - s0 : pc.hi - s0] = values
        self.grad_shard = torch.zeros_like(self.shard)
        # One full buffer per unit, whose *storage* is resized to 0 when freed and back when
        # gathered (FSDP2's trick): the parameters stay views of it, and so do the weight views
        # autograd saved in forward -- they see the re-gathered values in backward and do not
        # keep freed layers alive in between.
        self.full = torch.empty(self.group.padded, dtype=self.shard.dtype, device=device)
        self._nbytes = self.full.untyped_storage().nbytes()
        for p, v in zip(self.group.params, self.group.views(self.full), strict=True):
            assign(p, v)
        self.handle: Handle | None = None
        self.gathered = True
        self.free()

    def free(self) -> None:
        if self.handle is not None:  # (never free storage a collective is writing into)
            self.handle.wait()
            self.handle = None
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def start_gather(self, comm: Comm) -> None:
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self._nbytes)
        # into .data: filling the buffer must not bump the version counter autograd checks
        self.handle = comm.all_gather(self.full.data, self.shard, self.axis, async_op=True)
        self.gathered = True

    def wait_gathered(self, comm: Comm) -> None:
        self.start_gather(comm)
        if self.handle is not None:
            self.handle.wait()
            self.handle = None


def _units(name: str, named: list[tuple[str, nn.Parameter]], comm: Comm,
           groups: dict[int, str] | None, source: TensorSource | None) -> list[Unit]:
    """One unit per reduction group among ``named`` (``groups``: parameter id -> axis)."""
    if groups is None:
        split = reduction_groups(named)
    else:
        split = {}
        for n, p in named:
            split.setdefault(groups[id(p)], ParamGroup(groups[id(p)])).named.append((n, p))
        split = list(split.values())
    return [Unit(name, g.named, g.axis, comm, source) for g in split]


class Zero3Engine(Engine):
    """Fully sharded data parallelism, each parameter over its group's axis (module docstring)."""

    def __init__(self, model: nn.Module, cfg: TrainSection, comm: Comm,
                 keep_gathered: bool = False, groups: list[ParamGroup] | None = None,
                 source: TensorSource | None = None) -> None:
        """``keep_gathered``: pipeline mode -- parameters are gathered once per step
        (:meth:`gather_all`) and gradients reduce-scattered once, after the last micro-batch.
        ``groups``: reduction groups (default: by each parameter's shard spec).
        ``source``: values of meta parameters (shard-only construction: each rank reads only
        its shard's pieces)."""
        self.model, self.cfg, self.comm = model, cfg, comm
        attach_specs(model, comm.mesh)  # (no-op for parameters a technique already placed)
        self.keep = keep_gathered
        axis_of = None if groups is None else {id(p): g.axis for g in groups for _, p in g.named}
        # one unit per decoder block, in forward order: the layers, then the blocks of the
        # extra training heads (``Transformer.blocks``), each named as the model names it
        named = {id(m): n for n, m in model.named_modules()}
        blocks = ([(named[id(b)], b) for b in model.blocks().values()]
                  if hasattr(model, "blocks") else
                  [(f"layers.{k}", b) for k, b in model.layers.items()])
        in_block = {id(p) for _, blk in blocks for p in blk.parameters()}
        root = [(n, p) for n, p in unique_trainable(list(model.named_parameters()))
                if id(p) not in in_block]
        # (a middle pipeline stage has no root parameters: it has no root unit)
        self.root = _units("root", root, comm, axis_of, source)
        self.units = [
            _units(name, unique_trainable(
                [(f"{name}.{n}", p) for n, p in blk.named_parameters()]), comm, axis_of,
                source)
            for name, blk in blocks
        ]
        if not self.keep:
            model.register_forward_pre_hook(self._root_pre_forward)
            model.register_forward_hook(self._root_post_forward)
            for k, (_, blk) in enumerate(blocks):
                blk.register_forward_pre_hook(self._make_pre_forward(k))
                blk.register_forward_hook(self._make_post_forward(k))
        all_units = [u for u in [*self.root, *(u for us in self.units for u in us)]
                     if u.group.params]
        self.all_units = all_units
        self._unit_of = {id(u.group): u for u in all_units}
        self.reducer = GradReducer(
            comm, STAGES[3], [GradBucket(u.group, u.reduce_axis, comm, STAGES[3], u.grad_shard)
                              for u in all_units],
            lambda: self.reduce_dtype, deferred=self.keep, on_launch=self._on_reduce_launched)
        self.opt = ShardedAdamW(model, cfg, [u.group for u in all_units],
                                [u.shard for u in all_units], [u.grad_shard for u in all_units],
                                comm)
        self.optimizer = self.opt.optimizer

    def _gather(self, units: list[Unit], wait: bool) -> None:
        for u in units:
            u.wait_gathered(self.comm) if wait else u.start_gather(self.comm)

    # -- forward ----------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._gather(self.root, wait=True)
        if self.units:
            self._gather(self.units[0], wait=False)  # prefetch the first layer

    def _root_post_forward(self, module: nn.Module, args: Any, out: Any) -> None:
        # evaluation frees the root, unless a chunked loss reads the head weight next (the
        # model then returns the head's input): ``end_evaluation`` frees it after the loss
        if not torch.is_grad_enabled() and not getattr(module, "emit_hidden", False):
            for u in self.root:
                u.free()

    def end_evaluation(self) -> None:
        if not self.keep:
            for u in self.root:
                u.free()

    def _make_pre_forward(self, k: int):  # noqa: ANN202
        def hook(module: nn.Module, args: Any) -> None:
            self._gather(self.units[k], wait=True)
            if k + 1 < len(self.units):
                self._gather(self.units[k + 1], wait=False)
        return hook

    def _make_post_forward(self, k: int):  # noqa: ANN202
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            for u in self.units[k]:
                u.free()
            if torch.is_grad_enabled() and out.requires_grad:
                out.register_hook(lambda grad: self._pre_backward(k))
        return hook

    # -- backward ---------------------------------------------------------------------
    def _pre_backward(self, k: int) -> None:
        self._gather(self.units[k], wait=True)
        if k > 0:
            self._gather(self.units[k - 1], wait=False)  # next in backward order

    # -- pipeline mode: gathered for the whole step --------------------------------------
    def begin_step(self) -> None:
        if self.keep:
            self.gather_all()

    def end_forward_only(self) -> None:
        if self.keep:
            self.release_all()

    def gather_all(self) -> None:
        self._gather(self.all_units, wait=False)
        self._gather(self.all_units, wait=True)

    def release_all(self) -> None:
        for u in self.all_units:
            u.free()

    def _on_reduce_launched(self, b: GradBucket) -> None:
        self._unit_of[id(b.group)].free()  # its gradients are on their way: drop the whole

    def set_sync(self, sync: bool) -> None:
        self.reducer.sync = sync

    def finish_grads(self) -> None:
        pending = [self._unit_of[id(b.group)].name for b in self.reducer.pending()]
        if pending:
            raise RuntimeError(f"ZeRO-3: units {pending} did not receive all their gradients")
        self.reducer.finish()

    # -- step ---------------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float) -> float:
        return self.opt.clip_grad_norm(max_norm)

    def grad_tensors(self) -> list[torch.Tensor]:
        return [u.grad_shard for u in self.all_units]

    def step(self, lr: float) -> None:
        self.opt.step(lr)

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def state_bytes(self) -> dict[str, int]:
        units = self.all_units
        return {
            "params": sum(u.shard.numel() * u.shard.element_size() for u in units),
            "grads": sum(u.grad_shard.numel() * u.grad_shard.element_size() for u in units),
            "optim": self.opt.state_bytes(),
        }

    def owned(self) -> list[Owned]:
        return self.opt.owned()
