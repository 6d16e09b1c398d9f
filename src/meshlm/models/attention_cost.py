"""An attention layer's projections as the planner sees them (torch-free): one description per
kind of attention layer, registered in :data:`PROJECTIONS` under ``ModelConfig.attention_layer``
(:func:`projection_cost`).

The base class describes ``Attention`` (``models/llama.py``: grouped-query attention, with
Qwen3's per-head query/key norms when ``model.qk_norm``); another kind of attention layer
registers its own description beside its layer. The attention *kernel* (the core between the
projections: sdpa, eager, flex) is described apart, in :mod:`.attention_spec`. Per token, on one
of ``t`` tensor-parallel ranks (heads split over tp; what is not split says so):

- :meth:`~ProjectionCost.linears`: ``(in, out)`` features of each linear in forward order --
  ``wq`` (h -> nh hd / t), ``wk``, ``wv`` (h -> kv hd / t), ``wo`` (nh hd / t -> h). The GEMM
  time, the float8 linears, op-level recomputation's kept outputs and the largest weight read
  them;
- :meth:`~ProjectionCost.widths`: what the kernel computes on -- queries and keys of ``qk``
  features per head, values and output of ``v`` (``hd`` both); scores cost ``2 qk`` and values
  ``2 v`` FLOPs per (query, key, head) forward, and context parallelism moves these K, V
  (ring) or Q, K, V, O (Ulysses) widths;
- :meth:`~ProjectionCost.saved`: bytes kept for backward, in the planner's item names: the
  kernel's inputs (``q k v``), the output (twice when the queries reach the kernel head-major
  -- Qwen3's normed ones --: torch's fused kernels then lay out their output likewise and the
  output projection's input is a copy; measured with saved-tensor hooks on CPU) and a layer's
  own items (Qwen3's query/key norms keep their fp32 inputs and normalised copies:
  ``qk norms``). A region's input is read by :meth:`~ProjectionCost.readers` linears (3 for
  q, k, v), each keeping its own 16-bit copy under autocast;
- :meth:`~ProjectionCost.fused_elements`: elements a fused attention block's own memory-bound
  kernels read and write per token, forward + backward: rotary on the query and key features
  it rotates (4 each) and norms inside attention (5 each: Qwen3's query/key norms);
- what tensor parallelism's messages read (``parallel/tensor_cost.py``, as ``parallel/tensor.py``
  applies it): :meth:`~ProjectionCost.latent_entry`, the features per token that enter the
  heads' tp region after replicated projections (0: the layer input enters), and
  :meth:`~ProjectionCost.head_shared_norms`, the norms every tp rank applies to its own heads
  with one weight (Qwen3's query/key norms: their gradients all-reduced over tp).

Communication: none of their own. Memory: as :meth:`~ProjectionCost.saved` and
:meth:`~ProjectionCost.params` state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..named import Registry

# (models/config.py's ModelConfig, which lists this module: named for the annotations only)
ModelConfig = Any

ROTARY_ELEMENTS = 4.0  # per rotated feature: read + write forward, read + write backward
NORM_ELEMENTS = 5.0  # per normalised feature: forward 2 (x -> y), backward 3 (x, dy -> dx)


@dataclass(frozen=True)
class Widths:
    """Features per token the kernel computes on (whole, before tp): queries, keys, values,
    output; ``head_dim``: the query/key head width (the fused kernel's rate depends on it)."""

    q: int
    k: int
    v: int
    out: int
    head_dim: int


@dataclass(frozen=True)
class ProjectionCost:
    """One kind of attention layer's projections, as the planner reads them (module
    docstring). The base class is grouped-query attention (``Attention``)."""

    name: str
    doc: str

    def widths(self, c: ModelConfig) -> Widths:
        hq, kv = c.n_heads * c.hd, c.n_kv_heads * c.hd
        return Widths(hq, kv, kv, hq, c.hd)

    def linears(self, c: ModelConfig, t: int) -> list[tuple[float, float]]:
        hq, kv, h = c.n_heads * c.hd, c.n_kv_heads * c.hd, c.dim
        return [(h, hq / t), (h, kv / t), (h, kv / t), (hq / t, h)]

    def norms(self, c: ModelConfig) -> int:
        """Norm weights inside attention (replicated over tp)."""
        return c.attention_norm_params()

    def params(self, c: ModelConfig, t: int) -> float:
        """Parameters of one layer's attention on a rank: the split weights / t, the rest."""
        return (c.attention_params() - self.norms(c)) / t + self.norms(c)

    def largest(self, c: ModelConfig, t: int) -> float:
        """Elements of the largest attention weight on a rank."""
        return c.n_heads * c.hd * c.dim / t

    def readers(self, c: ModelConfig) -> int:
        """Linears reading the attention region's input (each keeps its copy under autocast)."""
        return 3

    def latent_entry(self, c: ModelConfig) -> int:
        """Features per token entering the heads' tp region after replicated projections
        (0: the layer input enters it)."""
        return 0

    def head_shared_norms(self, c: ModelConfig) -> list[int]:
        """Widths of the norms each tp rank applies to its own heads with one shared weight."""
        return [c.hd, c.hd] if c.qk_norm else []

    def saved(self, c: ModelConfig, t: int, a: float, profile: str,
              fused_norm: bool = False) -> dict[str, float]:
        """Bytes per token kept for backward by the projections and the kernel's inputs and
        output (the kernel's own log-sum-exp or scores are the planner's ``scores``)."""
        w = self.widths(c)
        out = {"q k v": (w.q + w.k + w.v) * a / t, "attention out": w.out * a / t}
        if c.qk_norm:  # per-head norms of q and k: fp32 input, normalised copy, 1/rms
            hq, kv = c.n_heads * c.hd, c.n_kv_heads * c.hd
            per = 2 if profile == "megatron" else (4 + (0 if fused_norm else 4))
            out["qk norms"] = ((hq + kv) * per + 4 * (c.n_heads + c.n_kv_heads)) / t
            if profile != "megatron":  # head-major queries: the kernel's output is a copy
                out["attention out"] *= 2
        return out

    def compiled_saved(self, c: ModelConfig, t: int, a: float) -> dict[str, float]:
        """Bytes per token a compiled block keeps of the projections: the kernel's inputs, its
        output twice (the kernel's and the output projection's layout)."""
        w = self.widths(c)
        return {"q k v": (w.q + w.k + w.v) * a / t, "attention out": 2 * w.out * a / t}

    def fused_elements(self, c: ModelConfig, t: int) -> float:
        """Elements per token (compute dtype) of the fused rotary and attention norms."""
        hq, kv = c.n_heads * c.hd, c.n_kv_heads * c.hd
        rotary = ROTARY_ELEMENTS * hq / t + ROTARY_ELEMENTS * kv / t
        return rotary + (NORM_ELEMENTS * (hq + kv) / t if c.qk_norm else 0.0)


PROJECTIONS: Registry[ProjectionCost] = Registry("attention projections")
PROJECTIONS.register(ProjectionCost(
    "gqa", "grouped-query attention: wq, wk, wv, wo split by heads (Llama, Mixtral, Qwen3)"))


def projection_cost(c: ModelConfig) -> ProjectionCost:
    """The description of ``c``'s attention layers (``c.attention_layer``)."""
    return PROJECTIONS[c.attention_layer]


__all__ = ["NORM_ELEMENTS", "PROJECTIONS", "ROTARY_ELEMENTS", "ProjectionCost", "Widths",
           "projection_cost"]
