"""FlexAttention (``model.attention=flex``): ``torch.nn.attention.flex_attention`` with a
block mask made from the model's mask rule.

The rule of :mod:`.attention` (causal, sliding window, documents) becomes a ``mask_mod`` over
(batch, head, query row, key row) that reads the rows' global positions and document ids;
``create_block_mask`` turns it into a :class:`BlockMask`: for each ``BLOCK x BLOCK`` tile,
whether it is empty (skipped), full (computed unmasked) or partial (masked element by element).
No (B, S, S) boolean mask is held -- the block mask is ``B (S / BLOCK)^2`` int32 entries, made
once per micro-batch and mask and shared by the layers (a small cache keyed by the document-id
tensor itself and the positions).

- **Forward** (whole sequences and ring blocks alike): ``flex_attention`` returns the output
  and the log-sum-exp the ring merge needs. On CUDA it runs compiled, the fused kernel
  (GPU-only path, untested here); on CPU torch's eager path (the scores of the call
  materialised in fp32, transiently).
- **Backward**: torch's flex backward runs on CUDA only, so meshlm's own tiled backward runs
  everywhere, for ring blocks and whole sequences: for each tile of query rows, only the key
  rows its positions may see (causal and window: a contiguous range, found on the host), with
  the tile's mask: ``P = exp(q k^T s - lse)``, ``dV += P^T dO``,
  ``dS = P (dO V^T - rowsum(dO O)) s``, ``dQ = dS K``, ``dK += dS^T Q`` -- the FlashAttention-2
  backward, skipping what the window leaves out. Given the final log-sum-exp, it is the
  gradient of a ring block as well.

Kept out of compiled blocks (``compilable = False``): it compiles flex itself where that pays
(CUDA). Communication: none. Memory: output and fp32 log-sum-exp saved for backward; the block
mask; backward transient per query tile: (B, nh, BLOCK, visible keys) fp32.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    flex_attention,
)

from .attention import ATTENTION, AttentionKernel, Mask
from .attention_blocks import block_backward
from .flex_spec import BLOCK

_compiled_flex: Any = None  # flex_attention compiled once per process (CUDA)


def _flex(device: torch.device) -> Any:
    """flex_attention as it runs on ``device``: compiled on CUDA (GPU-only path), eager on CPU
    (inputs without gradient: torch's flex has no CPU backward, meshlm supplies it)."""
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:  # GPU-only
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def mask_mod(mask: Mask, device: torch.device) -> Any:
    """The mask rule as flex's ``mask_mod(b, h, q_idx, k_idx) -> bool``."""
    qp = torch.from_numpy(mask.q_pos).to(device)
    kp = torch.from_numpy(mask.k_pos).to(device)
    window, q_ids, k_ids = mask.window, mask.q_ids, mask.k_ids

    def mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        rel = qp[q] - kp[k]
        ok = rel >= 0
        if window:
            ok = ok & (rel < window)
        if q_ids is not None:
            ok = ok & (q_ids[b, q] == k_ids[b, k])
        return ok

    return mod


class _BlockMasks:
    """Recently made block masks: a mask of the same positions, window and document-id tensors
    (the same objects, alive) is made once per micro-batch, not once per layer."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.items: list[tuple[tuple, list[weakref.ref], BlockMask]] = []

    def get(self, mask: Mask, device: torch.device) -> BlockMask:
        ids = [t for t in (mask.q_ids, mask.k_ids) if t is not None]
        key = (mask.q_pos.tobytes(), mask.k_pos.tobytes(), mask.window, str(device),
               tuple(id(t) for t in ids))
        for k, refs, made in self.items:
            if k == key and all(r() is t for r, t in zip(refs, ids, strict=True)):
                return made
        batch = None if mask.q_ids is None else mask.q_ids.shape[0]
        made = create_block_mask(mask_mod(mask, device), batch, None, len(mask.q_pos),
                                 len(mask.k_pos), device=device, BLOCK_SIZE=BLOCK)
        self.items = [(key, [weakref.ref(t) for t in ids], made), *self.items][:self.size]
        return made


BLOCK_MASKS = _BlockMasks()


def flex_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in q's dtype, fp32 log-sum-exp) of ``q`` on ``k``, ``v`` under ``mask``; rows
    that see no key get output 0 and log-sum-exp -inf."""
    block_mask = BLOCK_MASKS.get(mask, q.device)
    with torch.no_grad(), warnings.catch_warnings():
        # (CPU: the eager path is the intended one here, not a missed torch.compile)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out, aux = _flex(q.device)(q.detach(), k.detach(), v.detach(), block_mask=block_mask,
                                   enable_gqa=q.shape[1] != k.shape[1],
                                   return_aux=AuxRequest(lse=True))
    return out, aux.lse.float()


def tiled_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, mask: Mask, tile: int = BLOCK
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv given the final output and log-sum-exp of the query rows (module docstring):
    query tiles of ``tile`` rows against only the key rows their positions may see."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for t0 in range(0, q.shape[2], tile):
        rows = slice(t0, min(t0 + tile, q.shape[2]))
        qp = mask.q_pos[rows]
        hi = int(np.searchsorted(mask.k_pos, qp[-1], side="right"))  # keys at or before
        lo = int(np.searchsorted(mask.k_pos, qp[0] - mask.window, side="right")
                 ) if mask.window else 0
        if hi <= lo:
            continue  # (no key within reach of these rows)
        keys = slice(lo, hi)
        sub = Mask(qp, mask.k_pos[keys], mask.window,
                   None if mask.q_ids is None else mask.q_ids[:, rows],
                   None if mask.k_ids is None else mask.k_ids[:, keys])
        gq, gk, gv = block_backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys],
                                    v[:, :, keys], out[:, :, rows], lse[:, :, rows], False,
                                    "math", sub.dense(q.device))
        dq[:, :, rows] = gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Flex(torch.autograd.Function):
    """Whole-sequence attention: flex forward, the tiled backward."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # noqa: ANN001
                mask: Mask) -> torch.Tensor:
        out, lse = flex_forward(q, k, v, mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask = mask
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        return (*tiled_backward(dout.contiguous(), q, k, v, out, lse, ctx.mask), None)


class FlexAttention(AttentionKernel):
    """FlexAttention with the model's block mask (module docstring)."""

    name = "flex"
    compilable = False  # (compiles flex itself where that pays: CUDA)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
               ) -> torch.Tensor:
        return _Flex.apply(q, k, v, mask)

    def block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return flex_forward(q, k, v, mask)

    def block_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, mask: Mask
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tiled_backward(dout, q, k, v, out, lse, mask)


ATTENTION.register(FlexAttention)

__all__ = ["BLOCK_MASKS", "FlexAttention", "flex_forward", "mask_mod", "tiled_backward"]
