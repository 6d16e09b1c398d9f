"""The trainer's side of pipeline parallelism: one schedule per step, forward-only passes.

:class:`PipelineRunner` is the step runner of a pipelined layout (train/steps.py has the
interface): it owns the schedule executor of this rank and runs a step's micro-batches
through it (gradients stay local until the engine reduces them after the last micro-batch;
the tied embedding's two copies are summed first), a forward-only pass for evaluation and
sampling, and the measured bubble and timeline. Communication: the executor's activations and
gradients over pp, plus one all-reduce over pp of the loss sum and one of the bubble per step.
Extra training objectives (``parallel/objective.py``) run on the last stage: their targets are
prepared there once per step (``prepare``), their losses travel with the loss sum, and the
record's ``{name}_loss`` values add one all-reduce over dp x cp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import Config
from ..distributed.comm import Comm
from ..distributed.phases import phase
from ..parallel.engine import Engine
from ..parallel.objective import ExtraObjective, metric
from ..parallel.pipeline import PipelineExecutor, PipelineModel
from ..parallel.tensor import TensorParallel
from ..precision import Precision


class PipelineRunner:
    """Steps, evaluation passes and sampling passes through this rank's pipeline stages."""

    def __init__(self, cfg: Config, pipe: PipelineModel, engine: Engine, tp: TensorParallel | None,
                 comm: Comm, loss_fn: Callable, precision: Precision, device: torch.device,
                 objectives: list[ExtraObjective] | None = None) -> None:
        self.pipe, self.engine, self.tp, self.comm = pipe, engine, tp, comm
        self.precision, self.schedule = precision, cfg.parallel.pp_schedule
        # tokens of a sequence on this rank: its context-parallel share
        self.seq_len = cfg.data.seq_len // comm.size("cp")
        self.dim, self.loss_fn = pipe.model.cfg.dim, loss_fn
        p = cfg.parallel
        self.executor = PipelineExecutor(
            pipe, comm, p.pp_schedule, cfg.grad_accum, p.pp_virtual,
            self.activation_shape(cfg.train.micro_batch, self.seq_len),
            loss_fn, precision.autocast, device, compiled=cfg.train.compile)
        self.bubble = 0.0
        # the extra training objectives: run on the last stage (none elsewhere); every stage
        # keeps their metric names (the record's collective)
        objectives = objectives or []
        self.executor.objectives = objectives if pipe.n_stages - 1 in pipe.stages else []
        self.metrics = [metric(o.name) for o in objectives]
        self.extra_losses = [0.0] * len(objectives)

    def activation_shape(self, batch: int, seq_len: int) -> tuple[int, int, int]:
        """Shape of the activations between stages of ``seq_len`` tokens on this rank (a
        context-parallel share; sequence-sharded under SP)."""
        sp = self.tp is not None and self.tp.sp
        return (batch, seq_len // self.tp.size if sp else seq_len, self.dim)

    def forward_backward(self, micro: list[tuple[torch.Tensor, ...]]) -> float:
        """Every micro-batch of a step through the schedule; the mean loss of this pipeline.

        Gradients are left for the engine to reduce (``finish_grads``) after the last one.
        """
        scaler = self.precision.scaler
        self.executor.grad_scale = scaler.scale if scaler is not None else 1.0
        with phase("forward"):  # (the executor marks its backward actions)
            self.engine.set_sync(False)
            self.engine.begin_step()
            self.executor.prepared = [o.prepare(micro) for o in self.executor.objectives]
            loss_sum = self.executor.run(micro, self.seq_len)  # last stage only
            self.executor.prepared = []
            self.pipe.sync_tied_grads(self.comm)
            pp = self.comm.size("pp")
            sums = self.executor.extra_sums or [0.0] * len(self.metrics)  # (0: not last stage)
            loss, bubble, *extra = self.comm.reduce_scalars(
                [loss_sum / len(micro), self.executor.bubble(),
                 *(x / len(micro) for x in sums)], "pp")
            self.bubble, self.extra_losses = bubble / pp, extra
        return loss

    def forward(self, ids: torch.Tensor, doc_ids: torch.Tensor | None = None
                ) -> torch.Tensor | None:
        """Last-stage output of a forward-only pass (None on the other stages)."""
        self.engine.begin_step()
        with self.pipe.model.packed(doc_ids):
            out = self.executor.forward_only(ids, self.activation_shape(ids.shape[0],
                                                                        ids.shape[1]))
        self.engine.end_forward_only()
        return out

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor,
                  doc_ids: torch.Tensor | None = None) -> float:
        """Mean loss of (B, S) ``inputs`` and ``targets`` on every rank of the pipeline."""
        out = self.forward(inputs, doc_ids)
        loss = float(self.loss_fn(out, targets)) if out is not None else 0.0
        return self.comm.reduce_scalars([loss], "pp")[0]

    def record(self, step: int) -> dict[str, Any]:
        """The measured bubble of the step and the most micro-batches alive at once; with
        each extra objective's loss (the global batch's mean: collective over dp x cp)."""
        rec: dict[str, Any] = {"pp_bubble": self.bubble, "pp_peak_live": self.executor.peak_live}
        if self.metrics:
            n = self.comm.size("dp_cp")
            sums = self.comm.reduce_scalars(self.extra_losses, "dp_cp")
            rec.update({name: x / n for name, x in zip(self.metrics, sums, strict=True)})
        return rec

    def timeline(self) -> dict[str, Any]:
        """The last step's measured actions of this rank (``timeline/rank_NNNN.json``)."""
        mesh = self.comm.mesh
        return {"pp_rank": mesh.local_rank("pp"), "pp": mesh.size("pp"),
                "schedule": self.schedule, "step_time": self.executor.step_time,
                "actions": self.executor.timeline}

    def logits(self, ids: torch.Tensor, v_local: int) -> torch.Tensor:
        """(B, S, V_local) logits of the last stage, broadcast from its rank (the schedule's
        placement: rank pp - 1, or rank 0 in a V) to every stage."""
        out = self.forward(ids)
        logits = out.float() if out is not None else torch.empty(
            ids.shape[0], ids.shape[1], v_local, device=ids.device)
        self.comm.broadcast(logits, "pp", src=self.executor.last_rank)
        return logits
