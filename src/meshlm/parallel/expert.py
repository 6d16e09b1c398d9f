"""Expert parallelism: each MoE layer's experts split over the ``ep`` ranks, tokens sent to them.

The ``ep`` group is ``ep`` consecutive ranks of the dp x cp group (Megatron-Core's layout; see
``distributed/mesh.py``). Rank j of it keeps experts ``[j E/ep, (j + 1) E/ep)`` of every MoE
layer (``w1``, ``w3``, ``w2`` cut on dim 0: shard spec ``("ep", 0)``); their gradients are summed
over the expert-data-parallel group ``edp`` (the ranks holding the same experts) and divided by
dp x cp, everything else is reduced over dp x cp as before -- so DDP and ZeRO-1/2/3 shard and
reduce each kind over its own group with no expert code. Under tensor parallelism every tp rank
keeps its width slice of its ep rank's experts and exchanges with the ep peers of its tp rank.

Per MoE layer and micro-batch (:class:`ExpertExchange`), after routing on this rank's tokens:

1. the copies per expert are all-gathered over ep on the device (``ep * E`` int64), and every
   split size is read to the host in one transfer (:func:`host_splits`: the layer's one host
   synchronisation per micro-batch; ``all_to_all_single`` takes its splits as Python ints);
2. dispatch: ``all_to_all_single`` sends each token copy (sorted by expert, hence by owner) to
   the rank owning its expert -- dropless, variable splits;
3. the received copies are regrouped by local expert and run as one grouped GEMM
   (``models/moe.py``: ``torch._grouped_mm`` with the local experts' offsets from the device
   count table -- no further synchronisation; one batched matmul for all when capacity slots
   make them equal);
4. combine: a second all-to-all returns the outputs in the order they were sent; the layer then
   weights them by the router and sums them per token as without ep.

Backward mirrors it: two all-to-alls of the same sizes in reverse, no host synchronisation.
Each all-to-all is issued asynchronously and waited through ``overlap.wait``: inside
DualPipeV's overlapped pair the other micro-batch's pass runs while it is in flight
(``overlap.py``); elsewhere the wait follows at once.
Bytes per micro-batch and layer: forward ``T k H`` (this rank's copies) + ``R H`` (the copies
it received), each in the activation dtype; backward the same; ``sum over ep ranks of R =
sum of T k``. With a capacity factor the splits are fixed (``E/ep * B * C`` rows to every
peer), step 1 is skipped and the layer reads nothing to the host.

Memory per rank: expert weights, gradients and optimizer states / ep; activations of the copies
it computes (``T k`` on average).

Also here: the routing-count reducers of the balancing losses (:func:`attach_count_reducers`)
and the end-of-step router statistics, which also drive the auxiliary-loss-free bias
(:func:`router_step`): per MoE layer, the load of every expert, the largest and the mean load,
the experts that got no token, the dropped copies, the aux loss and the balancing bias's
spread (``max - min``), for ``metrics.jsonl``, TensorBoard and ``meshlm report``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..distributed.comm import Comm
from ..distributed.spec import set_spec, spec_of
from ..models.llama import Transformer
from ..models.moe import MoE
from . import overlap

AXIS = "ep"
EXPERT_PARAMS = ("w1", "w3", "w2")


class _AllToAll(torch.autograd.Function):
    """Rows to peers with given splits; the gradient goes back with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, out_splits: list[int],  # noqa: ANN001
                in_splits: list[int]) -> torch.Tensor:
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        overlap.wait(comm.all_to_all(out, x.contiguous(), AXIS, out_splits, in_splits,
                                     async_op=True))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        overlap.wait(ctx.comm.all_to_all(out, grad.contiguous(), AXIS, ctx.in_splits,
                                         ctx.out_splits, async_op=True))
        return out, None, None, None


@dataclass(frozen=True)
class Splits:
    """One MoE layer's exchange sizes for one micro-batch: Python ints where
    ``all_to_all_single`` and the expert loop need them, the regrouping counts on the device."""

    send: list[int]  # copies this rank sends to each ep peer
    recv: list[int]  # copies it receives from each ep peer
    local: list[int]  # copies each of its experts runs, over all sources
    from_peer: torch.Tensor  # (ep, E/ep) on the device: copies per source and local expert


def host_splits(table: torch.Tensor, rank: int, n: int) -> Splits:
    """Every split size from the (ep, E) device table of copies per source rank and expert,
    read to the host in one transfer (the layer's only host synchronisation)."""
    size = table.shape[0]
    send = table[rank].view(size, n).sum(dim=1)  # (ep,): to each peer
    from_peer = table[:, rank * n:(rank + 1) * n]  # (ep, n): for my experts, per source
    sizes = torch.cat([send, from_peer.sum(dim=1), from_peer.sum(dim=0)]).tolist()
    return Splits(sizes[:size], sizes[size:2 * size], sizes[2 * size:], from_peer)


