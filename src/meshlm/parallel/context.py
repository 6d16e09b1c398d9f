"""Context parallelism: every sequence split over the cp ranks, end to end.

Each cp rank holds a share of every sequence of its micro-batches for *all* the work: the
embedding, norms, MLPs and the loss run on its tokens only, so activation memory per rank
falls by cp. Only attention needs the other ranks' tokens; ``parallel.cp_attention`` picks how:

- ``zigzag`` (default): ring attention with load-balanced chunks -- rank r holds chunks r and
  2 cp - 1 - r of 2 cp (``ring_attention.py``);
- ``ring``: ring attention with one contiguous chunk per rank (unbalanced under the causal
  mask: the last rank computes 2 cp + 1 times the first one's tiles);
- ``ulysses``: all-to-all from sequence shards to head shards and back (``ulysses.py``).

The shares are given by :meth:`ContextParallel.positions`: the global positions of this rank's
tokens. The sampler reads only those tokens (inputs and targets), the rotary tables are taken
at those positions, and each rank's loss is the mean over its tokens (all shares are equal, so
the mean over cp ranks is the sequence mean). Weights are replicated over cp: their gradients
are averaged over dp x cp together (the ``dp_cp`` axis; ZeRO shards over it), as Megatron-Core
does, and each rank's gradients include the other ranks' losses through the dK/dV (ring) or
all-to-all (Ulysses) backward. Mixture-of-Experts layers add their routing counts over cp so the
load-balancing loss is the whole sequence's (``expert.attach_count_reducers``).

Extra training heads (``models/heads.py``): their blocks' attention is context parallel like
the main blocks'; an objective that reads the tokens ahead of a rank's positions (they lie in
other ranks' shares) rebuilds the step's whole target sequences with
:meth:`ContextParallel.gather_shares` (one all-gather over cp of ``G b s / cp`` int64 per step;
the objective states it, ``parallel/objective.py``).

Communication: see the two attention modules. Memory: activations / cp; the rotary
tables of the positions in use; with document masking, which ring blocks the last micro-batch's
documents leave something in (one flag per block, decided on the host: no device read).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from ..distributed.comm import Comm
from ..distributed.host_sync import host_array
from ..layout import CP_MODES
from ..models.attention import ATTENTION, SDPA, AttentionKernel, EagerAttention, build_kernel
from ..models.llama import Transformer, host_copy
from .ring_attention import Ring, Seen, block_plan, ring_attention, share_positions
from .ulysses import ulysses_attention

AXIS = "cp"


def check_mode(mode: str) -> None:
    if mode not in CP_MODES:
        raise ValueError(f"parallel.cp_attention={mode!r} is not one of {', '.join(CP_MODES)}")


# the block paths of the plain kernels, by their old names (a ring's kernel may be given so)
_BLOCK_PATHS = {"flash": SDPA, "math": EagerAttention}


def _default_kernel(kernel: str | AttentionKernel | None) -> AttentionKernel:
    if isinstance(kernel, AttentionKernel):
        return kernel
    if kernel in _BLOCK_PATHS:
        return _BLOCK_PATHS[kernel]()
    if kernel is None:
        return SDPA()
    if kernel not in ATTENTION:
        raise ValueError(f"attention kernel {kernel!r} is not one of "
                         f"{', '.join((*ATTENTION.names(), *_BLOCK_PATHS))}")
    return build_kernel(kernel)


class ContextParallel:
    """This rank's share of every sequence and its attention over the cp group, composed
    around an attention kernel (``models/attention.py``): Ulysses runs the kernel on whole
    sequences of 1/cp of the heads, the ring runs its blocks and merges them.

    ``kernel``: the kernel :meth:`attention` uses when it is given none (a name, or ``flash``
    / ``math`` for ``sdpa``'s / ``eager``'s block paths); the model's kernel is given by
    :class:`ContextParallelAttention`."""

    def __init__(self, comm: Comm, mode: str, kernel: str | AttentionKernel | None = None,
                 max_len: int = 0) -> None:
        check_mode(mode)
        self.comm, self.mode = comm, mode
        self.max_len = max_len  # the model's max_seq_len: no position reaches it (0: unchecked)
        self.size, self.rank = comm.size(AXIS), comm.rank(AXIS)
        self.kernel = _default_kernel(kernel)
        self.ring = Ring(comm, mode == "zigzag", self.kernel)
        self.enabled = True
        self._positions: dict[tuple[int, str], torch.Tensor] = {}
        # the ring's documents_seen of the last document ids: (their host tensor, key, table)
        self._seen: tuple[torch.Tensor, tuple[int, int], Seen] | None = None

    # -- shares ------------------------------------------------------------------------------
    def positions(self, seq_len: int) -> np.ndarray:
        """Global positions of this rank's tokens of a whole sequence of ``seq_len``."""
        return share_positions(seq_len, self.size, self.rank, self.mode)

    def local_positions(self, local_len: int, device: torch.device) -> torch.Tensor | None:
        """Positions of the ``local_len`` tokens this rank holds (None when cp is off: the
        tokens are then the whole sequence, positions 0 ... local_len - 1)."""
        if not self.enabled:
            return None
        key = (local_len, str(device))
        if key not in self._positions:
            pos = self.positions(local_len * self.size)
            if self.max_len and int(pos[-1]) >= self.max_len:  # (checked here, on the host)
                raise ValueError(f"sequence length {int(pos[-1]) + 1} (context-parallel share "
                                 f"at positions up to {int(pos[-1])}) exceeds max_seq_len "
                                 f"{self.max_len}")
            self._positions[key] = torch.from_numpy(pos).to(device)
        return self._positions[key]

    def gather_shares(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequences from every cp rank's share of them: (..., s/cp) -> (..., s) along
        the last dim (an extra training objective reads the tokens ahead of its positions). One
        all-gather over cp of ``x`` (contiguous, this rank's device); no gradient."""
        n = self.size
        if not self.enabled or n == 1:
            return x
        every = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
        self.comm.all_gather(every, x.contiguous().view(-1), AXIS)
        shares = every.view(n, *x.shape)
        s = n * x.shape[-1]
        order = torch.from_numpy(np.concatenate([share_positions(s, n, r, self.mode)
                                                 for r in range(n)])).to(x.device)
        whole = torch.empty((*x.shape[:-1], s), dtype=x.dtype, device=x.device)
        whole[..., order] = torch.cat(list(shares.unbind(0)), dim=-1)
        return whole

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's share of a whole-sequence tensor (its tokens along ``dim``)."""
        if not self.enabled or self.size == 1:
            return x
        idx = torch.from_numpy(self.positions(x.shape[dim])).to(x.device)
        return x.index_select(dim, idx)

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Every cp rank runs whole sequences alone (generation: prompts of any length)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    # -- attention ---------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  doc_ids: torch.Tensor | None = None, kernel: AttentionKernel | None = None
                  ) -> torch.Tensor:
        """Attention of this rank's (B, nh, s/cp, hd) queries on the whole sequence through
        ``kernel`` (default: this helper's); ``doc_ids`` (B, s): the whole sequences' document
        ids (document masking)."""
        kernel = kernel if kernel is not None else self.kernel
        if not self.enabled:
            return kernel(q, k, v, *(() if doc_ids is None else (doc_ids,)))
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, self.comm, doc_ids, kernel)
        ids, seen = None, None
        if doc_ids is not None:
            s = doc_ids.shape[1]
            ids = [doc_ids[:, torch.from_numpy(share_positions(s, self.size, r, self.mode))
                           .to(doc_ids.device)] for r in range(self.size)]
            seen = self._documents_seen(doc_ids, q.shape[2], kernel.window)
        return ring_attention(q, k, v, self.ring, ids, kernel, seen)

    def _documents_seen(self, doc_ids: torch.Tensor, local: int, window: int) -> Seen | None:
        """Which ring blocks documents leave something to compute in (``Ring.documents_seen``),
        from the host copy of ``doc_ids`` -- no device read; once per micro-batch (every layer
        reuses it). None when the ids have no host copy."""
        host = host_copy(doc_ids)
        if host is None:
            return None
        key = (local, window)
        if self._seen is None or self._seen[0] is not host or self._seen[1] != key:
            self._seen = (host, key, self.ring.documents_seen(host_array(host), local, window))
        return self._seen[2]

    def tiles(self) -> int:
        """c x c attention tiles (c = s / (2 cp)) this rank's ring forwards computed so far."""
        return self.ring.tiles

    def reset_tiles(self) -> None:
        self.ring.tiles = 0


