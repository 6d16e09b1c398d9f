"""Multi-head latent attention as the config and the planner see it (torch-free; the layer is
``models/mla.py``): its config keys, their checks, its parameter and FLOP counts, and its
projections' cost.

DeepSeek-V2/V3's multi-head latent attention (MLA) replaces grouped-query attention when
``model.kv_lora_rank`` > 0: keys and values come from a compressed latent of ``kv_lora_rank``
features (with its RMSNorm), queries through a ``q_lora_rank`` latent (0: a direct projection,
DeepSeek-V2-Lite); each head's query/key is a ``qk_nope_head_dim`` part and a
``qk_rope_head_dim`` rotary part (the rotary key shared by all heads), its value
``v_head_dim`` wide.

**Config** (:class:`MLAKeys`, a base of ``ModelConfig``): the five keys, their checks, and the
shape hooks ``ModelConfig`` asks of its attention layer -- the kind (``attention_layer`` =
"mla"), the query/key and value head widths, the rotated features, the norms inside attention,
the parameters and the score/value FLOPs.

Parameters per layer (the names of ``models/mla.py``): the query path
``dim * q_lora + q_lora + q_lora * n_heads * qk`` (``wq_a``, ``q_a_norm``, ``wq_b``; without a
query latent ``dim * n_heads * qk``, ``wq``), the key/value path
``dim * (kv_lora + rope) + kv_lora + kv_lora * n_heads * (nope + v)`` (``wkv_a``,
``kv_a_norm``, ``wkv_b``) and the output ``n_heads * v * dim`` (``wo``). FLOPs: the scores run
over ``qk = nope + rope`` features and the values over ``v``:
``6 * n_heads * (qk + v) * span`` per layer and trained token.

**Planner** (:class:`LatentCost`, registered in ``attention_cost.PROJECTIONS`` as "mla"), per
token on one of ``t`` tensor-parallel ranks:

- linears in forward order: ``wkv_a`` (h -> kv_lora + rope, replicated), ``wq_a``
  (h -> q_lora, replicated), ``wq_b`` (q_lora -> nh (nope + rope) / t) or ``wq``
  (h -> nh (nope + rope) / t) without a query latent, ``wkv_b`` (kv_lora -> nh (nope + v) / t),
  ``wo`` (nh v / t -> h);
- widths: queries and keys of ``nope + rope`` per head, values and output of ``v_head_dim``;
- saved for backward: the kernel's inputs (keys whole per head, the shared rotary key
  broadcast into them; values a view of ``wkv_b``'s output, whose storage stays), the output
  twice (the queries reach the kernel head-major, concatenated: torch's fused kernels then lay
  out their output likewise and the output projection's input is a copy; measured with
  saved-tensor hooks on CPU) and the latents (each latent norm's fp32 input and normalised
  copy -- 1/rms instead of the copy for a fused norm on a GPU -- and each up-projection's input
  in the compute dtype; the ``megatron`` profile: 16-bit norm inputs, up-projection inputs and
  the rotary key); two linears read the layer input (the down-projections);
- fused elements: rotary on the rope part of each query head and on the one shared rotary
  key, and the latent norms.

Communication: none of its own. Under tensor parallelism the replicated down-projections run
on whole tokens on every tp rank (their FLOPs counted on each); their weight gradients need no
reduction: the latents' gradient is all-reduced over the heads' shards before it reaches them
(one all-reduce of ``b s L`` values per layer and micro-batch backward, instead of the layer
input's ``b s h``: :meth:`LatentCost.latent_entry`, ``L = q_lora + kv_lora + rope``, or
``h + kv_lora + rope`` without a query latent), so it is whole and equal on every rank.
Memory: as :meth:`LatentCost.saved` and :meth:`LatentCost.params` state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..schema import declare
from .attention_cost import NORM_ELEMENTS, PROJECTIONS, ROTARY_ELEMENTS, ProjectionCost, Widths

# (models/config.py's ModelConfig, which lists this module: named for the annotations only)
ModelConfig = Any

_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class MLAKeys:
    """Multi-head latent attention's config keys and the shape hooks it answers (a base of
    ``ModelConfig``; each hook falls back to grouped-query attention's when
    ``kv_lora_rank`` is 0)."""

    q_lora_rank: int = declare(0, doc="width of MLA's query latent (0: a direct query projection)")
    kv_lora_rank: int = declare(
        0,
        doc="width of MLA's key-value latent (0: grouped-query attention, > 0: multi-head "
            "latent attention)")
    qk_nope_head_dim: int = declare(0, doc="MLA: the non-rotary part of a query/key head")
    qk_rope_head_dim: int = declare(
        0, doc="MLA: the rotary part of a query/key head (its key shared by all heads)")
    v_head_dim: int = declare(0, doc="MLA: the width of a value head")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3) instead of grouped-query attention."""
        return self.kv_lora_rank > 0

    def technique_problems(self: ModelConfig) -> list[str]:  # type: ignore[misc]
        out: list[str] = super().technique_problems()  # type: ignore[misc]
        for f in _KEYS:
            if getattr(self, f) < 0:
                out.append(f"model.{f} must be >= 0, got {getattr(self, f)}")
        if self.is_mla:
            for f in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, f) <= 0:
                    out.append(f"model.{f}={getattr(self, f)} must be positive with multi-head "
                               f"latent attention (model.kv_lora_rank={self.kv_lora_rank})")
            if self.qk_rope_head_dim % 2:
                out.append(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even for "
                           "rotary embeddings")
        elif self.q_lora_rank:
            out.append(f"model.q_lora_rank={self.q_lora_rank} needs multi-head latent "
                       "attention (model.kv_lora_rank > 0)")
        return out

    def head_problems(self: ModelConfig) -> list[str]:  # type: ignore[misc]
        # (MLA's head widths are its own keys: nothing derives them from dim / n_heads)
        return [] if self.is_mla else super().head_problems()  # type: ignore[misc]

    @property
    def attention_layer(self) -> str:
        return "mla" if self.is_mla else super().attention_layer  # type: ignore[misc]

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.is_mla else super().rope_dim  # type: ignore[misc]

    @property
    def qk_head_dim(self) -> int:
        if self.is_mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return super().qk_head_dim  # type: ignore[misc]

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else super().value_head_dim  # type: ignore[misc]

    def attention_norm_params(self) -> int:
        """The latent norms (``q_a_norm`` when ``q_lora_rank`` > 0, ``kv_a_norm``)."""
        if self.is_mla:
            return self.q_lora_rank + self.kv_lora_rank
        return super().attention_norm_params()  # type: ignore[misc]

    def attention_params(self: ModelConfig) -> int:  # type: ignore[misc]
        if not self.is_mla:
            return super().attention_params()  # type: ignore[misc]
        nh, rope = self.n_heads, self.qk_rope_head_dim
        q_out = nh * self.qk_head_dim
        q = (self.dim * self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank
             else self.dim * q_out)
        kv = (self.dim * (self.kv_lora_rank + rope)
              + self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim))
        o = nh * self.v_head_dim * self.dim
        return q + kv + o + self.attention_norm_params()

    def attention_flops(self: ModelConfig, seq_len: int) -> int:  # type: ignore[misc]
        if not self.is_mla:
            return super().attention_flops(seq_len)  # type: ignore[misc]
        span = self.attention_span(seq_len)
        return 6 * self.n_heads * (self.qk_head_dim + self.value_head_dim) * span

    def tp_split_heads(self: ModelConfig) -> tuple[tuple[str, str], ...]:  # type: ignore[misc]
        # (one head count: keys and values come from the shared latent)
        if self.is_mla:
            return (("n_heads", "query heads"),)
        return super().tp_split_heads()  # type: ignore[misc]


