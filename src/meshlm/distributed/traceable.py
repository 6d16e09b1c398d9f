"""Collectives as opaque custom ops, so ``torch.compile`` traces a block that calls them.

Dynamo cannot trace a :class:`~meshlm.distributed.comm.Comm` method: it appends to the comm
log, writes the flight recorder and calls an in-place c10d collective. Registered with
``torch.library.custom_op``, each collective below is one node of a compiled graph: dynamo,
AOTAutograd and inductor see only its output shape (the fake implementation); at run time the
node calls the Comm method exactly as eager code does -- logged, flight-recorded, same bytes.
Eager callers go through the same ops (one dispatcher hop, microseconds), so eager and compiled
runs share one code path.

A Comm is named in a graph by an integer key (:func:`key_of`), looked up at run time in a weak
table: graphs hold no reference to process groups.

Communication: that of the wrapped Comm call. Memory: each op returns a new tensor (an
all-reduce allocates its result instead of reducing in place -- the same bytes eager code's
``clone`` before ``all_reduce`` costs).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from .comm import Comm

_COMMS: weakref.WeakValueDictionary[int, Comm] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def key_of(comm: Comm) -> int:
    """The integer naming ``comm`` inside compiled graphs (assigned on first use)."""
    key = getattr(comm, "_trace_key", None)
    if key is None:
        key = next(_KEYS)
        comm._trace_key = key  # type: ignore[attr-defined]
        _COMMS[key] = comm
    return key


def _comm(key: int) -> Comm:
    try:
        return _COMMS[key]
    except KeyError:
        raise RuntimeError(f"collective op: no live Comm with key {key}") from None


@torch.library.custom_op("meshlm::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, key: int, axis: str) -> torch.Tensor:
    """Sum of ``x`` over ``axis`` (a new tensor)."""
    out = x.contiguous().clone()
    _comm(key).all_reduce(out, axis)
    return out


@all_reduce.register_fake
def _(x: torch.Tensor, key: int, axis: str) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("meshlm::all_reduce_max", mutates_args=())
def all_reduce_max(x: torch.Tensor, key: int, axis: str) -> torch.Tensor:
    """Element-wise maximum of ``x`` over ``axis`` (a new tensor)."""
    out = x.contiguous().clone()
    _comm(key).all_reduce(out, axis, op="max")
    return out


@all_reduce_max.register_fake
def _(x: torch.Tensor, key: int, axis: str) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _resized(x: torch.Tensor, rows: int) -> torch.Tensor:
    """An empty tensor like ``x`` with ``rows`` rows (dim 0)."""
    return torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)


@torch.library.custom_op("meshlm::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, key: int, axis: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0, in axis order."""
    comm = _comm(key)
    out = _resized(x, comm.size(axis) * x.shape[0])
    comm.all_gather(out, x.contiguous(), axis)
    return out


@all_gather.register_fake
def _(x: torch.Tensor, key: int, axis: str) -> torch.Tensor:
    return _resized(x, _comm(key).size(axis) * x.shape[0])


@torch.library.custom_op("meshlm::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, key: int, axis: str) -> torch.Tensor:
    """This rank's 1/n slice (along dim 0) of the sum of ``x`` over ``axis``."""
    comm = _comm(key)
    out = _resized(x, x.shape[0] // comm.size(axis))
    comm.reduce_scatter(out, x.contiguous(), axis)
    return out


@reduce_scatter.register_fake
def _(x: torch.Tensor, key: int, axis: str) -> torch.Tensor:
    return _resized(x, x.shape[0] // _comm(key).size(axis))


__all__ = ["all_gather", "all_reduce", "all_reduce_max", "key_of", "reduce_scatter"]
