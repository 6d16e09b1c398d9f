"""How a step's micro-batches become gradients: one runner per layout, one interface.

A runner has ``forward_backward(micro) -> loss``: every micro-batch of this rank's share of the
step through forward and backward, gradients left for the engine to reduce, and the mean loss
of this rank's share (of this pipeline under pp); ``eval_loss(inputs, targets)`` for
evaluation; ``record(step)`` for its fields of the metrics record; ``timeline()`` for what it
measured of the last step (None: nothing). :class:`MicroBatchRunner` runs the micro-batches
one after the other on a model without pipeline stages (communication: the engine's gradient
reduction, overlapped with the last backward); :class:`~meshlm.train.pipelined.PipelineRunner`
runs them through the pipeline schedule. Memory: the activations of one micro-batch (of the
schedule's live micro-batches under pp).

Multi-token prediction (``model.mtp_depth`` > 0, ``models/mtp.py``): each micro-batch's
objective is its loss, the MoE aux losses and ``mtp_loss_weight`` times the mean of the MTP
depths' losses (``parallel/loss.py``: their targets are prepared once per step); the record's
``mtp_loss`` is that mean over the global batch (one all-reduce over dp x cp per step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..config import Config
from ..distributed.comm import Comm
from ..distributed.phases import phase
from ..models.llama import Transformer
from ..parallel.engine import Engine
from ..parallel.loss import MultiTokenLoss
from ..precision import Precision
from .parts.model import ModelPart
from .pipelined import PipelineRunner

# (inputs, targets) or, under document masking, (inputs, targets, doc_ids of whole sequences)
MicroBatches = list[tuple[torch.Tensor, ...]]


class StepRunner(Protocol):
    def forward_backward(self, micro: MicroBatches) -> float: ...

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor,
                  doc_ids: torch.Tensor | None = None) -> float: ...

    def record(self, step: int) -> dict[str, Any]: ...

    def timeline(self) -> dict[str, Any] | None: ...


class MicroBatchRunner:
    """Micro-batches one after the other: forward, backward of loss / n (the mean over the
    step), the engine told to communicate on the last one only (DDP's no_sync)."""

    def __init__(self, model: Transformer, engine: Engine, loss_fn: Callable,
                 precision: Precision, device: torch.device,
                 after_micro_batch: Callable[[], None] = lambda: None,
                 mtp: MultiTokenLoss | None = None, comm: Comm | None = None) -> None:
        self.model, self.engine, self.loss_fn = model, engine, loss_fn
        self.precision, self.device = precision, device
        self.after_micro_batch = after_micro_batch  # (tests: a rank that freezes in a step)
        self.mtp, self.comm = mtp, comm  # multi-token prediction's loss (None: none)
        self.mtp_loss = 0.0  # this rank's mean MTP loss of the last step

    def forward_backward(self, micro: MicroBatches) -> float:
        total = torch.zeros((), device=self.device)
        mtp_total = torch.zeros((), device=self.device)
        ahead = self.mtp.prepare(micro) if self.mtp is not None else None
        for i, (inputs, targets, *docs) in enumerate(micro):
            self.engine.set_sync(i == len(micro) - 1)  # DDP communicates on the last only
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            with (phase("forward"), self.precision.autocast(),
                  self.model.packed(docs[0] if docs else None)):
                loss = self.loss_fn(self.model(inputs), targets)
                objective = loss
                if ahead is not None:
                    mtp = self.mtp(ahead[i])
                    objective = loss + self.mtp.weight * mtp
                    mtp_total += mtp.detach()
                aux = self.model.aux_loss()  # (after multi-token prediction: its blocks' too)
            with phase("backward"):
                self.precision.scale((objective + aux) / len(micro)).backward()
            total += loss.detach()
            self.after_micro_batch()
        if ahead is None:
            return float(total) / len(micro)
        loss_sum, mtp_sum = torch.stack([total, mtp_total]).tolist()
        self.mtp_loss = mtp_sum / len(micro)
        return loss_sum / len(micro)

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor,
                  doc_ids: torch.Tensor | None = None) -> float:
        """Mean loss of (B, S) ``inputs`` and ``targets`` (forward only)."""
        with self.precision.autocast(), self.model.packed(doc_ids):
            return float(self.loss_fn(self.model(inputs), targets))

    def record(self, step: int) -> dict[str, Any]:
        """With multi-token prediction its loss: the global batch's mean (collective over
        dp x cp)."""
        if self.mtp is None:
            return {}
        n = self.comm.size("dp_cp") if self.comm is not None else 1
        mean = self.comm.reduce_scalars([self.mtp_loss], "dp_cp")[0] if n > 1 else self.mtp_loss
        return {"mtp_loss": mean / n}

    def timeline(self) -> dict[str, Any] | None:
        return None


def build_runner(cfg: Config, model: ModelPart, precision: Precision, comm: Comm,
                 device: torch.device, after_micro_batch: Callable[[], None]) -> StepRunner:
    """The pipeline's runner when the model has stages (``parallel.pp`` > 1), else the plain
    micro-batch loop (``after_micro_batch`` runs after each of its micro-batches)."""
    mtp = (MultiTokenLoss(model.model, model.loss_fn, comm, model.cp, device)
           if model.model_cfg.mtp_depth else None)
    if model.pipe is not None:
        return PipelineRunner(cfg, model.pipe, model.engine, model.tp, comm, model.loss_fn,
                              precision, device, mtp)
    return MicroBatchRunner(model.model, model.engine, model.loss_fn, precision, device,
                            after_micro_batch, mtp, comm)
