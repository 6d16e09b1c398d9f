"""Context-parallel attention as the planner sees it (torch-free): messages and the mask kept.

The modes themselves are :mod:`.context`, :mod:`.ring_attention` and :mod:`.ulysses` (torch);
``parallel.cp_attention`` accepts exactly the names here. Per layer and micro-batch, with
``T`` tokens of a micro-batch on a rank, the kernel's query, key, value and output widths
``q, k, v, o`` per token (grouped-query attention: ``q = o = nh hd``, ``k = v = kv hd``; each
kind of attention layer states its widths in ``models/attention_cost.py``) split over tp, ``a`` bytes per activation and
``F`` forward passes (2 under full recomputation: a recomputed forward communicates again):

- ``zigzag`` / ``ring`` (ring attention, ``ring_attention.py``; zigzag balances the causal
  work over the ranks): ``F (cp - 1)`` sends of one rank's K and V (``T (k + v) a``) forward
  and again backward, and ``cp - 1`` of the fp32 dK/dV accumulators backward, each with its
  receive; passed beside the attention of the previous block (exposed: what exceeds the
  attention compute). Each block's mask is built in forward and again in backward: none kept;
- ``ulysses`` (``ulysses.py``, the Ultra-Scale Playbook): four all-to-alls forward (q, k, v,
  output: ``T q a``, ``T k a``, ``T v a``, ``T o a``) and four backward, over the cp ranks:
  exposed. Attention runs over the whole sequence for ``1 / cp`` of the
  heads: its mask is kept per layer as without cp.

With cp, weight gradients are reduced over dp x cp (counted by the planner with the ZeRO
stage's messages).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Collective, Registry


@dataclass(frozen=True)
class ContextCost:
    """One context-parallel attention mode's cost (see the module docstring)."""

    name: str
    doc: str
    all_to_all: bool = False  # heads exchanged for the sequence (Ulysses); else a K/V ring

    @property
    def keeps_mask(self) -> bool:
        """Whether each layer keeps the attention mask (as without cp)."""
        return self.all_to_all

    def collectives(self, tokens: float, widths: tuple[int, int, int, int], tp: int,
                    a: float, cp: int, forwards: int, layers: int, m: int
                    ) -> list[Collective]:
        """One step's messages on a rank of ``layers`` layers (module docstring); ``widths``:
        the kernel's query, key, value and output features per token, before tp."""
        q, k, v, o = widths
        out = []
        if self.all_to_all:
            for pair in ((q, o), (k, v)):  # q and output; k and v (one kind when equal)
                for width in sorted(set(pair), key=pair.index):
                    nbytes = tokens * width / tp * a
                    calls = (forwards + 1) * layers * m * (2 if len(set(pair)) == 1 else 1)
                    out.append(Collective("all_to_all", nbytes, calls, "exposed"))
            return out
        kv = tokens * (k + v) / tp  # elements of one rank's K and V
        for op, overlap in (("send", "attention"), ("recv", "free")):
            out.append(Collective(op, kv * a, (forwards + 1) * (cp - 1) * layers * m, overlap))
            out.append(Collective(op, kv * 4, (cp - 1) * layers * m, overlap))  # fp32 dK/dV
        return out


CONTEXT: Registry[ContextCost] = Registry("context-parallel attention")
CONTEXT.register(ContextCost("zigzag", "ring attention over zigzag-balanced sequence shards"))
CONTEXT.register(ContextCost("ring", "ring attention over contiguous sequence shards"))
CONTEXT.register(ContextCost("ulysses", "all-to-all: sequence shards for head shards",
                             all_to_all=True))

__all__ = ["CONTEXT", "ContextCost"]
