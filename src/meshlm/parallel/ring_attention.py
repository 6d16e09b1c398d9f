"""Ring attention over the cp axis (Liu et al. 2023), with zigzag load balancing.

Each cp rank holds the queries, keys and values of its share of the sequence. Queries stay;
key/value blocks travel around the ring ``r -> r + 1``: at step i rank r holds the K/V of rank
``r - i``. The next block's send/receive is posted before the current block is computed, so
the transfer overlaps the compute. Partial outputs merge by their log-sum-exp
(``attention_blocks.merge``); causal blocks that would be fully masked are skipped.

Shares of a sequence of ``s`` tokens split into ``2 cp`` chunks of ``c = s / (2 cp)``:

- ``ring``: rank r holds the contiguous chunks 2r, 2r + 1. It attends to its own block
  (causal) and to every earlier rank's (full); later ranks' blocks are masked. Rank r computes
  ``4 r + 3`` tiles of c x c: the last rank does 2 cp + 1 times the first one's work.
- ``zigzag`` (Megatron's load-balanced chunks, ring-flash-attention's zigzag): rank r holds
  chunks r and 2 cp - 1 - r. Own block: causal over both chunks (3 tiles). An earlier rank's
  block: all queries on its first chunk (2 tiles); a later rank's: the second query chunk on
  both of its chunks (2 tiles). Every rank computes ``2 cp + 1`` tiles.

Backward runs the ring again: K/V travel ``cp - 1`` hops as in forward; rank r first computes
its own block's gradients while the first hop is in flight; each foreign block's dK/dV are
added to a fp32 accumulator that travels with it and reaches its owner after ``cp - 1`` hops.

Communication per attention layer and micro-batch (comm log; ``kv`` = bytes of this rank's
K and V, ``2 b (nkv/tp) (s/cp) hd`` elements in the activation dtype -- with multi-head latent
attention ``b (nh/tp) (s/cp) (nope + rope + v)``: per-head keys and values, not the latent,
travel): forward ``cp - 1``
sends of ``kv`` (K and V as two messages per hop); backward ``cp - 1`` sends of ``kv`` and
``cp - 1`` sends of the fp32 dK/dV accumulator (``kv`` bytes in fp32, one message) -- each
matched by a receive of the same size.
The blocks run through the model's attention kernel (``models/attention.py``: its ``block``
and ``block_backward``), each given the :class:`~meshlm.models.attention.Mask` of its rows:
their global positions (so a sliding window cuts blocks exactly as in one process) and, with
document masking, their document ids (every rank's share, computed locally from the batch: no
communication). A block where no query may see any key is skipped, forward and backward: by
position (the window passes most foreign blocks by), and by documents (short documents skip
most foreign blocks). Both are decided on the host, so the ring never waits for the device:
positions are known there, and the ids' host copy (the data pipeline's tensor,
``models.llama.host_copy``) gives :meth:`Ring.documents_seen`, once per micro-batch (ids
without a host copy are read from the device instead: one wait per block).

Memory per rank: three K/V blocks (own, current, next) and the fp32 output and
log-sum-exp of its s/cp queries; backward adds fp32 dq, dK/dV and three accumulators (the
one being filled, the one in flight, the one arriving: the price of overlapping them) -- all
O(s/cp), never O(s) and never s x s (the ``flash`` kernel materialises no scores; ``math``
one block of (s/cp)^2 or (s/cp) x c per head).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..distributed.comm import Comm
from ..models.attention import AttentionKernel, Mask
from ..models.attention_blocks import merge
from ..models.replay import replaying

AXIS = "cp"
ALL = slice(None)
Seen = dict[tuple[int, int], bool]  # Ring.documents_seen: (source rank, block) -> documents meet


@dataclass
class Block:
    """Which local query rows attend to which rows of a K/V block, and whether causally."""

    q: slice
    kv: slice
    causal: bool
    tiles: int  # c x c tiles computed (c = s / (2 cp))


def block_plan(rank: int, source: int, local: int, zigzag: bool) -> list[Block]:
    """Blocks rank ``rank`` computes with the K/V of rank ``source`` (``local`` rows each)."""
    half = local // 2
    if source == rank:
        return [Block(ALL, ALL, True, 3)]
    if not zigzag:
        return [Block(ALL, ALL, False, 4)] if source < rank else []
    if source < rank:  # its second chunk lies after both of ours: only its first chunk
        return [Block(ALL, slice(0, half), False, 2)]
    return [Block(slice(half, None), ALL, False, 2)]  # only our second chunk sees it


def documents_meet(ids: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, window: int) -> bool:
    """Whether some query sees some key by documents: in some row, the same document id, the
    key at or before the query and, with a ``window``, fewer than ``window`` positions before
    it -- ``Mask.dense(...).any()``, on the host. ``ids``: (B, S) document ids of the whole
    sequences; ``q_pos`` / ``k_pos``: the rows' positions (columns of ``ids``)."""
    if not len(q_pos) or not len(k_pos):
        return False
    s = ids.shape[1]
    docs = ids.astype(np.int64) - int(ids.min())
    # every (row, document, position) as one integer, ordered by row, then document, position
    rows = np.arange(ids.shape[0], dtype=np.int64)[:, None] * ((int(docs.max()) + 1) * s)
    keys = np.sort((rows + docs[:, k_pos] * s + k_pos).ravel())
    q = q_pos.astype(np.int64)
    first = np.maximum(q - window + 1, 0) if window else np.zeros_like(q)
    doc_start = rows + docs[:, q_pos] * s
    # keys of the query's document at positions [first, q]
    seen = (np.searchsorted(keys, doc_start + q, side="right")
            > np.searchsorted(keys, doc_start + first, side="left"))
    return bool(seen.any())


