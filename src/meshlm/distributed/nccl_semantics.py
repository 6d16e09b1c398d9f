"""NCCL-semantics mode: gloo on CPU, behaving as NCCL does where the two differ.

gloo forgives what NCCL does not, so a layout that passes every CPU test can still crash or hang
at its first step on GPUs, or train on silently corrupted data. With ``MESHLM_NCCL_SEMANTICS=1``
(tests, ``benchmarks/multi_gpu.py --nccl-semantics``) :class:`~meshlm.distributed.comm.Comm`
keeps running gloo but follows NCCL's rules (DESIGN.md, principle 9). Where NCCL would hang or
corrupt silently, the mode raises :class:`NcclSemanticsError` (naming the operation and what
each rank did) on every rank that sees the violation, or, where the model is a real wait, hangs
as NCCL would and aborts at the collective timeout.

Point-to-point groups (:mod:`meshlm.distributed.nccl_p2p` runs them):

- **One handle per batched point-to-point group**, as NCCL's coalesced group gives (gloo: one
  per operation).
- **A group completes only when all of its operations are matched, and a rank's groups run one
  after another** (the communication stream): a schedule whose groups deadlock on NCCL
  deadlocks here too and fails at the collective timeout.
- **A communicator runs its work in issue order**, point-to-point groups and collectives alike
  (NCCL puts a batched group on the communicator's stream; a pp-only layout's pp group is the
  default group). A rank that issues a group on a communicator after its k-th collective there,
  while the peer issues the matching group before it, deadlocks on NCCL; gloo runs both. Every
  rank counts the collectives it issued per communicator, each message carries the count both
  ways, and a difference raises at the group's wait, naming both ranks' last operations there.
  Limit: it is seen at point-to-point groups; two collectives of different kinds at the same
  place are not compared (gloo mostly fails on those itself).
- **A pair's messages match in posting order**, by count, not by tag, buffer or shape. Each
  message carries its index among the pair's messages on the communicator, its dtype and shape
  and an optional label (``Comm.batch_p2p``'s fourth element); a receive whose index, dtype,
  shape or label differs from the message it matched raises. gloo accepts a receive larger than
  the message and any two buffers of equal size; NCCL would hang or swap the data. Limit: two
  messages of one dtype and shape posted in swapped order are told apart by labels only.
- **A send buffer is NCCL's until its group completes**: a send tensor changed between posting
  and the wait on its handle raises at that wait (NCCL may send either value; gloo had sent it).
  Limit: a change undone before the wait is not seen.

Collectives and tensors:

- **Collectives return before they complete.** Completion is read from the work handles,
  polled by the stall monitor (:mod:`meshlm.distributed.stall`), as on CUDA.
- **A collective that times out aborts the process** (NCCL's watchdog tears it down; nothing
  of the training loop's error handling runs): SIGABRT, after one line on stderr.
- **Every tensor handed to a collective is dense, contiguous, has storage and is on the rank's
  device** -- the same type and, where the rank's device has an index (CUDA), the same index --
  else a ValueError at the call. Limit: CPU tensors carry no device index (``torch.device("cpu",
  1)`` makes tensors on ``cpu``), so on a CPU run no tensor can sit on another rank's device and
  this check rejects only another device type, meta tensors and sparse layouts; the index is
  checked where the mode runs over CUDA tensors (:func:`device_problem`).
- **Only Comm talks to torch.distributed.** torch.distributed's collective and point-to-point
  functions are wrapped (:func:`install_guard`); a call made neither from inside ``Comm`` nor
  from a caller in :data:`ALLOWED` (each with its reason) raises: it would escape every rule
  above. torch's functional collectives (DTensor, FSDP2) do not go through these functions and
  are not seen.

Costs per rank. Point-to-point: each message gets a header of ``HEADER_LEN`` int64 (136 bytes)
each way (the way back is the acknowledgement), waited before the data; every send tensor is
copied when posted and compared with its copy at the wait (two passes over its bytes; memory:
the bytes in flight until waited -- the pipeline holds a step's sends); one thread. Per
communicator: a few counters and the last ``HISTORY`` operations. Every collective: a counter,
a thread-local depth around the call, a few attribute reads per tensor. A call from outside
``Comm``: a walk up the stack to its caller.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ENV = "MESHLM_NCCL_SEMANTICS"


class NcclSemanticsError(RuntimeError):
    """A use of the process-group layer that NCCL would hang on or corrupt silently."""


def enabled() -> bool:
    """Whether this process runs in NCCL-semantics mode (``MESHLM_NCCL_SEMANTICS=1``)."""
    return os.environ.get(ENV, "").strip() not in ("", "0", "false", "no")


# -- tensors -----------------------------------------------------------------------------------
def device_problem(found: torch.device, rank_device: torch.device) -> str | None:
    """Why a tensor on ``found`` cannot go to NCCL on a rank whose device is ``rank_device``
    (another device type, or another index where the rank's device has one); None if it can."""
    if found.type != rank_device.type or (rank_device.index is not None
                                          and found.index != rank_device.index):
        return (f"tensor on {found}, but this rank's device is {rank_device} (NCCL moves this "
                "rank's device memory only)")
    return None


def check_tensor(t: torch.Tensor, device: torch.device, what: str) -> None:
    """NCCL's demands on a collective's tensor: dense, with storage, contiguous, on the rank's
    device."""
    if t.layout != torch.strided:
        raise ValueError(f"{what}: {t.layout} tensor (NCCL takes dense tensors only)")
    if t.is_meta:
        raise ValueError(f"{what}: meta tensor of shape {tuple(t.shape)} has no storage to send")
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensor of shape {tuple(t.shape)} is not contiguous "
                         "(NCCL reads its storage as if it were)")
    if (problem := device_problem(t.device, device)) is not None:
        raise ValueError(f"{what}: {problem}")


