"""ZeRO stages 0-3 as the planner sees them (torch-free): what a rank holds, what it sends.

The stages themselves are :mod:`.data` (0: DDP), :mod:`.zero` (1, 2), :mod:`.zero3` (3) and
:mod:`.grad_reduce` (hybrid sharding); ``parallel.zero`` accepts exactly the names here.

**States** (Rajbhandari et al. 2020, "ZeRO", sec. 3 and fig. 1). With Ψ parameters on a rank
and N data-parallel ranks sharing them, bytes per parameter of weights / gradients / optimizer
states ``(w, g, o)``: stage 0 holds ``(w + g + o) Ψ``; stage 1 ``(w + g) Ψ + o Ψ / N``; stage 2
``w Ψ + (g + o) Ψ / N``; stage 3 ``(w + g + o) Ψ / N``. N is dp x cp, or under hybrid sharding
(HSDP, ``parallel.dp_shard`` < dp) one shard group of dp_shard x cp ranks whose dp / dp_shard
replicas hold the same shards; routed experts are sharded over N / ep (Megatron-Core's expert
data parallelism). A stage that shards anything owns 1 / N of the optimizer state: what its
optimizer step touches and what it writes at a checkpoint.

**Buffers**: ZeRO-2's two transient gradient buckets (``min(bucket, g Ψ)`` each, the
``parallel.bucket_mb`` default); ZeRO-3's gathered parameters and gradients of two layers plus
the root unit (embedding, final norm, head: ``zero3.py`` prefetches one layer ahead) or, for
DeepSpeed, at most ``stage3_max_live_parameters`` (1e9, DeepSpeed's default) live: two
gathered layers and one gradient.

**Communication** per step over the N ranks (gradient bytes G, weight bytes W = w Ψ, m
micro-batches; the comm log's bytes, the formulas of ``data.py``, ``zero.py``, ``zero3.py``):

- stage 0: G all-reduced once, bucketed beside the last micro-batch's backward (Li et al.
  2020); exposed: what exceeds that backward;
- stage 1: G reduce-scattered once beside the last backward; W all-gathered after the
  optimizer step: exposed;
- stage 2: G reduce-scattered every micro-batch, beside each backward; W all-gathered: exposed;
- stage 3: every micro-batch, each layer's weights gathered twice (forward and backward:
  ``2 W_layers`` plus the root unit once) prefetched one layer ahead, and G reduce-scattered in
  flight: forward gathers hide behind the forward, backward gathers and reduce-scatters behind
  the backward, the first layer's gather never;
- hybrid sharding: once per step each rank all-reduces its gradient shard (G / N) with the
  ``dp_rep`` ranks holding the same shard, as each bucket's reduction completes
  (``grad_reduce.py``): beside the last backward like DDP's buckets (``over="replica"``).

A stage that shards anything makes the gradients differ over dp: the clipping norm is summed
over dp x cp (one 8-byte all-reduce, counted by the planner).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Collective, Registry

BUCKET_BYTES = 25 * 2**20  # parallel.bucket_mb default (DDP, ZeRO-1/2)
MAX_LIVE_PARAMS = 1e9  # DeepSpeed ZeRO-3 stage3_max_live_parameters default (DeepSpeed docs)
STATES = ("params", "grads", "optim")


@dataclass(frozen=True)
class ZeroCost:
    """One ZeRO stage's cost, as the planner reads it (see the module docstring)."""

    name: int
    doc: str
    sharded: frozenset[str] = frozenset()  # of STATES: split over the N ranks
    buckets: int = 0  # transient gradient buckets of BUCKET_BYTES (ZeRO-2)
    gathers_layers: bool = False  # weights gathered layer by layer each micro-batch (ZeRO-3)
    scatter_each_micro_batch: bool = False  # gradients reduce-scattered every micro-batch

    @property
    def shards(self) -> bool:
        """Whether any state is sharded (stage >= 1): the rank owns 1 / N of the optimizer."""
        return bool(self.sharded)

    def owners(self, n: int) -> int:
        """Ranks one parameter's optimizer state is split over, of a group of ``n``."""
        return n if self.shards else 1

    def states(self, dense: float, expert: float, n_dense: int, n_expert: int,
               bytes_per: tuple[float, float, float]) -> dict[str, float]:
        """Bytes of weights, gradients and optimizer states (``bytes_per``: (w, g, o)) of
        ``dense`` parameters sharded over ``n_dense`` ranks and ``expert`` ones over
        ``n_expert``."""
        out = {}
        for name, per in zip(STATES, bytes_per, strict=True):
            split = name in self.sharded
            out[name] = (dense * per / (n_dense if split else 1)
                         + expert * per / (n_expert if split else 1))
        return out

    def buffers(self, total: float, layer_unit: float, root_unit: float, w: float, g: float,
                deepspeed: bool = False) -> float:
        """Transient bytes beside the states: buckets and gathered layers (module docstring);
        ``total``, ``layer_unit``, ``root_unit``: parameters of the rank, of its largest layer
        and of its root unit."""
        out = 0.0
        if self.buckets:
            out += self.buckets * min(BUCKET_BYTES, total * g)
        if self.gathers_layers and not deepspeed:
            out += (2 * layer_unit + root_unit) * w + 2 * layer_unit * g
        elif self.gathers_layers:  # one prefetched
            live = min(layer_unit, MAX_LIVE_PARAMS)
            out += 2 * live * w + live * g
        return out

    def collectives(self, grads: float, params: float, layer_params: float, root: float,
                    w: float, m: int, n: int, replicas: int = 1) -> list[Collective]:
        """One step's data-parallel messages for ``params`` parameters (``grads``: their
        gradient bytes on the wire; ``layer_params`` of them in layers, ``root`` in the root
        unit; ``w`` bytes per weight) over ``n`` ranks, ``replicas`` copies of the group
        (hybrid sharding)."""
        out = []
        if replicas > 1 and self.shards:  # this rank's gradient shard, across the replicas
            out.append(Collective("all_reduce", grads / n, 1, "last_backward", "replica"))
        if n == 1:
            return out
        if not self.shards:
            out.append(Collective("all_reduce", grads, 1, "last_backward"))
        elif self.gathers_layers:
            out.append(Collective("all_gather", (2 * layer_params + root) * w, m, "zero3"))
            out.append(Collective("reduce_scatter", grads, m, "zero3"))
        else:
            each = self.scatter_each_micro_batch
            out.append(Collective("reduce_scatter", grads, m if each else 1,
                                  "each_backward" if each else "last_backward"))
            out.append(Collective("all_gather", params * w, 1, "exposed"))
        return out


ZERO: Registry[ZeroCost] = Registry("ZeRO stage")
ZERO.register(ZeroCost(0, "DDP: every rank holds every state; gradients all-reduced"))
ZERO.register(ZeroCost(1, "optimizer states sharded", frozenset({"optim"})))
ZERO.register(ZeroCost(2, "optimizer states and gradients sharded",
                       frozenset({"optim", "grads"}), buckets=2, scatter_each_micro_batch=True))
ZERO.register(ZeroCost(3, "optimizer states, gradients and weights sharded (FSDP)",
                       frozenset(STATES), gathers_layers=True))

__all__ = ["BUCKET_BYTES", "MAX_LIVE_PARAMS", "ZERO", "ZeroCost"]
