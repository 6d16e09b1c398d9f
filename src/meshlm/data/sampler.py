"""Which token windows each training step and each data-parallel rank sees.

The batch of global step k is a pure function of (seed, k): ``global_batch`` windows of
``seq_len + 1`` tokens at offsets drawn from a generator seeded with ``[seed, b]``, where
batch b is k itself unless batches are skipped (``train.skip_batches``, or a rollback after a
non-finite step): step k then takes the k-th batch not in the skip list. So a
resumed run continues exactly (only the next step number is state), and every parallel
layout sees the same data: rank r of dp takes the contiguous rows
``[r * global/dp, (r + 1) * global/dp)`` and splits them into micro-batches in order; under
context parallelism each cp rank reads only the positions of its share of every row.

Memory: drawing offsets costs ``global_batch`` integers; only the rows a rank needs are read
from the (memory-mapped) token array, ``micro * (seq_len + 1)`` tokens per micro-batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..config import ConfigError


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
    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int) -> None:
        _check_length(tokens, seq_len, "the train split")
        if seed < 0:  # SeedSequence only takes non-negative entropy
            raise ConfigError(f"train.seed={seed} must be >= 0")
        self.tokens = tokens
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

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of the global batch of ``step``, uniform in [0, n - seq_len - 1]."""
        batch = self.batch_of(step)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, batch])))
        high = len(self.tokens) - self.seq_len - 1
        return rng.integers(0, high, size=self.global_batch, endpoint=True, dtype=np.int64)

    def global_batch_at(self, step: int) -> torch.Tensor:
        """LongTensor [global_batch, seq_len + 1]: the whole batch of ``step``."""
        self.next_step = step + 1
        return _windows(self.tokens, self.offsets(step), self.seq_len)

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
        blocks = self.offsets(step).reshape(per_rank // micro_batch, dp_size, micro_batch)
        mine = blocks[:, dp_rank].reshape(-1)
        out = []
        for start in range(0, per_rank, micro_batch):
            if positions is not None:
                out.append(_shares(self.tokens, mine[start : start + micro_batch], positions))
                continue
            rows = _windows(self.tokens, mine[start : start + micro_batch], self.seq_len)
            # contiguous: callers may .view() these, and the copy is only micro*seq_len ints.
            out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
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


def val_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int
) -> list[torch.Tensor]:
    """A fixed validation set: evenly spaced windows, LongTensors [batch, seq_len + 1].

    At most as many windows as fit without overlap; fewer batches (or one smaller batch)
    when the split is small.
    """
    _check_length(tokens, seq_len, "the validation split")
    fit = len(tokens) // (seq_len + 1)
    n_windows = min(batch_size * n_batches, fit)
    if n_windows >= batch_size:
        n_windows -= n_windows % batch_size  # whole batches only
    if n_windows <= 0:
        return []
    offsets = np.linspace(0, len(tokens) - seq_len - 1, n_windows).round().astype(np.int64)
    rows = _windows(tokens, offsets, seq_len)
    return list(rows.split(batch_size))
