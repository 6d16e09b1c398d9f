"""Which token windows each training step and each data-parallel rank sees.

The batch of global step k is a pure function of (seed, k): ``global_batch`` windows of
``seq_len + 1`` tokens at offsets drawn from a generator seeded with ``[seed, b]``, where
batch b is k itself unless batches are skipped (``train.skip_batches``, or a rollback after a
non-finite step): step k then takes the k-th batch not in the skip list. So a
resumed run continues exactly (only the next step number is state), and every parallel
layout sees the same data: rank r of dp takes the contiguous rows
``[r * global/dp, (r + 1) * global/dp)`` and splits them into micro-batches in order; under
context parallelism each cp rank reads only the positions of its share of every row.

A mixture (``data.mix``) has several sources, each a token stream with a weight: the batch of
step k takes ``floor(G c_i + u) - floor(G c_{i-1} + u)`` sequences from source i (``c`` the
cumulative weights, ``u`` uniform from the same generator: systematic sampling, so every batch
holds each source within one sequence of its share and the expected share is exact), in an
order shuffled by that generator, each at a uniform offset of its source. One source draws
exactly what it drew before mixtures existed.

Document masking (``data.doc_mask``): each micro-batch also carries the document ids (B, S) of
its whole sequences, looked up in the source's document starts (``doc_starts``; ids relative
to each row's first document), so the model masks attention at document boundaries; with
``target_docs`` (an extra training objective's rule, ``parallel/objective.py``) also those of
their targets (B, S), numbered alike (the window's last token may open the next document).

Memory: drawing offsets costs ``global_batch`` integers; only the rows a rank needs are read
from the (memory-mapped) token streams, ``micro * (seq_len + 1)`` tokens per micro-batch, and
their document ids (``micro * seq_len`` int32; twice with ``target_docs``) under document
masking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import ConfigError


@dataclass
class Source:
    """One token stream of the training data: tokens (anything with ``len`` and numpy fancy
    indexing: a memmap, a prepared dataset's split), its weight in the mixture, and the start
    offset of every document (ascending; needed for document masking)."""

    tokens: Any
    weight: float = 1.0
    doc_starts: np.ndarray | None = None
    name: str = ""


def as_sources(tokens: Any) -> list[Source]:
    """``tokens`` as a list of sources: a list of :class:`Source` as it is, else one source of
    weight 1 (its ``doc_starts`` attribute, when it has one)."""
    if isinstance(tokens, list):
        return tokens
    return [Source(tokens, 1.0, getattr(tokens, "doc_starts", None))]


def doc_ids(doc_starts: np.ndarray, offsets: np.ndarray, seq_len: int) -> torch.Tensor:
    """(len(offsets), seq_len) int32: the document of every position of the windows at
    ``offsets``, numbered from 0 at each row's first token."""
    idx = offsets[:, None] + np.arange(seq_len, dtype=np.int64)
    d = np.searchsorted(doc_starts, idx, side="right")
    return torch.from_numpy((d - d[:, :1]).astype(np.int32))


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> torch.Tensor:
    """LongTensor [len(offsets), seq_len + 1]; fancy indexing reads just these tokens."""
    idx = offsets[:, None] + np.arange(seq_len + 1, dtype=np.int64)
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))