def fixed_splits(counts: list[int], size: int, device: torch.device) -> Splits:
    """Capacity slots: every rank sends every expert the same ``counts`` (equal per expert),
    so the sizes are known on the host without any exchange or transfer."""
    if len(set(counts)) != 1:
        raise ValueError(f"fixed splits need equal copies per expert, got {counts}")
    n, c = len(counts) // size, counts[0]
    return Splits([n * c] * size, [n * c] * size, [size * c] * n,
                  torch.full((size, n), c, dtype=torch.long, device=device))


class ExpertExchange:
    """Send sorted token copies to their experts' ranks, run the local experts, send back."""

    def __init__(self, comm: Comm, n_experts: int) -> None:
        self.comm = comm
        self.size, self.rank = comm.size(AXIS), comm.rank(AXIS)
        self.local = n_experts // self.size

    def count_table(self, counts: torch.Tensor) -> torch.Tensor:
        """(ep, E) copies each ep rank sends to each expert: ``counts`` (E,) all-gathered on
        the device."""
        table = torch.empty(self.size * counts.numel(), dtype=torch.long, device=counts.device)
        self.comm.all_gather(table, counts.to(torch.long).contiguous(), AXIS)
        return table.view(self.size, counts.numel())

    def splits(self, counts: torch.Tensor | list[int], fixed: bool,
               device: torch.device) -> Splits:
        if fixed:
            return fixed_splits(list(counts), self.size, device)
        return host_splits(self.count_table(counts), self.rank, self.local)

    def __call__(self, moe: MoE, x_sorted: torch.Tensor, counts: torch.Tensor | list[int],
                 fixed: bool) -> torch.Tensor:
        n = self.local
        sp = self.splits(counts, fixed, x_sorted.device)
        received = _AllToAll.apply(x_sorted, self.comm, sp.recv, sp.send)
        # received rows: source-major, then local expert; the experts want expert-major
        expert_of = torch.arange(n, device=x_sorted.device).repeat(self.size)
        expert_of = expert_of.repeat_interleave(sp.from_peer.reshape(-1),
                                                output_size=sum(sp.recv))  # (no sync)
        order = torch.argsort(expert_of, stable=True)
        # rows per local expert: the device table's (the grouped GEMM's offsets, no transfer),
        # or the capacity slots' equal Python ints (one batched matmul)
        counts = sp.local if fixed else sp.from_peer.sum(dim=0)
        out = moe.experts(received[order], counts, max_count=max(sp.local, default=0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(out[back], self.comm, sp.send, sp.recv)


def apply_expert_parallel(model: Transformer, comm: Comm) -> None:
    """Keep this ep rank's experts of every MoE layer and route their tokens (module doc)."""
    ep, rank = comm.size(AXIS), comm.rank(AXIS)
    for layer in model.blocks().values():  # (the training heads' blocks too)
        moe = layer.feed_forward
        if not isinstance(moe, MoE):
            continue
        if moe.n_experts % ep:
            raise ValueError(f"parallel.ep={ep} does not divide the {moe.n_experts} experts")
        for name in EXPERT_PARAMS:
            p = getattr(moe.experts, name)
            spec = spec_of(p).shard(AXIS, 0, rank, ep)
            per = moe.n_experts // ep  # (dim 0 is whole here: tp cuts the width)
            p.data = p.data.narrow(0, rank * per, per).contiguous()
            kept = tuple(a for a in spec.replicated if a not in ("dp", "cp"))
            set_spec(p, replace(spec, reduce_axis="edp",
                                replicated=(*kept, "edp") if comm.size("edp") > 1 else kept))
        moe.exchange = ExpertExchange(comm, moe.n_experts)


# ---------------------------------------------------------------------- routing statistics
def attach_count_reducers(model: Transformer, comm: Comm) -> None:
    """Balancing losses over more than this rank's tokens: ``aux`` counts summed over the
    global micro-batch (dp x cp), ``seq_aux`` each sequence's counts over its cp shares.
    (Only training forwards reduce: evaluation and generation compute no aux loss.)"""
    data, cp = comm.size("dp_cp"), comm.size("cp")

    def over(axis: str, size: int):  # noqa: ANN202
        def reduce(counts: torch.Tensor) -> tuple[torch.Tensor, int]:
            counts = counts.clone()
            comm.all_reduce(counts, axis)
            return counts, size
        return reduce

    for layer in model.blocks().values():
        if isinstance(moe := layer.feed_forward, MoE):
            moe.reduce_counts = (over("dp_cp" if cp > 1 else "dp", data) if data > 1
                                 else None)
            moe.reduce_seq_counts = over("cp", cp) if cp > 1 else None


def moe_layers(model: Transformer) -> dict[int, MoE]:
    """This rank's MoE layers by global layer index (the training heads' blocks follow the
    layers: ``n_layers`` and up)."""
    return {k: layer.feed_forward for k, layer in model.blocks().items()
            if isinstance(layer.feed_forward, MoE)}


# columns of router_step's table after the E loads
DROPPED, AUX, BIAS_SPREAD, MICRO_BATCHES = range(4)


def router_step(model: Transformer, comm: Comm, n_blocks: int, n_experts: int
                ) -> dict[str, Any]:
    """End of a step: each MoE layer's load over the global batch, its auxiliary-loss-free
    bias update, and the statistics for ``metrics.jsonl`` (every rank gets every layer's;
    ``n_blocks``: the model's layers and the training heads' blocks, ``ModelConfig.n_blocks``).

    One all-reduce of ``n_blocks x (E + 4)`` float64 over dp x cp (the global batch of this
    stage's layers), one over pp (the other stages' layers); logged as metrics traffic. The
    table is filled on the device and read to the host once, after both.
    """
    layers = moe_layers(model)
    e = n_experts
    table = torch.zeros(n_blocks, e + 4, dtype=torch.float64, device=comm.mesh.device())
    for i, moe in layers.items():
        st = moe.stats
        if st.load is not None:
            table[i, :e] = st.load.to(table)
        row = table[i, e:]
        row[DROPPED] = st.dropped
        row[AUX] = st.aux
        row[MICRO_BATCHES] = st.micro_batches
        st.reset()
    comm.all_reduce(table, "dp_cp", purpose="metrics")
    for i, moe in layers.items():
        moe.update_bias(table[i, :e])
        if moe.expert_bias is not None:  # (the same on every dp x cp rank: one stage's row)
            table[i, e + BIAS_SPREAD] = moe.expert_bias.max() - moe.expert_bias.min()
    comm.all_reduce(table, "pp", purpose="metrics")
    table = table.cpu()
    out: dict[str, Any] = {}
    for i in range(n_blocks):
        load, row = table[i, :e], table[i, e:]
        if row[MICRO_BATCHES] == 0:  # not an MoE layer
            continue
        mean, top = float(load.mean()), float(load.max())
        out[str(i)] = {
            "tokens_per_expert": [int(x) for x in load.tolist()],
            "max_load": int(top),
            "mean_load": mean,
            "max_over_mean": top / mean if mean else 0.0,
            "idle_experts": int((load == 0).sum()),
            "dropped": int(row[DROPPED]),
            "aux_loss": float(row[AUX]) / float(row[MICRO_BATCHES]),
            **({"bias_spread": float(row[BIAS_SPREAD])}
               if model.cfg.moe_balance == "bias" else {}),
        }
    return out


def router_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per MoE layer over a run's metrics records: mean and last max/mean load, dropped
    fraction, mean aux loss, mean and last count of experts that got no token, and the last
    balancing-bias spread (the rows a report prints; fields a record lacks count as 0)."""
    out: dict[str, dict[str, float]] = {}
    rows = [r["router"] for r in records if isinstance(r.get("router"), dict)]
    for layer in (rows[0] if rows else {}):
        series = [r[layer] for r in rows if layer in r]
        copies = sum(sum(s["tokens_per_expert"]) for s in series)
        idle = [s.get("idle_experts", sum(1 for x in s["tokens_per_expert"] if x == 0))
                for s in series]
        out[layer] = {
            "max_over_mean_mean": sum(s["max_over_mean"] for s in series) / len(series),
            "max_over_mean_last": series[-1]["max_over_mean"],
            "dropped_fraction": sum(s["dropped"] for s in series) / copies if copies else 0.0,
            "aux_loss_mean": sum(s["aux_loss"] for s in series) / len(series),
            "idle_experts_mean": sum(idle) / len(idle),
            "idle_experts_last": idle[-1],
            "bias_spread_last": series[-1].get("bias_spread", 0.0),
        }
    return out


def router_text(summary: dict[str, dict[str, float]]) -> str:
    """One line per MoE layer of :func:`router_summary`."""
    return "\n".join(
        f"layer {k}: max/mean load {v['max_over_mean_mean']:.2f} (last {v['max_over_mean_last']:.2f}),"
        f" idle experts {v['idle_experts_mean']:.1f} (last {v['idle_experts_last']:.0f}),"
        f" dropped {100 * v['dropped_fraction']:.1f}%, aux loss {v['aux_loss_mean']:.4g}"
        + (f", bias spread {v['bias_spread_last']:.3g}" if v["bias_spread_last"] else "")
        for k, v in summary.items())