def share_positions(seq_len: int, cp: int, rank: int, mode: str) -> np.ndarray:
    """Global positions (ascending) of cp rank ``rank``'s tokens of a ``seq_len`` sequence."""
    if mode == "zigzag":
        c = seq_len // (2 * cp)
        return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                               np.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
    n = seq_len // cp
    return np.arange(rank * n, (rank + 1) * n)


class Ring:
    """This rank's place on the cp ring, the default kernel, and the tiles computed (a
    counter)."""

    def __init__(self, comm: Comm, zigzag: bool, kernel: AttentionKernel) -> None:
        self.comm, self.zigzag, self.kernel = comm, zigzag, kernel
        self.size, self.rank = comm.size(AXIS), comm.rank(AXIS)
        self.tiles = 0

    def positions(self, local: int, rank: int) -> np.ndarray:
        """Global positions of cp rank ``rank``'s ``local`` tokens."""
        return share_positions(local * self.size, self.size, rank,
                               "zigzag" if self.zigzag else "ring")

    def exchange(self, send: tuple[torch.Tensor, ...], recv: tuple[torch.Tensor, ...]) -> list:
        """Post ``send`` to the next rank and ``recv`` from the previous one as one group;
        ``[its handle]`` (every rank posts the same sequence of groups: they match in order)."""
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops = [("send", t, nxt) for t in send] + [("recv", t, prev) for t in recv]
        return [self.comm.batch_p2p(ops, AXIS)]

    def plan(self, step: int, local: int) -> list[Block]:
        return block_plan(self.rank, (self.rank - step) % self.size, local, self.zigzag)

    def documents_seen(self, ids: np.ndarray, local: int, window: int) -> Seen:
        """(source rank, index in its plan) -> whether documents let some query of that block
        see some key (:func:`documents_meet`), for every block this rank computes; ``ids``: the
        (B, S) document ids of the whole sequences, on the host."""
        mine = self.positions(local, self.rank)
        seen: Seen = {}
        for source in range(self.size):
            theirs = self.positions(local, source)
            for i, b in enumerate(block_plan(self.rank, source, local, self.zigzag)):
                seen[(source, i)] = documents_meet(ids, mine[b.q], theirs[b.kv], window)
        return seen


def _mask(ring: Ring, kernel: AttentionKernel, ids: list[torch.Tensor] | None, local: int,
          source: int, b: Block, seen: bool | None) -> Mask | None:
    """The mask of block ``b`` (its rows' positions, window and documents); None when no
    query of it may see any key (the block is skipped). ``seen``: whether documents let some
    query see some key (None: unknown on the host)."""
    mask = Mask(ring.positions(local, ring.rank)[b.q], ring.positions(local, source)[b.kv],
                kernel.window,
                None if ids is None else ids[ring.rank][:, b.q],
                None if ids is None else ids[source][:, b.kv])
    if mask.empty():
        return None
    if ids is None:
        return mask
    if seen is None:  # (ids without a host copy: read from the device, a host synchronisation)
        seen = bool(mask.dense(ids[0].device).any())
    return mask if seen else None  # (skipped: no query of this block sees a key of it)


