"""Profiler traces of chosen optimizer steps, with meshlm's own regions named.

``profile.steps = "3-5"`` records optimizer steps 3, 4 and 5 with ``torch.profiler`` on every
rank and writes one Chrome-trace JSON per rank, ``profile/rank_NNNN.pt.trace.json``: open it in
Perfetto (ui.perfetto.dev) or chrome://tracing, or run TensorBoard with the PyTorch profiler
plugin (torch-tb-profiler) on the run: ``tensorboard --logdir RUN_DIR``. Besides torch's own
operator events, the trace names meshlm's regions (``record_function`` ranges, category
``user_annotation``):

    meshlm.step[N]               optimizer step N, from its first micro-batch to its metrics,
                                 evaluation and checkpoint
    meshlm.forward.layerK        decoder layer K's forward (module hooks; under ZeRO-3 it holds
                                 the layer's parameter gather)
    meshlm.recompute.layerK      layer K's module called again in backward (a checkpoint around
                                 the module; ``train.recompute`` replays inside the module call,
                                 so its recomputation shows inside meshlm.backward.layerK)
    meshlm.backward.layerK       from the gradient of layer K's output arriving to the gradient of
                                 its input (the bucketed DDP / ZeRO reductions its parameters
                                 trigger are issued inside it; a zero-bubble pipeline's
                                 deferred weight-gradient passes fall outside)
    meshlm.OP[AXIS]              every collective issued through ``distributed.comm``, by op and
                                 mesh axis: ``meshlm.all_reduce[dp_cp]``, ``meshlm.p2p[pp]`` ...
    meshlm.optimizer_step        the optimizer update (``region`` in the trainer)
    meshlm.checkpoint_save       a checkpoint save

On CUDA the window also records the caching allocator's history and dumps
``profile/rank_NNNN.memory.pickle`` for PyTorch's memory viewer (pytorch.org/memory_viz).
That path is GPU-only and untested on this project's CPU machines; the file is written, never
read by meshlm (which unpickles nothing).

Cost outside the window: none to speak of. ``region`` and the collectives' labels check one
Python flag (torch's "is a profiler running"), and the per-layer hooks exist only while the window
is being recorded; they never change a tensor, so results are bit-identical with and without
profiling. Inside the window torch.profiler adds its usual per-operator overhead and keeps
the window's events in host memory until it ends (about 0.7 MB per step of ``tiny`` per rank
here: keep windows to a few steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.autograd.profiler as autograd_profiler
from torch import nn


# ---------------------------------------------------------------------- named regions
def region(name: str) -> contextlib.AbstractContextManager:
    """A named range (``meshlm.optimizer_step`` ...) in the trace while a torch profiler
    records -- the ``profile.steps`` window, or one the user runs -- else a no-op context.

    Use: ``with region("meshlm.checkpoint_save"): save(...)``.
    """
    if autograd_profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _enter(name: str) -> Any:
    return torch.ops.profiler._record_function_enter_new(name, None)


def _exit(handle: Any) -> None:
    torch.ops.profiler._record_function_exit._RecordFunction(handle)


def _in_backward() -> bool:
    """True inside an autograd backward pass (e.g. activation recomputation's re-run forward)."""
    return torch._C._current_graph_task_id() != -1


class LayerRegions:
    """``meshlm.forward.layerK`` / ``meshlm.recompute.layerK`` / ``meshlm.backward.layerK``
    ranges for the decoder layers ``layers`` (key -> module), until :meth:`remove`.

    Forward: a pre-hook (prepended, so a ZeRO-3 gather is inside) and a post-hook. Backward:
    a gradient hook on the layer's output opens the range, one on its input closes it. The
    input of layer K is the output of layer K - 1, so its two hooks fire together; opening a
    range closes the one still open, which keeps the ranges flat whatever the hook order.
    Hooks return None: no gradient is changed.
    """

    def __init__(self, layers: Mapping[str, nn.Module]) -> None:
        self.handles: list[Any] = []
        self.forward_open: list[Any] = []  # stack of open forward ranges
        self.backward_open: tuple[str, Any] | None = None
        self.live = True
        for key, layer in layers.items():
            self.handles.append(layer.register_forward_pre_hook(self._pre(key), prepend=True))
            # always_call: also when the forward raises -- as activation recomputation's re-run
            # does on purpose once it has what backward needs (torch.utils.checkpoint's early stop)
            self.handles.append(layer.register_forward_hook(self._post(key), always_call=True))

    def _pre(self, key: str):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple) -> None:
            if not self.live:
                return
            recompute = _in_backward()
            self.forward_open.append(
                _enter(f"meshlm.{'recompute' if recompute else 'forward'}.layer{key}"))
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if not recompute and x is not None and x.requires_grad and torch.is_grad_enabled():
                self.handles.append(x.register_hook(lambda _g: self._close_backward(key)))
        return hook

    def _post(self, key: str):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            if not self.live or not self.forward_open:
                return
            _exit(self.forward_open.pop())
            if (not _in_backward() and isinstance(out, torch.Tensor) and out.requires_grad
                    and torch.is_grad_enabled()):
                self.handles.append(out.register_hook(lambda _g: self._open_backward(key)))
        return hook

    def _open_backward(self, key: str) -> None:
        if not self.live:
            return
        self._close_backward(None)
        self.backward_open = (key, _enter(f"meshlm.backward.layer{key}"))

    def _close_backward(self, key: str | None) -> None:
        """Close the open backward range (only if it is layer ``key``'s, unless None)."""
        if self.backward_open is not None and key in (None, self.backward_open[0]):
            _exit(self.backward_open[1])
            self.backward_open = None

    def end_step(self) -> None:
        """Close whatever a step left open (a layer whose input needed no gradient)."""
        self._close_backward(None)
        while self.forward_open:
            _exit(self.forward_open.pop())

    def remove(self) -> None:
        self.end_step()
        self.live = False
        for h in self.handles:
            h.remove()
        self.handles.clear()


