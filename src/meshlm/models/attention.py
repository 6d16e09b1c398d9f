"""Attention kernels: what fills ``Attention.kernel``, and the one list of them.

Every kernel computes, for (B, nh, s_q, hd) queries on (B, nkv, s_k, hd) keys and
(B, nkv, s_k, hd_v) values (grouped-query heads: nh a multiple of nkv; hd_v = hd but for an
attention layer with value heads of their own width), ``softmax(q k^T / sqrt(hd) + M) v`` with
M = 0 where the query may see the key and -inf elsewhere. Which keys a query sees is the
model's rule, described by a :class:`Mask`: a key at global position j is visible from a query
at position i when j <= i (causal), i - j < W when the model has a sliding window
(``model.sliding_window`` = W, as Mistral and gpt-oss use; 0: none), and both lie in one
document (``data.doc_mask``).

A kernel answers three calls, so context parallelism composes around whichever is chosen:

- ``forward(q, k, v[, doc_ids])``: whole sequences (one process, tp, pp; Ulysses after its
  all-to-all), differentiable;
- ``block(q, k, v, mask)`` -> (output, fp32 log-sum-exp): one block of query rows against one
  block of key rows, for ring attention to merge (``parallel/ring_attention.py``);
- ``block_backward(dout, q, k, v, out, lse, mask)`` -> dq, dk, dv of that block, given the
  final output and log-sum-exp of its rows.

Kernels register by name in :data:`ATTENTION`; ``model.attention`` names one and the model
builds it (``print(model)`` shows it). Each has a torch-free description of its cost for the
planner under the same name (:mod:`.attention_spec`).

- ``sdpa``: ``scaled_dot_product_attention``; plain causal: the fused kernel, no scores held;
  with a window or documents: a (B | 1, 1, s, s) boolean mask (which leaves the flash path on
  CUDA). Ring blocks: ATen's CPU flash kernel where the block is plain causal or unmasked, the
  explicit maths (one block of fp32 scores) elsewhere.
- ``eager``: the same written out, the (B, nh, s, s) scores materialised (a reference).

Communication: none. Memory: as stated per kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import attention_spec
from .attention_blocks import block_backward, block_forward


def document_mask(q_ids: torch.Tensor, k_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, s_q, s_k) bool, True where a query may attend to a key: same document and, when
    ``causal``, the key not after the query (queries and keys at the same positions)."""
    allowed = q_ids[:, :, None] == k_ids[:, None, :]
    if causal:
        n_q, n_k = q_ids.shape[1], k_ids.shape[1]
        allowed &= torch.ones(n_q, n_k, dtype=torch.bool, device=q_ids.device).tril()
    return allowed


@dataclass
class Mask:
    """Which keys each query row sees (the rule of the module docstring).

    ``q_pos`` / ``k_pos``: the rows' global positions, ascending, on the host (so whether a
    block is empty, plain causal or unmasked is known without reading the device);
    ``window``: the sliding window (0: none); ``q_ids`` / ``k_ids``: (B, s) document ids of the
    rows, or None.
    """

    q_pos: np.ndarray
    k_pos: np.ndarray
    window: int = 0
    q_ids: torch.Tensor | None = None
    k_ids: torch.Tensor | None = None

    @classmethod
    def whole(cls, s: int, window: int = 0, doc_ids: torch.Tensor | None = None) -> Mask:
        """Whole sequences of ``s`` tokens (positions 0 ... s - 1)."""
        pos = np.arange(s)
        return cls(pos, pos, window, doc_ids, doc_ids)

    @property
    def diagonal(self) -> bool:
        """Queries and keys at the same positions."""
        return self.q_pos is self.k_pos or np.array_equal(self.q_pos, self.k_pos)

    @property
    def window_free(self) -> bool:
        """The window cuts nothing here (no window, or every pair closer than it)."""
        return not self.window or int(self.q_pos[-1]) - int(self.k_pos[0]) < self.window

    @property
    def plain_causal(self) -> bool:
        """Exactly the causal triangle of a diagonal block: a fused causal kernel computes it."""
        return self.q_ids is None and self.window_free and self.diagonal

    @property
    def unmasked(self) -> bool:
        """Every query sees every key (all keys at or before the first query, within the
        window, no documents)."""
        return (self.q_ids is None and self.window_free
                and int(self.k_pos[-1]) <= int(self.q_pos[0]))

    def empty(self) -> bool:
        """No query sees any key by position (causal and window; documents not read)."""
        seen = np.searchsorted(self.k_pos, self.q_pos, side="right")  # keys at or before
        if self.window:
            seen = seen - np.searchsorted(self.k_pos, self.q_pos - self.window, side="right")
        return not bool((seen > 0).any())

    def dense(self, device: torch.device) -> torch.Tensor:
        """(B or 1, s_q, s_k) bool: True where the query sees the key."""
        qp = torch.from_numpy(self.q_pos).to(device)
        kp = torch.from_numpy(self.k_pos).to(device)
        rel = qp[:, None] - kp[None, :]  # (s_q, s_k): query position - key position
        allowed = rel >= 0
        if self.window:
            allowed &= rel < self.window
        if self.q_ids is not None:
            assert self.k_ids is not None
            return allowed[None] & (self.q_ids[:, :, None] == self.k_ids[:, None, :])
        return allowed[None]