def _seen(seen: Seen | None, source: int, i: int) -> bool | None:
    return None if seen is None else seen[(source, i)]


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _accumulate(total: torch.Tensor | None, rows: slice, value: torch.Tensor,
                full_shape: torch.Size) -> torch.Tensor:
    """``total[:, :, rows] += value`` in fp32; a block covering every row becomes the total."""
    if total is None:
        if rows == ALL:
            return value.float()  # (no copy in fp32)
        total = torch.zeros(full_shape, dtype=torch.float32, device=value.device)
    total[:, :, rows] += value
    return total


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # noqa: ANN001
                ring: Ring, ids: list[torch.Tensor] | None, kernel: AttentionKernel,
                seen: Seen | None) -> torch.Tensor:
        local = q.shape[2]
        out = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        own = cur = (k.contiguous(), v.contiguous())  # (sent as they are)
        for step in range(ring.size):
            works, nxt = [], None
            if step < ring.size - 1:
                nxt = (torch.empty_like(cur[0]), torch.empty_like(cur[1]))
                works = ring.exchange(cur, nxt)
            source = (ring.rank - step) % ring.size
            for i, b in enumerate(ring.plan(step, local)):
                mask = _mask(ring, kernel, ids, local, source, b, _seen(seen, source, i))
                if mask is None:
                    continue  # (no query of this block sees a key of it)
                o, lb = kernel.block(q[:, :, b.q], cur[0][:, :, b.kv], cur[1][:, :, b.kv], mask)
                merge(out[:, :, b.q], lse[:, :, b.q], o, lb)
                ring.tiles += 0 if replaying() else b.tiles  # (counted once per forward)
            _wait(works)
            cur = nxt if nxt is not None else cur
        out = out.to(q.dtype)
        ctx.save_for_backward(q, *own, out, lse)
        ctx.ring, ctx.ids, ctx.kernel, ctx.seen = ring, ids, kernel, seen
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        ids, kernel, seen = ctx.ids, ctx.kernel, ctx.seen
        local = q.shape[2]
        dk_dim = k.shape[-1]  # (values may be of another width than keys)
        acc_shape = (*k.shape[:3], dk_dim + v.shape[-1])  # [dK | dV] of one owner, fp32
        dq = dk = dv = None
        cur = (k, v)
        free: list[torch.Tensor] = []  # accumulators done with, reused
        acc_works: list = []
        acc_sent = acc_recv = None
        for step in range(ring.size):
            works, nxt = [], None
            if step < ring.size - 1:
                nxt = (torch.empty_like(k), torch.empty_like(v))
                works = ring.exchange(cur, nxt)
            grads = None
            if step > 0:  # this block's owner's dK/dV, to travel on
                grads = free.pop().zero_() if free else torch.zeros(
                    acc_shape, dtype=torch.float32, device=q.device)
            source = (ring.rank - step) % ring.size
            for i, b in enumerate(ring.plan(step, local)):
                mask = _mask(ring, kernel, ids, local, source, b, _seen(seen, source, i))
                if mask is None:
                    continue
                gq, gk, gv = kernel.block_backward(dout[:, :, b.q], q[:, :, b.q],
                                                   cur[0][:, :, b.kv], cur[1][:, :, b.kv],
                                                   out[:, :, b.q], lse[:, :, b.q], mask)
                dq = _accumulate(dq, b.q, gq, q.shape)
                if grads is None:  # our own block
                    dk, dv = _accumulate(dk, b.kv, gk, k.shape), _accumulate(dv, b.kv, gv, v.shape)
                else:
                    grads[:, :, b.kv, :dk_dim] += gk
                    grads[:, :, b.kv, dk_dim:] += gv
            if grads is not None:
                _wait(acc_works)  # the accumulator of this block's owner, from the last rank
                if acc_recv is not None:
                    grads += acc_recv
                    free += [acc_recv, acc_sent]
                acc_sent = grads
                acc_recv = free.pop() if free else torch.empty_like(grads)
                acc_works = ring.exchange((acc_sent,), (acc_recv,))
            _wait(works)
            cur = nxt if nxt is not None else cur
        if ring.size > 1:
            _wait(acc_works)  # our own K/V's gradients, home after cp - 1 hops
            dk += acc_recv[..., :dk_dim]
            dv += acc_recv[..., dk_dim:]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                   ids: list[torch.Tensor] | None = None,
                   kernel: AttentionKernel | None = None,
                   seen: Seen | None = None) -> torch.Tensor:
    """Attention of this rank's (B, nh, s/cp, hd) queries on the whole sequence's keys and
    values, which are sharded like the queries over the cp ring, through ``kernel``'s blocks
    (default: the ring's); ``ids``: the document ids (B, s/cp) of every cp rank's share
    (document masking); ``seen``: :meth:`Ring.documents_seen` of those ids with the kernel's
    window (None: each block asks the device)."""
    return _RingAttention.apply(q, k, v, ring, ids, kernel if kernel is not None else ring.kernel,
                                seen)