@dataclass(frozen=True)
class LatentCost(ProjectionCost):
    """Multi-head latent attention's projections (module docstring)."""

    def widths(self, c: ModelConfig) -> Widths:
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        nh, v = c.n_heads, c.v_head_dim
        return Widths(nh * qk, nh * qk, nh * v, nh * v, qk)

    def linears(self, c: ModelConfig, t: int) -> list[tuple[float, float]]:
        h, nh = c.dim, c.n_heads
        qk, nope, rope = (c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_nope_head_dim,
                          c.qk_rope_head_dim)
        out: list[tuple[float, float]] = [(h, c.kv_lora_rank + rope)]  # wkv_a (replicated)
        if c.q_lora_rank:
            out += [(h, c.q_lora_rank), (c.q_lora_rank, nh * qk / t)]  # wq_a, wq_b
        else:
            out.append((h, nh * qk / t))  # wq
        out.append((c.kv_lora_rank, nh * (nope + c.v_head_dim) / t))  # wkv_b
        out.append((nh * c.v_head_dim / t, h))  # wo
        return out

    def params(self, c: ModelConfig, t: int) -> float:
        return sum(i * o for i, o in self.linears(c, t)) + self.norms(c)

    def largest(self, c: ModelConfig, t: int) -> float:
        return max(i * o for i, o in self.linears(c, t))

    def readers(self, c: ModelConfig) -> int:
        return 2  # wkv_a and wq_a (or wq)

    def latent_entry(self, c: ModelConfig) -> int:
        # (the query latent, or the layer input for wq; the key-value latent, the rotary key)
        return (c.q_lora_rank or c.dim) + c.kv_lora_rank + c.qk_rope_head_dim

    def head_shared_norms(self, c: ModelConfig) -> list[int]:
        return []  # (the latent norms run on whole latents: their gradients are whole)

    def _latents(self, c: ModelConfig) -> list[int]:
        return [w for w in (c.q_lora_rank, c.kv_lora_rank) if w]

    def saved(self, c: ModelConfig, t: int, a: float, profile: str,
              fused_norm: bool = False) -> dict[str, float]:
        w = self.widths(c)
        nh, nope, v = c.n_heads, c.qk_nope_head_dim, c.v_head_dim
        latents = self._latents(c)
        if profile == "megatron":  # norm inputs, up-projection inputs, the rotary key
            kept = (2 * sum(latents) + c.qk_rope_head_dim) * 2.0
            return {"q k v": (w.q + w.k + w.v) * 2.0 / t, "attention out": w.out * 2.0 / t,
                    "latents": kept}
        # fp32 norm input (in fp32 a view of wkv_a's output: its rotary key stays with it) +
        # normalised (fused: 1/rms), the up-projection's input
        norm = sum((4 + (0 if fused_norm else 4)) * n + 4 for n in latents)
        kept = norm + sum(latents) * a + (c.qk_rope_head_dim * 4 if a == 4 else 0)
        # v is a view of wkv_b's output: its whole storage (keys' no-rotary part too) stays;
        # the queries are head-major (concatenated), so the kernel's output is not a view of
        # the output projection's input: both are kept
        return {"q k v": (w.q + w.k + nh * (nope + v)) * a / t,
                "attention out": 2 * w.out * a / t, "latents": kept}

    def compiled_saved(self, c: ModelConfig, t: int, a: float) -> dict[str, float]:
        out = super().compiled_saved(c, t, a)
        out["latents"] = sum(self._latents(c)) * a + 4 * len(self._latents(c))
        return out

    def fused_elements(self, c: ModelConfig, t: int) -> float:
        rotary = ROTARY_ELEMENTS * (c.n_heads * c.qk_rope_head_dim / t + c.qk_rope_head_dim)
        return rotary + NORM_ELEMENTS * sum(self._latents(c))


LATENT = PROJECTIONS.register(LatentCost(
    "mla", "multi-head latent attention: replicated down-projections to a query and a key/value "
           "latent, per-head up-projections (DeepSeek-V2/V3)"))

__all__ = ["LATENT", "LatentCost", "MLAKeys"]