class AttentionKernel(nn.Module):
    """Base of the registered kernels: ``forward`` on whole sequences through :meth:`attend`,
    ring blocks through :meth:`block` / :meth:`block_backward` (explicit maths by default)."""

    name: ClassVar[str] = ""
    # False: run eagerly inside a compiled block (``train.compile`` leaves it out of the graph)
    compilable: ClassVar[bool] = True

    def __init__(self, window: int = 0) -> None:
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(q, k, v, Mask.whole(q.shape[2], self.window, doc_ids))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
               ) -> torch.Tensor:
        raise NotImplementedError

    def block_path(self, q: torch.Tensor) -> str:
        """``flash`` or ``math``: the implementation of unmasked and causal blocks."""
        return "math"

    def block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
              ) -> tuple[torch.Tensor, torch.Tensor]:
        if mask.unmasked or mask.plain_causal:
            return block_forward(q, k, v, not mask.unmasked, self.block_path(q))
        return block_forward(q, k, v, False, "math", mask.dense(q.device))

    def block_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, mask: Mask
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if mask.unmasked or mask.plain_causal:
            return block_backward(dout, q, k, v, out, lse, not mask.unmasked,
                                  self.block_path(q))
        return block_backward(dout, q, k, v, out, lse, False, "math", mask.dense(q.device))

    def extra_repr(self) -> str:
        return f"window={self.window}" if self.window else ""


class SDPA(AttentionKernel):
    """Attention of (B, nh, S, hd) queries on (B, nkv, S, hd) keys/values through
    ``scaled_dot_product_attention`` (the fused kernel of the device); a window or ``doc_ids``
    (B, S) add a (B | 1, 1, S, S) boolean mask."""

    name = "sdpa"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
               ) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if mask.plain_causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(q.device)[:, None],
                                              enable_gqa=gqa)

    def block_path(self, q: torch.Tensor) -> str:
        # GPU-only: the CUDA flash kernels' log-sum-exp outputs are not wired; explicit maths
        return "flash" if q.device.type == "cpu" else "math"


class EagerAttention(AttentionKernel):
    """The same attention written out: ``softmax(q k^T / sqrt(hd) + mask) v`` in the inputs'
    dtype, the (B, nh, S, S) scores materialised (a reference; memory O(S^2))."""

    name = "eager"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
               ) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, nh, S, S)
        if mask.plain_causal:
            s = q.shape[2]
            hidden = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        else:
            hidden = ~mask.dense(q.device)[:, None]
        return scores.masked_fill(hidden, float("-inf")).softmax(dim=-1) @ v


class Registry:
    """Attention kernels by name: name -> class taking the window (its torch-free
    description must already be in :mod:`.attention_spec`)."""

    def __init__(self) -> None:
        self._items: dict[str, Callable[[int], AttentionKernel]] = {}

    def register(self, cls: type[AttentionKernel]) -> type[AttentionKernel]:
        attention_spec.spec(cls.name)  # (a kernel the planner cannot cost is refused)
        if cls.name in self._items:
            raise ValueError(f"attention kernel {cls.name!r} is registered twice")
        self._items[cls.name] = cls
        return cls

    def __getitem__(self, name: str) -> Callable[[int], AttentionKernel]:
        if name not in self._items:
            raise ValueError(f"attention kernel {name!r} is not one of {', '.join(self._items)}")
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)


ATTENTION = Registry()
ATTENTION.register(SDPA)
ATTENTION.register(EagerAttention)


def build_kernel(name: str, window: int = 0) -> AttentionKernel:
    """The registered kernel ``name`` for a model with sliding window ``window``."""
    return ATTENTION[name](window)


# Further kernels live in modules of their own, registered when ``models/llama.py`` (which
# builds the kernels) imports them.

__all__ = ["ATTENTION", "SDPA", "AttentionKernel", "EagerAttention", "Mask", "build_kernel",
           "document_mask"]
