"""Pipeline parallelism: stage partition and one executor for every schedule's action table.

The decoder's layers are cut into ``S = pp * v`` contiguous stages (balanced by count, or an
explicit ``parallel.pp_layers`` split); stage 0 also holds the embedding, stage S - 1 the final
norm, the head and the loss. Rank r keeps the stages the schedule places on it
(``schedules.rank_stages``: r, r + pp, ...; in a V, r and 2 pp - 1 - r) and deletes every other
module of the plain model, so parameter names stay those of the one-process model (and a
checkpoint reshards between any two schedules). The extra
training heads (``models/heads.py``) run on the last stage after the head: their modules live
there, and when one reads the embedding table, with a copy of it -- kept as a tied head is
(same initial values; the two copies' gradients summed over the embedding group once per
step, ``V h / t`` values), one copy when the head is that table already, and no copy when the
first and last stage share a rank (the V schedules). Their objectives' losses
(``parallel/objective.py``) join the last stage's loss, with their blocks' MoE aux losses.

:class:`PipelineExecutor` runs a rank's list of actions (see ``schedules.py``) for ``m``
micro-batches. Activations and their gradients move with ``batch_isend_irecv`` over the pp
axis, each run of consecutive send/recv actions of the table as one group with one handle --
exactly the groups ``schedules.simulate`` checks under NCCL's rule (``schedules.group_end``);
two neighbouring stages on one rank (the turn of a V) hand the tensor over in memory, with no
copy and no cast; shapes are known ahead
(micro-batch x sequence [/ tp with SP] x hidden), so there is no shape handshake. They travel
in the compute dtype (:func:`compute_dtype`: bf16 / fp16 under autocast, fp32 otherwise) and
are widened back to fp32 -- the residual stream's dtype -- on arrival. Actions dispatch through
a table (op -> method) built once per executor. A
compute action waits for the group holding its input; groups holding only sends are waited at
the end of the step. Timings (the timeline, the measured bubble) come from CUDA events on GPU
-- the kernels' times, not their launches' -- and from the host clock on CPU. The host waits
for the device once per step, after the last action: the last stage's loss sum (summed on the
device) and, on GPU, the timeline's last event. Zero-bubble ``I``/``W`` passes: ``I`` runs
autograd for the stage input and the non-matmul weights only while each linear layer's input
and output gradient are captured; ``W`` then forms the linear weight gradients
``dy^T x`` directly. Eager, module hooks capture them. With compiled blocks (``train.compile``),
whose backward exposes no output gradient to a hook, the stage's linears become split linears
(``split_linear.py``): custom ops whose backward -- run by ``I`` inside the block's compiled
backward -- forms only the input gradient and hands ``(x, dy)`` to the executor. So ``I``
forms no linear weight gradient in either mode, and ``W`` runs the same eager matmuls. In a
schedule with the split (``ScheduleDef.split``) a ``B`` runs as ``I`` then ``W`` (DualPipeV
mixes both), so the deferred linears' gradients are formed the one way.
DualPipeV's overlapped ``F`` + ``B`` pairs run, with ep > 1, as two lanes that take turns at
their expert all-to-alls (``overlap.run_pair``: the forward here, the backward in a second
thread, one running at a time, so the collectives keep one order on every rank); the
timeline keeps both spans and the bubble counts their union once. Without ep, or with
``overlap`` set False, a pair runs one pass after the other.
A module that forms its own weight gradient (``split_linear.DefersWeightGrad``: a float8
linear, whose ``dW`` is a float8 matmul with the scales of one process) is told to defer it,
and ``W`` asks it for ``dW``; in compiled blocks such a module runs its own split custom ops.

Communication per micro-batch and stage boundary: one activation forward and one gradient
backward of ``b s h`` values in the compute dtype (2 bytes each under bf16 / fp16, 4 under fp32;
``b s h / tp`` with sequence parallelism); the I/W split adds none. Memory: a rank holds the activations of its in-flight micro-batches -- m on the first
stage for AFAB and looped BFS, at most p for 1F1B and ZB-H1 (p + more for interleaved, ZB-V,
DualPipeV and interleaved zero bubble) -- which the executor measures (in chunks: a chunk
forward counts one); the split schedules also keep each linear's input and output gradient from ``I`` until ``W``
(``b s (h_in + h_out)`` values per linear and micro-batch, eager and compiled alike).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..distributed.comm import Comm
from ..distributed.phases import phase
from ..distributed.spec import spec_of, update_spec
from ..layout import partition_layers
from ..models.llama import Transformer
from . import overlap
from .schedules import (
    SCHEDULE_DEFS,
    Action,
    build_schedule,
    group_end,
    is_p2p,
    rank_stages,
    stage_rank,
)
from .split_linear import DefersWeightGrad, capture_into, split_linears

if TYPE_CHECKING:
    from .objective import ExtraObjective

AXIS = "pp"


class PipelineModel:
    """This rank's stages of a plain model (the other modules are deleted)."""

    def __init__(self, model: Transformer, pp_rank: int, pp: int, v: int, explicit: str = "",
                 schedule: str = "1f1b", *, comm: Comm):
        self.model, self.n_stages = model, pp * v
        self.layers = partition_layers(model.cfg.n_layers, self.n_stages, explicit)
        self.stages = rank_stages(schedule, pp_rank, pp, v)  # (the schedule's placement)
        keep = {i for s in self.stages for i in self.layers[s]}
        for name in [n for n in model.layers if int(n) not in keep]:
            del model.layers[name]
        first, last = 0 in self.stages, self.n_stages - 1 in self.stages
        # the extra training heads run on the last stage, some reading the embedding there too
        heads = model.training_heads()
        lookups = any(h.reads_embedding for h in heads.values())
        if not first and not (last and lookups):
            model.tok_embeddings = None
        if not last:
            model.norm, model.output = None, None
            for name in heads:
                setattr(model, name, None)
        # The embedding table on both ends (a tied head, or a training head's lookups on the
        # last stage): each end keeps its copy (same initial values); their gradients are
        # summed over the embedding group before the optimizer step. With both ends on one
        # rank (the V schedules' rank 0) there is one table, as in one process.
        self.tied: nn.Parameter | None = None
        # the placement puts both ends on one rank (the V schedules' rank 0), or on two
        on_rank0 = rank_stages(schedule, 0, pp, v)  # (stage 0 is always rank 0's)
        both_ends = self.n_stages - 1 in on_rank0
        if (model.cfg.tie_embeddings or lookups) and pp > 1 and not both_ends:
            comm.build_embed_group()  # (every rank, the same decision: collective)
        if (model.cfg.tie_embeddings or lookups) and pp > 1 and (first != last):
            self.tied = (model.tok_embeddings.weight if first or not model.cfg.tie_embeddings
                         else model.output.weight)  # (tied: the same tensor)
            # one global tensor, a copy on each end: counted half each in norms
            spec = spec_of(self.tied)
            update_spec(self.tied, tied_axis="embed", replicated=(*spec.replicated, "embed"))

    def sync_tied_grads(self, comm: Comm) -> None:
        """Sum the tied embedding's gradient over its copies (first and last stage)."""
        if self.tied is not None and self.tied.grad is not None:
            comm.all_reduce(self.tied.grad, spec_of(self.tied).tied_axis)

    def forward(self, s: int, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage ``s`` on ids (first stage) or activations; returns (output, MoE aux loss).

        The model's own pieces run: its embedding, ``run_layers`` on this stage's layers, its head.
        """
        m = self.model
        h = m.tok_embeddings(x) if s == 0 else x
        h = m.run_layers(h, seq_len, self.layers[s])
        if s == self.n_stages - 1:
            h = m.head(h)
        aux = m.aux_loss(self.layers[s])
        return h, (aux if isinstance(aux, torch.Tensor) else None)

    def stage_modules(self, s: int) -> list[nn.Module]:
        m = self.model
        mods: list[nn.Module] = [m.layers[str(i)] for i in self.layers[s]]
        if s == 0:
            mods.insert(0, m.tok_embeddings)
        if s == self.n_stages - 1:
            mods += [m.norm, m.output]
            heads = list(m.training_heads().values())
            mods += heads
            if (any(h.reads_embedding for h in heads) and s > 0
                    and m.tok_embeddings.weight is not m.output.weight):
                mods.append(m.tok_embeddings)  # (its copy here, unless it is the tied head)
        return mods


class _Clock:
    """Marks on the device's timeline: the host clock on CPU; CUDA events on GPU (GPU-only
    path), so that an interval is the kernels' time, not the time to launch them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self) -> list[float]:
        """Every mark's time since the first (waits for the last on GPU)."""
        if not self.marks:
            return []
        if self.cuda:
            self.marks[-1].synchronize()
            return [self.marks[0].elapsed_time(e) / 1e3 for e in self.marks]
        return [t - self.marks[0] for t in self.marks]


