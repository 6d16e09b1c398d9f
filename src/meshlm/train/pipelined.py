"""The trainer's side of pipeline parallelism: one schedule per step, forward-only passes.

:class:`PipelineRunner` is the step runner of a pipelined layout (train/steps.py has the
interface): it owns the schedule executor of this rank and runs a step's micro-batches
through it (gradients stay local until the engine reduces them after the last micro-batch;
the tied embedding's two copies are summed first), a forward-only pass for evaluation and
sampling, and the measured bubble and timeline. Communication: the executor's activations and
gradients over pp, plus one all-reduce over pp of the loss sum and one of the bubble per step.
Multi-token prediction (``models/mtp.py``) runs on the last stage: its targets are prepared
there once per step (``MultiTokenLoss.prepare``), its loss travels with the loss sum, and the
record's ``mtp_loss`` adds one all-reduce over dp x cp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import Config
from ..distributed.comm import Comm
from ..distributed.phases import phase
from ..parallel.engine import Engine
from ..parallel.loss import MultiTokenLoss
from ..parallel.pipeline import PipelineExecutor, PipelineModel
from ..parallel.tensor import TensorParallel
from ..precision import Precision


class PipelineRunner:
    """Steps, evaluation passes and sampling passes through this rank's pipeline stages."""

    def __init__(self, cfg: Config, pipe: PipelineModel, engine: Engine, tp: TensorParallel | None,
                 comm: Comm, loss_fn: Callable, precision: Precision, device: torch.device,
                 mtp: MultiTokenLoss | None = None) -> None:
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
        # multi-token prediction's loss on the last stage (None elsewhere and without it)
        self.mtp = mtp if pipe.n_stages - 1 in pipe.stages else None
        self.executor.mtp = self.mtp
        self.with_mtp = mtp is not None  # (every stage: the record's collective)
        self.mtp_loss = 0.0

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
            if self.mtp is not None:
                self.executor.ahead = self.mtp.prepare(micro)
            loss_sum = self.executor.run(micro, self.seq_len)  # last stage only
            self.executor.ahead = None
            self.pipe.sync_tied_grads(self.comm)
            pp = self.comm.size("pp")
            loss, bubble, mtp = self.comm.reduce_scalars(
                [loss_sum / len(micro), self.executor.bubble(),
                 self.executor.mtp_sum / len(micro)], "pp")
            self.bubble, self.mtp_loss = bubble / pp, mtp
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
        multi-token prediction its loss (the global batch's mean: collective over dp x cp)."""
        rec: dict[str, Any] = {"pp_bubble": self.bubble, "pp_peak_live": self.executor.peak_live}
        if self.with_mtp:
            n = self.comm.size("dp_cp")
            rec["mtp_loss"] = self.comm.reduce_scalars([self.mtp_loss], "dp_cp")[0] / n
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