def watchdog_abort(what: str, exc: BaseException) -> None:
    """What NCCL's watchdog does to a process whose collective timed out: end it, at once."""
    print(f"meshlm: NCCL-semantics watchdog: {what} failed ({type(exc).__name__}: "
          f"{str(exc).splitlines()[0] if str(exc) else ''}); aborting the process",
          file=sys.stderr, flush=True)
    os.abort()


# -- direct torch.distributed calls ------------------------------------------------------------
# torch.distributed's functions that communicate (those this torch has are wrapped)
GUARDED = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
           "all_gather_single", "all_gather_coalesced", "all_gather_object", "reduce",
           "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
           "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list",
           "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
           "send_object_list", "recv_object_list", "batch_isend_irecv", "barrier",
           "monitored_barrier")

# Callers (module prefixes) allowed to call them directly, and why.
ALLOWED: dict[str, str] = {
    "meshlm.checkpoint.async_save": (
        "the checkpoint writer thread agrees on its files over a group of its own, made with "
        "backend='gloo' on every run (GPU runs too): NCCL's rules do not apply to it"),
}

_SKIPPED = ("torch.distributed.distributed_c10d", "torch.distributed.c10d_logger", __name__)


class _ThroughComm(threading.local):
    """Depth of ``Comm`` calls (and allowed callers' calls) on this thread: a context manager,
    re-entrant, shared by every ``Comm``."""

    depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


THROUGH_COMM = _ThroughComm()
_originals: dict[str, Callable] = {}


def _caller(frame: FrameType | None) -> tuple[str, str]:
    """(module, "module:function:line") of the first frame outside torch.distributed's own."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_SKIPPED):
        frame = frame.f_back
    if frame is None:
        return "", "?"
    module = frame.f_globals.get("__name__", "?")
    return module, f"{module}:{frame.f_code.co_name}:{frame.f_lineno}"


def _guard(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def guarded(*args: object, **kwargs: object) -> object:
        if THROUGH_COMM.depth == 0:
            module, where = _caller(sys._getframe(1))
            if not any(module == m or module.startswith(m + ".") for m in ALLOWED):
                raise NcclSemanticsError(
                    f"torch.distributed.{name} called from {where}, not through "
                    "meshlm.distributed.comm.Comm: it escapes the NCCL-semantics checks (order, "
                    "matching, tensors) and the communication log; call Comm, or add the caller "
                    "to nccl_semantics.ALLOWED with the reason it may bypass it")
            with THROUGH_COMM:  # (what it calls in turn is the allowed call's)
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return guarded


def install_guard() -> None:
    """Wrap :data:`GUARDED` in ``torch.distributed`` and ``distributed_c10d`` (where torch's own
    functions find them: ``P2POp`` checks its op against ``isend`` / ``irecv`` there), once per
    process."""
    if _originals:
        return
    for name in GUARDED:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        _originals[name] = fn
        wrapped = _guard(name, fn)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