def _shares(tokens: np.ndarray, offsets: np.ndarray, positions: np.ndarray
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) LongTensors [len(offsets), len(positions)] of the windows at
    ``offsets``, at the given positions only (a context-parallel share: just these tokens
    and the ones after them are read)."""
    idx = offsets[:, None] + positions.astype(np.int64)[None, :]
    return (torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64)),
            torch.from_numpy(np.asarray(tokens[idx + 1], dtype=np.int64)))


def _check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if len(tokens) < seq_len + 2:
        raise ConfigError(
            f"{what} has {len(tokens)} tokens; data.seq_len={seq_len} needs at least "
            f"{seq_len + 2} (use more data or a smaller data.seq_len)"
        )


class StepSampler:
    """The global batch of every step from ``tokens`` (one stream, or a list of weighted
    :class:`Source`); ``doc_mask``: micro-batches carry document ids; ``target_docs``: and
    their targets' (with ``doc_mask``)."""

    def __init__(self, tokens: Any, seq_len: int, global_batch: int, seed: int,
                 doc_mask: bool = False, target_docs: bool = False) -> None:
        self.sources = as_sources(tokens)
        for src in self.sources:
            _check_length(src.tokens, seq_len, f"the train split{_named(src)}")
            if doc_mask and src.doc_starts is None:
                raise ConfigError(f"data.doc_mask=true needs document boundaries, which the "
                                  f"train split{_named(src)} does not have")
        if seed < 0:  # SeedSequence only takes non-negative entropy
            raise ConfigError(f"train.seed={seed} must be >= 0")
        self.tokens = self.sources[0].tokens
        self.doc_mask = doc_mask
        self.target_docs = doc_mask and target_docs
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.next_step = 0  # the step after the last one fetched; what a resumed run starts at
        self.skip: list[int] = []  # batches never trained on, sorted

    def skip_batches(self, batches: list[int]) -> None:
        """Add ``batches`` to the skip list (batch numbers, not steps)."""
        self.skip = sorted(set(self.skip) | set(batches))

    def batch_of(self, step: int) -> int:
        """The batch ``step`` trains on: the step-th batch not in the skip list."""
        b = step
        for s in self.skip:
            if s <= b:
                b += 1
        return b

    def draw(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, start offset) of every sequence of the global batch of ``step``; offsets
        uniform in [0, n - seq_len - 1] of their source."""
        batch = self.batch_of(step)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, batch])))
        g = self.global_batch
        if len(self.sources) == 1:
            high = len(self.tokens) - self.seq_len - 1
            return (np.zeros(g, dtype=np.int64),
                    rng.integers(0, high, size=g, endpoint=True, dtype=np.int64))
        cum = np.cumsum([0.0] + [s.weight for s in self.sources])
        cuts = np.floor(g * cum / cum[-1] + rng.random()).astype(np.int64)
        counts = np.diff(np.minimum(cuts - cuts[0], g))
        counts[-1] = g - counts[:-1].sum()
        which = np.repeat(np.arange(len(self.sources)), counts)
        rng.shuffle(which)
        offsets = np.empty(g, dtype=np.int64)
        for i, src in enumerate(self.sources):
            rows = np.flatnonzero(which == i)
            offsets[rows] = rng.integers(0, len(src.tokens) - self.seq_len - 1, size=len(rows),
                                         endpoint=True, dtype=np.int64)
        return which, offsets

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of the global batch of ``step`` (in their sources)."""
        return self.draw(step)[1]

    def _read(self, which: np.ndarray, offsets: np.ndarray,
              positions: np.ndarray | None = None) -> tuple[torch.Tensor, ...]:
        """Rows of the sequences (source ``which``, ``offsets``): (windows [n, seq_len + 1]),
        or (inputs, targets) at ``positions``; + their document ids under document masking (+
        the targets' with ``target_docs``), of whole sequences."""
        parts: list[tuple[np.ndarray, tuple[torch.Tensor, ...]]] = []
        for i in np.unique(which):
            rows = np.flatnonzero(which == i)
            src, offs = self.sources[int(i)], offsets[rows]
            got = ((_windows(src.tokens, offs, self.seq_len),) if positions is None
                   else _shares(src.tokens, offs, positions))
            if self.target_docs:  # the window's S + 1 tokens: the inputs', the targets'
                ids = doc_ids(src.doc_starts, offs, self.seq_len + 1)
                got = (*got, ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
            elif self.doc_mask:
                got = (*got, doc_ids(src.doc_starts, offs, self.seq_len))
            parts.append((rows, got))
        if len(parts) == 1:
            return parts[0][1]
        order = np.argsort(np.concatenate([rows for rows, _ in parts]), kind="stable")
        idx = torch.from_numpy(order)
        return tuple(torch.cat([got[j] for _, got in parts])[idx]
                     for j in range(len(parts[0][1])))

    def global_batch_at(self, step: int) -> torch.Tensor:
        """LongTensor [global_batch, seq_len + 1]: the whole batch of ``step``."""
        self.next_step = step + 1
        which, offsets = self.draw(step)
        return self._read(which, offsets)[0]

    def rank_micro_batches(
        self, step: int, dp_rank: int, dp_size: int, micro_batch: int,
        positions: np.ndarray | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, targets) micro-batches of ``step``, each [micro_batch, seq_len].

        Targets are the inputs shifted left by one token. ``positions`` (context parallelism):
        only the tokens at those positions of each sequence, [micro_batch, len(positions)].
        Micro-batch i of rank r holds sequences ``[(i dp + r) m, (i dp + r + 1) m)`` of the
        global batch: micro-batch i of all ranks together is the same *global micro-batch*
        (``dp * m`` consecutive sequences) in every layout, which MoE balancing statistics use.
        """
        per_rank, rest = divmod(self.global_batch, dp_size)
        if rest or per_rank % micro_batch:
            raise ConfigError(
                f"train.global_batch={self.global_batch} is not divisible by "
                f"train.micro_batch * parallel.dp = {micro_batch} * {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside [0, {dp_size})")
        self.next_step = step + 1
        which, offsets = self.draw(step)
        shape = (per_rank // micro_batch, dp_size, micro_batch)
        mine = offsets.reshape(shape)[:, dp_rank].reshape(-1)
        mine_src = which.reshape(shape)[:, dp_rank].reshape(-1)
        out = []
        for start in range(0, per_rank, micro_batch):
            rows = slice(start, start + micro_batch)
            got = self._read(mine_src[rows], mine[rows], positions)
            if positions is None:
                # contiguous: callers may .view() these, and the copy is only micro*seq_len ints.
                got = (got[0][:, :-1].contiguous(), got[0][:, 1:].contiguous(), *got[1:])
            out.append(got)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "next_step": self.next_step,
            "skip": list(self.skip),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a run; the data-defining settings must match the checkpoint."""
        keys = {"seed": "train.seed", "seq_len": "data.seq_len",
                "global_batch": "train.global_batch"}
        for key, name in keys.items():
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"{name}={getattr(self, key)} differs from the checkpoint's "
                    f"{state[key]}; resuming needs the same value"
                )
        self.next_step = int(state["next_step"])
        self.skip_batches([int(b) for b in state.get("skip", [])])


