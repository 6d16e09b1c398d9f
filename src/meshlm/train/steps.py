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

Extra training objectives (``parallel/objective.py``; zero, one or several): each
micro-batch's objective is its loss, the MoE aux losses and each objective's ``weight`` times
its loss (their targets are prepared once per step); the record's ``{name}_loss`` is each one's
mean over the global batch (one all-reduce over dp x cp per step for all of them).
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
from ..parallel.objective import ExtraObjective, metric
from ..parallel.training_heads import build_objectives
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
                 objectives: list[ExtraObjective] | None = None, comm: Comm | None = None
                 ) -> None:
        self.model, self.engine, self.loss_fn = model, engine, loss_fn
        self.precision, self.device = precision, device
        self.after_micro_batch = after_micro_batch  # (tests: a rank that freezes in a step)
        self.objectives, self.comm = objectives or [], comm  # the extra training objectives
        self.extra_losses = [0.0] * len(self.objectives)  # this rank's means of the last step

    def forward_backward(self, micro: MicroBatches) -> float:
        total = torch.zeros((), device=self.device)
        totals = [torch.zeros((), device=self.device) for _ in self.objectives]
        prepared = [o.prepare(micro) for o in self.objectives]
        for i, (inputs, targets, *docs) in enumerate(micro):
            self.engine.set_sync(i == len(micro) - 1)  # DDP communicates on the last only
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            with (phase("forward"), self.precision.autocast(),
                  self.model.packed(docs[0] if docs else None)):
                loss = self.loss_fn(self.model(inputs), targets)
                objective = loss
                for o, ready, sum_ in zip(self.objectives, prepared, totals, strict=True):
                    extra = o(ready[i])
                    objective = objective + o.weight * extra
                    sum_ += extra.detach()
                aux = self.model.aux_loss()  # (after the objectives: their blocks' too)
            with phase("backward"):
                self.precision.scale((objective + aux) / len(micro)).backward()
            total += loss.detach()
            self.after_micro_batch()
        if not self.objectives:
            return float(total) / len(micro)
        loss_sum, *sums = torch.stack([total, *totals]).tolist()  # (one host read)
        self.extra_losses = [x / len(micro) for x in sums]
        return loss_sum / len(micro)

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor,
                  doc_ids: torch.Tensor | None = None) -> float:
        """Mean loss of (B, S) ``inputs`` and ``targets`` (forward only)."""
        with self.precision.autocast(), self.model.packed(doc_ids):
            return float(self.loss_fn(self.model(inputs), targets))

    def record(self, step: int) -> dict[str, Any]:
        """Each extra objective's loss: the global batch's mean (collective over dp x cp)."""
        if not self.objectives:
            return {}
        n = self.comm.size("dp_cp") if self.comm is not None else 1
        sums = (self.comm.reduce_scalars(self.extra_losses, "dp_cp") if n > 1
                else self.extra_losses)
        return {metric(o.name): x / n for o, x in zip(self.objectives, sums, strict=True)}

    def timeline(self) -> dict[str, Any] | None:
        return None


def build_runner(cfg: Config, model: ModelPart, precision: Precision, comm: Comm,
                 device: torch.device, after_micro_batch: Callable[[], None]) -> StepRunner:
    """The pipeline's runner when the model has stages (``parallel.pp`` > 1), else the plain
    micro-batch loop (``after_micro_batch`` runs after each of its micro-batches)."""
    objectives = build_objectives(model.model_cfg, model.model, model.loss_fn, comm, model.cp,
                                  device)
    if model.pipe is not None:
        return PipelineRunner(cfg, model.pipe, model.engine, model.tp, comm, model.loss_fn,
                              precision, device, objectives)
    return MicroBatchRunner(model.model, model.engine, model.loss_fn, precision, device,
                            after_micro_batch, objectives, comm)