class ContextParallelAttention(nn.Module):
    """Context parallelism around an attention kernel: ``cp``'s ring / zigzag / Ulysses
    attention running ``inner`` (the model's registered kernel)."""

    compilable = False  # eager exchange with data-dependent shapes: kept out of compiled graphs

    def __init__(self, cp: ContextParallel, inner: AttentionKernel) -> None:
        super().__init__()
        self.cp, self.inner = cp, inner
        self.name = cp.mode

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.cp.attention(q, k, v, doc_ids, self.inner)

    def extra_repr(self) -> str:
        return f"{self.cp.mode}, cp={self.cp.size}"


def apply_context_parallel(model: Transformer, comm: Comm, mode: str,
                           kernel: str | None = None) -> ContextParallel:
    """Make ``model`` run on this rank's share of each sequence (see module docstring): its
    positions. Its attention context, ``mode``, is one of the choices applied together by
    ``extensions.apply_choices`` (with this helper as ``cp``), around the model's kernel."""
    cp = ContextParallel(comm, mode, kernel, max_len=model.cfg.max_seq_len)
    model.positions = cp.local_positions
    return cp


def tiles_per_rank(mode: str, cp: int) -> list[int]:
    """c x c tiles each cp rank computes in one ring attention forward (ring modes)."""
    zigzag = mode == "zigzag"
    return [sum(b.tiles for src in range(cp) for b in block_plan(r, src, 2, zigzag))
            for r in range(cp)]


def context_summary(mode: str, cp: int, seq_len: int) -> str:
    """One start-up log line: the mode, each rank's share and work per attention forward."""
    line = f"context parallel: cp={cp} {mode}, {seq_len // cp} tokens of each sequence per rank"
    if mode == "ulysses":
        return line + " (all-to-all to 1/cp of the heads over the whole sequence)"
    c = seq_len // (2 * cp)
    tiles = ", ".join(str(t) for t in tiles_per_rank(mode, cp))
    return line + f"; attention tiles of {c} x {c} per layer forward, by cp rank: {tiles}"
