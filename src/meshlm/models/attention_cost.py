"""An attention layer's projections as the planner sees them (torch-free): one description per
kind of attention layer, picked by the model's shape (:func:`projection_cost`).

The layers themselves are ``Attention`` (``models/llama.py``: grouped-query attention, with
Qwen3's per-head query/key norms when ``model.qk_norm``) and multi-head latent attention
(``models/mla.py``, DeepSeek-V2/V3: ``model.kv_lora_rank`` > 0). The attention *kernel* (the
core between them: sdpa, eager, flex) is described apart, in :mod:`.attention_spec`. Per
token, on one of ``t`` tensor-parallel ranks (heads split over tp; what is not split says so):

- :meth:`~ProjectionCost.linears`: ``(in, out)`` features of each linear in forward order --
  GQA: ``wq`` (h -> nh hd / t), ``wk``, ``wv`` (h -> kv hd / t), ``wo`` (nh hd / t -> h); MLA:
  ``wkv_a`` (h -> kv_lora + rope, replicated), ``wq_a`` (h -> q_lora, replicated), ``wq_b``
  (q_lora -> nh (nope + rope) / t) or ``wq`` (h -> nh (nope + rope) / t) without a query
  latent, ``wkv_b`` (kv_lora -> nh (nope + v) / t), ``wo`` (nh v / t -> h). The GEMM time, the
  float8 linears, op-level recomputation's kept outputs and the largest weight read them;
- :meth:`~ProjectionCost.widths`: what the kernel computes on -- queries and keys of ``qk``
  features per head, values and output of ``v`` (GQA: ``hd`` both; MLA: ``nope + rope`` and
  ``v_head_dim``); scores cost ``2 qk`` and values ``2 v`` FLOPs per (query, key, head)
  forward, and context parallelism moves these K, V (ring) or Q, K, V, O (Ulysses) widths;
- :meth:`~ProjectionCost.saved`: bytes kept for backward, in the planner's item names: the
  kernel's inputs (``q k v``: MLA's keys are whole per head, the shared rotary key broadcast
  into them; its values a view of ``wkv_b``'s output, whose storage stays), the output (twice
  when the queries reach the kernel head-major -- MLA's concatenated queries, Qwen3's normed
  ones --: torch's fused kernels then lay out their output likewise and the output
  projection's input is a copy; measured with saved-tensor hooks on CPU) and, for MLA, the
  latents (``latents``: each latent norm's fp32 input and normalised copy -- 1/rms
  instead of the copy for a fused norm on a GPU -- and each up-projection's input in the
  compute dtype; the ``megatron`` profile: 16-bit norm inputs, up-projection inputs and the
  rotary key); Qwen3's query/key norms keep their fp32 inputs and normalised copies
  (``qk norms``). A region's input is read by :meth:`~ProjectionCost.readers` linears (3 for
  GQA's q, k, v; 2 for MLA's down-projections), each keeping its own 16-bit copy under
  autocast;
- :meth:`~ProjectionCost.fused_elements`: elements a fused attention block's own memory-bound
  kernels read and write per token, forward + backward: rotary on the query and key features
  it rotates (4 each: GQA all of them, MLA the rope part of each query head and the one shared
  rotary key) and norms inside attention (5 each: MLA's latents, Qwen3's query/key norms);
- what tensor parallelism's messages read (``parallel/tensor_cost.py``, as ``parallel/tensor.py``
  applies it): :meth:`~ProjectionCost.latent_entry`, the features per token that enter the
  heads' tp region after replicated projections (GQA: none, the layer input enters; MLA: the
  latents ``q_lora + kv_lora + rope``, ``h + kv_lora + rope`` with ``wq``), and
  :meth:`~ProjectionCost.head_shared_norms`, the norms every tp rank applies to its own heads
  with one weight (Qwen3's query/key norms: their gradients all-reduced over tp).

Communication: none of their own. Under tensor parallelism MLA's replicated down-projections
run on whole tokens on every tp rank (their FLOPs counted on each); their weight gradients
need no reduction: the latents' gradient is all-reduced over the heads' shards before it
reaches them (one all-reduce of ``b s L`` values per layer and micro-batch backward, instead
of the layer input's ``b s h``: :meth:`~ProjectionCost.latent_entry`), so it is whole and
equal on every rank, as the layer input is. Memory: as :meth:`~ProjectionCost.saved` and
:meth:`~ProjectionCost.params` state.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..named import Registry
from .config import ModelConfig

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


@dataclass(frozen=True)
class LatentCost(ProjectionCost):
    """Multi-head latent attention (``models/mla.py``): see the module docstring."""

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


PROJECTIONS: Registry[ProjectionCost] = Registry("attention projections")
PROJECTIONS.register(ProjectionCost(
    "gqa", "grouped-query attention: wq, wk, wv, wo split by heads (Llama, Mixtral, Qwen3)"))
PROJECTIONS.register(LatentCost(
    "mla", "multi-head latent attention: replicated down-projections to a query and a key/value "
           "latent, per-head up-projections (DeepSeek-V2/V3)"))


def projection_cost(c: ModelConfig) -> ProjectionCost:
    """The description of ``c``'s attention layers (``c.attention_layer``)."""
    return PROJECTIONS[c.attention_layer]


__all__ = ["NORM_ELEMENTS", "PROJECTIONS", "ROTARY_ELEMENTS", "LatentCost", "ProjectionCost",
           "Widths", "projection_cost"]
