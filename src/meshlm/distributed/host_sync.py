"""Host synchronisations: the points where the host reads what the device computed.

On a GPU, kernels are queued and the host runs ahead of them. Reading a value of a device
tensor on the host -- ``t.item()``, ``bool(t)`` (an ``if`` on a tensor), ``float(t)``,
``int(t)``, ``t.tolist()``, ``t.cpu()``, a NumPy view -- or running an operation whose output
shape depends on the values (``nonzero``, boolean indexing, ``unique``, ...) waits until every
kernel queued before it has run: the host stops feeding the device, and the device then idles
while the host catches up. A training step should read the device a fixed, small number of
times (the loss and the gradient norm for the metrics), however many micro-batches, pipeline
stages or ring blocks it runs.

On CPU nothing waits, so tests count these reads instead. :func:`count_host_syncs` is a
``TorchFunctionMode`` (the same hook ``torch.cuda.set_sync_debug_mode`` gives CUDA runs, for
any device): inside it, every read above is counted with the line of meshlm code that made it.
Modes are per thread, so only the calling thread's reads count (autograd's backward included:
it runs on the calling thread for CPU tensors); the asynchronous checkpoint's writer thread
reads host memory and is not counted.

Host data that never was on the device -- the data pipeline's document ids before they are
copied over -- is read with :func:`host_array`, which refuses device tensors and is not
counted: code that decides on the host (which ring-attention blocks to skip) says so by using it.

Communication: none. Memory: none (a counter per call site while counting).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

# Reads of a tensor's values by the host (Python scalars, lists, NumPy, a copy to the CPU)
_READS = {
    torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
    torch.Tensor.__index__, torch.Tensor.__format__, torch.Tensor.tolist, torch.Tensor.numpy,
    torch.Tensor.__array__, torch.Tensor.cpu, torch.Tensor.is_nonzero, torch.is_nonzero,
    torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose,
}
# Operations whose output shape depends on the values: the host waits for them to size it
_DATA_SHAPED = {
    torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere,
    torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
    torch.unique_consecutive, torch.Tensor.unique_consecutive, torch.bincount,
    torch.Tensor.bincount,
}
_SRC = str(Path(__file__).resolve().parents[1])  # src/meshlm: where call sites are looked for
_local = threading.local()


def _name(func: Callable) -> str:
    return getattr(func, "__name__", repr(func))


def _caller() -> str:
    """``path:line`` of the innermost meshlm frame outside this module (else the innermost
    frame outside torch)."""
    frame = sys._getframe(2)
    fallback = ""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_SRC) and not path.endswith("host_sync.py"):
            return f"{Path(path).relative_to(_SRC).as_posix()}:{frame.f_lineno}"
        if not fallback and "torch" not in path and not path.endswith("host_sync.py"):
            fallback = f"{Path(path).name}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"


def _reads_device(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` is a host synchronisation (see module docstring)."""
    if func in _READS or func in _DATA_SHAPED:
        return True
    if func is torch.where:  # the one-argument form is nonzero
        return len(args) + len(kwargs) == 1
    if func is torch.Tensor.__getitem__ and len(args) > 1:  # boolean-mask indexing
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if func is torch.Tensor.to:  # a copy of a device tensor to the CPU
        src = args[0]
        dest = next((a for a in (*args[1:], kwargs.get("device")) if a is not None
                     and isinstance(a, (str, torch.device))), None)
        return (isinstance(src, torch.Tensor) and src.device.type != "cpu"
                and dest is not None and torch.device(dest).type == "cpu")
    return False


class HostSyncs(TorchFunctionMode):
    """Counts the host synchronisations made while active (:func:`count_host_syncs`):
    ``total``, and ``sites`` -- ``"op at path:line"`` -> count."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def reset(self) -> None:
        self.sites.clear()

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not getattr(_local, "host_read", False) and _reads_device(func, args, kwargs):
            self.sites[f"{_name(func)} at {_caller()}"] += 1
        return func(*args, **kwargs)

    def report(self) -> str:
        """One line per call site, most frequent first."""
        return "\n".join(f"{n:5d}  {site}" for site, n in self.sites.most_common())


@contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count this thread's host synchronisations inside the block (see :class:`HostSyncs`)."""
    with HostSyncs() as mode:
        yield mode


def host_array(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of ``t``, a tensor that lives in host memory (data that never was on the
    device): no synchronisation, so not counted. A device tensor is refused -- reading it
    would wait for the device."""
    if t.device.type != "cpu":
        raise ValueError(f"host_array reads host memory; this tensor is on {t.device} "
                         "(reading it would wait for the device)")
    _local.host_read = True
    try:
        return t.detach().numpy()
    finally:
        _local.host_read = False