def _named(src: Source) -> str:
    return f" of {src.name}" if src.name else ""


def _val_windows(sources: list[Source], seq_len: int, want: int) -> list[int]:
    """Windows taken from each source: ``want`` shared by weight (largest remainders), each at
    most what fits in its split without overlap."""
    total = sum(s.weight for s in sources)
    share = [want * s.weight / total for s in sources]
    n = [int(x) for x in share]
    for i in sorted(range(len(n)), key=lambda i: n[i] - share[i])[: want - sum(n)]:
        n[i] += 1
    return [min(k, len(s.tokens) // (seq_len + 1)) for k, s in zip(n, sources, strict=True)]


def val_set(tokens: Any, seq_len: int, batch_size: int, n_batches: int, doc_mask: bool = False
            ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """A fixed validation set: evenly spaced windows of every source (by weight), batches of
    (LongTensor [batch, seq_len + 1], document ids [batch, seq_len] or None).

    At most as many windows as fit without overlap; fewer batches (or one smaller batch)
    when the split is small.
    """
    sources = as_sources(tokens)
    for src in sources:
        _check_length(src.tokens, seq_len, f"the validation split{_named(src)}")
    counts = _val_windows(sources, seq_len, batch_size * n_batches)
    n_windows = sum(counts)
    if n_windows >= batch_size:
        n_windows -= n_windows % batch_size  # whole batches only
    rows, ids = [], []
    for src, k in zip(sources, counts, strict=True):
        k = min(k, n_windows - sum(len(r) for r in rows))
        if k <= 0:
            continue
        offsets = np.linspace(0, len(src.tokens) - seq_len - 1, k).round().astype(np.int64)
        rows.append(_windows(src.tokens, offsets, seq_len))
        if doc_mask:
            if src.doc_starts is None:
                raise ConfigError(f"data.doc_mask=true needs document boundaries, which the "
                                  f"validation split{_named(src)} does not have")
            ids.append(doc_ids(src.doc_starts, offsets, seq_len))
    if not rows:
        return []
    batches = torch.cat(rows).split(batch_size)
    masks = torch.cat(ids).split(batch_size) if doc_mask else [None] * len(batches)
    return list(zip(batches, masks, strict=True))


def val_batches(tokens: Any, seq_len: int, batch_size: int, n_batches: int
                ) -> list[torch.Tensor]:
    """:func:`val_set` without document ids: LongTensors [batch, seq_len + 1]."""
    return [rows for rows, _ in val_set(tokens, seq_len, batch_size, n_batches)]
