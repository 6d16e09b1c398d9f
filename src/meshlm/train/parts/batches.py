"""The data part: the cached token data, this rank's micro-batches of a step, validation batches.

:func:`load_data` builds (or finds) the cache on the logging rank first, then the other ranks
read it (one barrier). :class:`Batches` draws the global batch of step k from (seed, k) and
hands this rank its share: data-parallel ranks of every island split the batch (island k's dp
ranks read shares k dp ... (k + 1) dp - 1 of dp * islands), context-parallel ranks read their
positions of each sequence. A mixture (``data.mix``) draws every batch from its sources by
weight; under ``data.doc_mask`` every micro-batch and validation batch carries the document ids
of its whole sequences (training micro-batches for an objective that reads the tokens ahead:
their targets' too, ``target_docs``). Checkpoints hold the sampler's position and skip list (``sampler``) and
the tokens trained on (``tokens_seen``). No communication after start-up; memory: the
memory-mapped token arrays and one step's micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ...checkpoint.sharded import ShardedCheckpoint
from ...checkpoint.state import CheckpointError
from ...config import DataSection, TrainSection, skip_batches
from ...data import DataBundle, build_data
from ...data.sampler import Source, StepSampler, val_set
from ...distributed.comm import Comm
from ...distributed.mesh import Mesh

Log = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


def load_data(section: DataSection, comm: Comm, log: Log) -> DataBundle:
    """Rank 0 builds (or finds) the cached data first; the others then read the cache."""
    main = comm.mesh.is_logging_rank
    if main:
        data = build_data(section, log=log)
    comm.barrier()
    if not main:
        data = build_data(section, log=_quiet)
    return data


def sources(data: DataBundle, split: str) -> list[Source]:
    """The weighted token streams of ``split`` (train / val): one per dataset of a mixture."""
    entries = getattr(data, "sources", None)
    if not entries:
        tokens = data.train_tokens if split == "train" else data.val_tokens
        return [Source(tokens, 1.0, getattr(tokens, "doc_starts", None))]
    out = []
    for name, weight, dataset in entries:
        stream = getattr(dataset, split)
        out.append(Source(stream, weight, stream.doc_starts, name if len(entries) > 1 else ""))
    return out


class Batches:
    """The step sampler (resumable, with its skip list) and the fixed validation batches."""

    SECTION = "data"

    def __init__(self, section: DataSection, train: TrainSection, data: DataBundle,
                 mesh: Mesh, positions: np.ndarray | None = None,
                 target_docs: bool = False) -> None:
        self.section, self.train = section, train
        self.tokens_per_step = train.global_batch * section.seq_len
        self.dp_size = mesh.size("dp") * mesh.islands
        self.dp_rank = mesh.island * mesh.size("dp") + mesh.local_rank("dp")
        self.positions = positions  # this rank's share of each sequence (context parallel)
        self.sampler = StepSampler(sources(data, "train"), section.seq_len, train.global_batch,
                                   train.seed, section.doc_mask, target_docs)
        self.sampler.skip_batches(skip_batches(train.skip_batches))
        # (B, S + 1) windows and their document ids (None without document masking)
        self.val = val_set(sources(data, "val"), section.seq_len, train.eval_batch_size,
                           train.eval_batches, section.doc_mask)

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        """This rank's (inputs, targets[, document ids[, the targets' document ids]])
        micro-batches of ``step``."""
        return self.sampler.rank_micro_batches(step, self.dp_rank, self.dp_size,
                                               self.train.micro_batch, self.positions)

    def skip_batch_of(self, step: int) -> int:
        """Never train on the batch of ``step`` again (``train.on_nonfinite=rollback``);
        returns its number."""
        bad = self.sampler.batch_of(step)
        self.sampler.skip_batches([bad])
        return bad

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``sampler`` and ``tokens_seen`` (of the steps drawn so far)."""
        drawn = max(self.sampler.next_step - 1, 0)
        return {"sampler": self.sampler.state_dict(), "tokens_seen": drawn * self.tokens_per_step}

    def load_state_dict(self, state: Mapping[str, Any], ckpt: ShardedCheckpoint) -> None:
        """Continue from the checkpoint's sampler (the data settings must be the run's)."""
        if not state.get("sampler"):
            raise CheckpointError(f"{ckpt.directory / 'trainer.json'}: no sampler state (a "
                                  "weights-only checkpoint: use it as model.init_from)")
        self.sampler.load_state_dict(dict(state["sampler"]))