# ---------------------------------------------------------------------- the window
def trace_path(out_dir: Path, rank: int) -> Path:
    """Where rank ``rank``'s trace goes (``.pt.trace.json``: the name TensorBoard's plugin reads)."""
    return Path(out_dir) / f"rank_{rank:04d}.pt.trace.json"


def memory_snapshot_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"rank_{rank:04d}.memory.pickle"


class StepProfiler:
    """Records the optimizer steps ``steps`` of one rank; a no-op for an empty range.

    Call :meth:`start_step` before each step's work and :meth:`end_step` after it (after its
    evaluation and checkpoint, so they are in the trace), and :meth:`close` at the end of
    training (it writes the trace if the run stopped inside the window). ``layers`` are the
    decoder layers to name (key -> module; a pipeline rank's own layers).
    """

    def __init__(self, steps: range, out_dir: Path, rank: int, device: torch.device,
                 layers: Mapping[str, nn.Module] | None = None) -> None:
        self.steps, self.out_dir, self.rank, self.device = steps, Path(out_dir), rank, device
        self.layers = layers or {}
        self.files: list[Path] = []
        self._prof: torch.profiler.profile | None = None
        self._layer_regions: LayerRegions | None = None
        self._step_range: Any = None

    @property
    def recording(self) -> bool:
        return self._prof is not None

    def start_step(self, step: int) -> None:
        if step not in self.steps:
            return
        if self._prof is None:
            self._start()
        self._step_range = _enter(f"meshlm.step[{step}]")

    def end_step(self, step: int) -> None:
        if self._prof is None or step not in self.steps:
            return
        self._end_range()
        if step == self.steps[-1]:
            self._stop()

    def close(self) -> None:
        if self._prof is not None:
            self._end_range()
            self._stop()

    def _end_range(self) -> None:
        if self._layer_regions is not None:
            self._layer_regions.end_step()
        if self._step_range is not None:
            _exit(self._step_range)
            self._step_range = None

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            # GPU-only: the caching allocator's history over the window, for memory_viz
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.start()
        self._layer_regions = LayerRegions(self.layers)

    def _stop(self) -> None:
        assert self._prof is not None
        if self._layer_regions is not None:
            self._layer_regions.remove()
            self._layer_regions = None
        self._prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = trace_path(self.out_dir, self.rank)
        self._prof.export_chrome_trace(str(path))
        self.files.append(path)
        self._prof = None
        if self.device.type == "cuda":  # GPU-only (see the module docstring)
            snap = memory_snapshot_path(self.out_dir, self.rank)
            torch.cuda.memory._dump_snapshot(str(snap))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.files.append(snap)


def describe_traces(out_dir: Path, steps: range, world_size: int, cuda: bool = False) -> str:
    """The one log line that names the trace files of every rank."""
    names = [trace_path(out_dir, r).name for r in range(world_size)]
    shown = ", ".join(names[:4]) + (f", ... ({world_size} files)" if world_size > 4 else "")
    what = f"steps {steps.start}-{steps[-1]}" if len(steps) > 1 else f"step {steps.start}"
    mem = ", memory snapshots rank_*.memory.pickle (pytorch.org/memory_viz)" if cuda else ""
    return (f"profile: {what} traced in {out_dir}/: {shown}{mem} "
            "(Perfetto / chrome://tracing, or TensorBoard's profiler plugin)")