@dataclass
class _Slot:
    """What one (micro-batch, stage) keeps between its forward and backward."""

    inp: torch.Tensor | None = None
    out: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    linears: list = field(default_factory=list)  # ZB: [linear weight, input, output grad]


def compute_dtype(autocast: Callable[[], contextlib.AbstractContextManager],
                  device: torch.device) -> torch.dtype:
    """The dtype autocast computes in inside ``autocast()`` on ``device`` (fp32 when off)."""
    with autocast():
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
    return torch.float32


class PipelineExecutor:
    """Runs one rank's action table (see module docstring).

    ``dtype``: the dtype activations and their gradients travel in between stages (default:
    the compute dtype of ``autocast``, :func:`compute_dtype`).
    """

    LIVE = {"F": 1, "B": -1, "W": -1}  # micro-batches an action brings into / out of flight

    def __init__(self, pipe: PipelineModel, comm: Comm, schedule: str, m: int, v: int,
                 act_shape: tuple[int, ...], loss_fn: Callable, autocast: Callable,
                 device: torch.device, compiled: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        self.pipe, self.comm, self.m = pipe, comm, m
        self.pp, self.rank = comm.size(AXIS), comm.rank(AXIS)
        self.actions = build_schedule(schedule, self.pp, m, v)[self.rank]
        self.act_shape, self.loss_fn, self.autocast, self.device = (
            act_shape, loss_fn, autocast, device)
        self.split = SCHEDULE_DEFS[schedule].split
        self.owner = [stage_rank(schedule, s, self.pp) for s in range(pipe.n_stages)]
        self.last_rank = self.owner[-1]  # the rank of the last stage (loss, logits)
        self.local = set(pipe.stages)
        self.wire_dtype = dtype if dtype is not None else compute_dtype(autocast, device)
        self.act_dtype = torch.float32  # stage inputs and outputs (the residual stream)
        self.dispatch: dict[str, Callable[[Action], None]] = {
            "F": self._do_F, "B": self._do_B_split if self.split else self._do_B,
            "I": self._do_I, "W": self._do_W}
        # each module once (a stage's module list may repeat the embedding: a head's lookups)
        modules = list({id(mod): mod for st in pipe.stages
                        for mod in pipe.stage_modules(st)}.values())
        # ZB, eager: forward hooks capture each linear's input, and its output gradient in I.
        # ZB, compiled blocks (train.compile): a block's compiled backward exposes no output
        # gradient to a hook, so the linears become split linears whose backward (in I)
        # captures both (split_linear.py)
        self.capture = self.split and not compiled
        self._lane = threading.local()  # .capture: the list a forward's linears append to
        self._split_weights: list[nn.Parameter] = []
        # modules that form their own dW (float8 linears) form only dx in I; W asks them for
        # dW (by the id of their weight)
        self._own_dw: dict[int, DefersWeightGrad] = {}
        if self.split:
            for mod in modules:
                for sub in mod.modules():
                    if isinstance(sub, DefersWeightGrad) and id(sub.weight) not in self._own_dw:
                        sub.defer_weight_grad(compiled)
                        self._own_dw[id(sub.weight)] = sub
        if self.split and compiled:
            self._split_weights = split_linears(pipe.model, modules)
            self._split_weights += [lin.weight for lin in self._own_dw.values()]
        if self.capture:
            hooked = {id(lin): lin for mod in modules for lin in mod.modules()
                      if isinstance(lin, nn.Linear)}
            for lin in hooked.values():
                lin.register_forward_hook(self._capture_linear)
        # DualPipeV's overlapped pairs run as two lanes when there is an expert all-to-all to
        # hide (ep > 1); otherwise, or with overlap set False, one pass after the other
        self.overlap = any(a.overlap for a in self.actions) and comm.size("ep") > 1
        self.timeline: list[dict] = []
        self.peak_live = 0
        self.grad_scale = 1.0  # the fp16 loss scale (set by the trainer before each step)
        # the extra training objectives (parallel/objective.py) and, per objective, the step's
        # prepared targets of each micro-batch (set by the runner on the last stage)
        self.objectives: list[ExtraObjective] = []
        self.prepared: list[list] = []
        self.extra_sums: list[float] = []  # the last step's sums of the objectives' losses

    # -- zero-bubble capture of linear layers ----------------------------------------------
    def _capture_linear(self, mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        into = getattr(self._lane, "capture", None)
        if into is None or not torch.is_grad_enabled():
            return
        rec = [mod.weight, args[0].detach(), None]
        into.append(rec)
        out.register_hook(lambda g: rec.__setitem__(2, g))

    # -- the step -----------------------------------------------------------------------------
    def run(self, micro: list[tuple[torch.Tensor, ...]], seq_len: int) -> float:
        """Forward + backward of every micro-batch; returns the sum of the last stage's losses
        (0 on the other stages), read from the device once, at the end of the step."""
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.recvd: dict[tuple[str, int, int], tuple[torch.Tensor, object]] = {}
        self.to_send: dict[tuple[str, int, int], torch.Tensor] = {}
        self.sends: list = []
        self.micro, self.seq_len = micro, seq_len
        # the last stage's losses, summed on the device and read once, after the step: in
        # float64, as Python would add the floats (a read per micro-batch would wait for it)
        self.loss_sum: torch.Tensor | None = None
        # (the same for each extra objective)
        self.extra_totals: list[torch.Tensor | None] = [None] * len(self.objectives)
        self.extra_sums = []
        self.peak_live, live = 0, 0
        clock = _Clock(self.device)
        spans: list[tuple[Action, int, int]] = []
        i = 0
        while i < len(self.actions):
            a = self.actions[i]
            if is_p2p(a):  # a group of point-to-point actions
                j = group_end(self.actions, i)
                self._p2p(self.actions[i:j])
                i = j
                continue
            self._wait_input(a)  # (waiting is bubble, not compute: outside the timed interval)
            nxt = self.actions[i + 1] if i + 1 < len(self.actions) else None
            if self.overlap and nxt is not None and nxt.overlap:  # DualPipeV's pair
                self._wait_input(nxt)
                spans += self._run_pair(a, nxt, clock)
                self.peak_live = max(self.peak_live, live + 1)
                i += 2
                continue
            start = clock.mark()
            with phase("forward" if a.op == "F" else "backward"):
                self.dispatch[a.op](a)
            spans.append((a, start, clock.mark()))
            live += self.LIVE.get(a.op, 0)
            self.peak_live = max(self.peak_live, live)
            i += 1
        for w in self.sends:
            w.wait()
        self.sends.clear()  # (releases the last sent activations and gradients)
        end = clock.mark()
        at = clock.seconds()
        self.timeline = [{"op": a.op, "mb": a.mb, "stage": a.stage, "start": at[s], "end": at[e]}
                         for a, s, e in spans]
        self.step_time = at[end]
        if self.loss_sum is None:
            return 0.0
        if not self.objectives:
            return float(self.loss_sum)
        loss, *self.extra_sums = torch.stack([self.loss_sum, *self.extra_totals]).tolist()
        return loss

    def bubble(self) -> float:
        """Measured idle fraction of this rank in the last step (an overlapped pair's two
        passes count once where they overlap)."""
        busy, reach = 0.0, float("-inf")
        for e in sorted(self.timeline, key=lambda e: e["start"]):
            start = max(e["start"], reach)
            busy += max(0.0, e["end"] - start)
            reach = max(reach, e["end"])
        return 1.0 - busy / self.step_time if self.step_time > 0 else 0.0

    def _run_pair(self, f: Action, b: Action, clock: _Clock) -> list[tuple[Action, int, int]]:
        """An overlapped F + B (DualPipeV): the forward here, the backward in a second lane,
        taking turns at their expert all-to-alls (``overlap.run_pair``); the two spans."""
        marks: dict[str, int] = {}

        def forward() -> None:
            marks["f0"] = clock.mark()
            self.dispatch["F"](f)
            marks["f1"] = clock.mark()

        def backward() -> None:
            marks["b0"] = clock.mark()
            self.dispatch[b.op](b)
            marks["b1"] = clock.mark()

        setup = None
        if self.device.type == "cuda":  # (GPU-only path) the lanes launch on one stream
            stream = torch.cuda.current_stream(self.device)

            def setup() -> None:
                torch.cuda.set_device(self.device)
                torch.cuda.set_stream(stream)
        with phase("forward"):
            overlap.run_pair(forward, backward, setup)
        return [(f, marks["f0"], marks["f1"]), (b, marks["b0"], marks["b1"])]

    def _p2p(self, acts: list[Action]) -> None:
        """Post one group of the table: its sends and receives, one handle."""
        ops, keys = [], []
        for a in acts:
            key = (a.op[-1], a.mb, a.stage)
            if a.op.startswith("SEND"):
                ops.append(("send", self.to_send.pop(key), a.peer, self._label(a)))
            else:
                buf = torch.empty(self.act_shape, dtype=self.wire_dtype, device=self.device)
                keys.append((key, buf))
                ops.append(("recv", buf, a.peer, self._label(a)))
        handle = self.comm.batch_p2p(ops, AXIS)
        self.sends.append(handle)  # (waited again at the end: a no-op once completed)
        for key, buf in keys:
            self.recvd[key] = (buf, handle)

    def _label(self, a: Action) -> int:
        """The message's name, the same on both sides (NCCL-semantics mode checks that a
        receive got the message it was posted for; all messages have one shape): the
        micro-batch, the sending stage and the direction."""
        kind = a.op[-1]
        sender = (a.stage if a.op.startswith("SEND")
                  else a.stage - 1 if kind == "F" else a.stage + 1)
        return (a.mb * self.pipe.n_stages + sender) * 2 + (kind == "B")

    def _wait_input(self, a: Action) -> None:
        last = self.pipe.n_stages - 1
        if a.op == "F" and a.stage > 0:
            key = ("F", a.mb, a.stage)
        elif a.op in ("B", "I") and a.stage < last:
            key = ("B", a.mb, a.stage)
        else:
            return
        buf, work = self.recvd[key]
        if work is not None:
            work.wait()
            self.recvd[key] = (buf, None)

    def _received(self, key: tuple[str, int, int]) -> torch.Tensor:
        """A received activation or gradient, widened to the stage's dtype."""
        buf, work = self.recvd.pop(key)
        if work is not None:
            work.wait()
        return buf.to(self.act_dtype)

    def _send(self, key: tuple[str, int, int], x: torch.Tensor) -> None:
        """Queue an activation or gradient for its send action, in the wire dtype; hand it
        over as it is when the neighbouring stage is on this rank."""
        kind, mb, s = key
        there = s + 1 if kind == "F" else s - 1
        if there in self.local:
            self.recvd[(kind, mb, there)] = (x, None)
        else:
            self.to_send[key] = x.to(self.wire_dtype)

    # -- compute actions ----------------------------------------------------------------------
    def _do_F(self, a: Action) -> None:
        inputs, targets, *docs = self.micro[a.mb]
        slot = _Slot()
        if a.stage == 0:
            x = inputs.to(self.device)
        else:
            x = self._received(("F", a.mb, a.stage)).requires_grad_(True)
            slot.inp = x
        if self.capture:
            self._lane.capture = slot.linears
        with self.autocast(), self.pipe.model.packed(docs[0] if docs else None):
            out, aux = self.pipe.forward(a.stage, x, self.seq_len)
            if a.stage == self.pipe.n_stages - 1:
                loss = self.loss_fn(out, targets.to(self.device))
                loss64 = loss.detach().double()
                self.loss_sum = loss64 if self.loss_sum is None else self.loss_sum + loss64
                for j, o in enumerate(self.objectives):  # (their blocks' aux losses too)
                    x = o(self.prepared[j][a.mb])
                    x64, acc = x.detach().double(), self.extra_totals[j]
                    self.extra_totals[j] = x64 if acc is None else acc + x64
                    loss = loss + o.weight * x
                    extra = self.pipe.model.aux_loss(o.layer_ids())
                    if isinstance(extra, torch.Tensor):
                        aux = extra if aux is None else aux + extra
                out = loss / self.m
        self._lane.capture = None
        slot.out, slot.aux = out, (aux / self.m if aux is not None else None)
        self.slots[(a.mb, a.stage)] = slot
        if a.stage < self.pipe.n_stages - 1:
            self._send(("F", a.mb, a.stage), out.detach())

    def _roots(self, a: Action, slot: _Slot) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Backward roots: the stage output (its received gradient; the last stage's loss:
        the fp16 loss scale) and the stage's MoE aux loss (the loss scale)."""
        roots, grads = [slot.out], [None if a.stage == self.pipe.n_stages - 1
                                    else self._received(("B", a.mb, a.stage))]
        if slot.aux is not None:
            roots.append(slot.aux)
            grads.append(torch.full_like(slot.aux, self.grad_scale))
        if grads[0] is None:
            grads[0] = torch.full_like(slot.out, self.grad_scale)
        return roots, grads

    def _do_B(self, a: Action) -> None:
        slot = self.slots.pop((a.mb, a.stage))
        roots, grads = self._roots(a, slot)
        torch.autograd.backward(roots, grads)
        if a.stage > 0:
            self._send(("B", a.mb, a.stage), slot.inp.grad)

    def _do_B_split(self, a: Action) -> None:
        """A full backward in a schedule with the split: I, then W."""
        self._do_I(a)
        self._do_W(a)

    def _do_I(self, a: Action) -> None:
        """Gradient of the stage input and of every non-matmul weight; linears deferred to W."""
        slot = self.slots[(a.mb, a.stage)]
        roots, grads = self._roots(a, slot)
        # eager: the weights of the linears captured in F are not asked for; split linears
        # (compiled) return no weight gradient, so asking for theirs costs nothing (None)
        captured = {id(rec[0]) for rec in slot.linears}
        others = list({id(p): p for mod in self.pipe.stage_modules(a.stage)
                       for p in mod.parameters()
                       if p.requires_grad and id(p) not in captured}.values())
        wrt = ([slot.inp] if slot.inp is not None else []) + others
        with capture_into(slot.linears) if self._split_weights else contextlib.nullcontext():
            got = torch.autograd.grad(roots, wrt, grads, allow_unused=True)
        if slot.inp is not None:
            self._send(("B", a.mb, a.stage), got[0])
            got = got[1:]
        for p, g in zip(others, got, strict=True):
            _accumulate(p, g)
        slot.out = slot.aux = slot.inp = None  # the graph is released; W needs only linears

    def _do_W(self, a: Action) -> None:
        slot = self.slots.pop((a.mb, a.stage))
        # a split linear's backward may see its weight as an alias (a recomputed block's saved
        # tensors are detached views): it is named by its storage
        weight_at = {(p.data_ptr(), p.shape): p for p in self._split_weights}
        for w, x, dy in slot.linears:
            if dy is None:  # the output did not reach the loss (unused branch)
                continue
            if weight_at:
                w = weight_at.get((w.data_ptr(), w.shape))
                if w is None:
                    raise RuntimeError("a split linear captured a weight that is not one of "
                                       "this rank's linear weights")
            if (lin := self._own_dw.get(id(w))) is not None:
                dw = lin.weight_grad(x, dy)
            else:
                dw = dy.reshape(-1, dy.shape[-1]).float().t() @ x.reshape(-1, x.shape[-1]).float()
            _accumulate(w, dw.to(w.dtype))

    # -- forward only (evaluation, sampling) -------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, ids: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Output of the last stage (on its rank; None elsewhere), stage after stage."""
        x: torch.Tensor = ids.to(self.device)
        out = None
        for s in range(self.pipe.n_stages):
            if self.owner[s] != self.rank:
                continue
            if s > 0 and self.owner[s - 1] != self.rank:
                buf = torch.empty(shape, dtype=self.wire_dtype, device=self.device)
                self.comm.batch_p2p([("recv", buf, self.owner[s - 1])], AXIS).wait()
                x = buf.to(self.act_dtype)
            with self.autocast():
                out, _ = self.pipe.forward(s, x, ids.shape[1])
            if s < self.pipe.n_stages - 1:
                if self.owner[s + 1] == self.rank:
                    x = out  # (the next stage is this rank's too)
                else:
                    self.comm.batch_p2p([("send", out.to(self.wire_dtype).contiguous(),
                                          self.owner[s + 1])], AXIS).wait()
        return out if self.pipe.n_stages - 1 in self.pipe.stages else None


def _accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """``p.grad += g`` in place (the data-parallel engines keep views into their buckets)."""
    if g is None:
        return
    if p.grad is None:
        p.grad = g.detach().clone()
    else:
        p.grad.add_(g)
