"""Model shape: the one source of parameter and FLOP counts.

The trainer's MFU, the planner's memory and time models and ``meshlm info`` all read these
numbers, so they agree by construction. Counts are analytic (no weights are allocated), and
a test checks them against ``sum(p.numel())`` of a model built on the meta device.

FLOP convention (PaLM, Chowdhery et al. 2022, appendix B): per trained token,
``6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len``, where ``N_matmul`` counts every
weight that takes part in a matmul for that token (active experts only, the LM head included,
the embedding lookup excluded) and the second term is the attention score and value matmuls
(no discount for the causal mask; a sliding window ``W`` shorter than the sequence counts
``W`` keys per query, all a query can see). With multi-head latent attention (DeepSeek-V2/V3)
the scores run over ``qk = qk_nope_head_dim + qk_rope_head_dim`` features and the values over
``v_head_dim``: ``6 * n_layers * n_heads * (qk + v) * seq_len``.

Parameters of MLA's attention per layer (the names of ``models/mla.py``): the query path
``dim * q_lora + q_lora + q_lora * n_heads * qk`` (``wq_a``, ``q_a_norm``, ``wq_b``; without a
query latent ``dim * n_heads * qk``, ``wq``), the key/value path
``dim * (kv_lora + rope) + kv_lora + kv_lora * n_heads * (nope + v)`` (``wkv_a``, ``kv_a_norm``,
``wkv_b``) and the output ``n_heads * v * dim`` (``wo``); Qwen3's query/key norms add
``2 * head_dim``. Norms are parameters but no matmul weights.

Multi-token prediction (``mtp_depth`` > 0, DeepSeek-V3) is not in :meth:`num_params`, as the
published totals leave it out (DeepSeek-V3: 671 B without its MTP module): each depth is
``enorm``, ``hnorm`` (``2 dim``), ``proj`` (``2 dim * dim``), one decoder block (layer id
``n_layers + k``, MoE when the model is) and a ``norm`` (``dim``), counted by
:meth:`mtp_params`; the embedding and the LM head are shared. Its matmuls run in training, so
:meth:`flops_per_token` counts them: ``proj``, the block (with its attention) and the LM head
once more per depth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..schema import declare
from . import flex_spec  # noqa: F401  (registers flex's description)
from .attention_spec import SPECS

MOE_BALANCE = ("aux", "seq_aux", "bias")  # load-balancing methods (models/moe.py)
MOE_SCORES = ("softmax", "sigmoid")  # router scores (Mixtral / Qwen3-MoE, DeepSeek-V3)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder, dense or Mixture-of-Experts."""

    name: str = "custom"
    vocab_size: int = 4096
    dim: int = declare(256, doc="hidden size of the residual stream")
    n_layers: int = declare(4, doc="decoder layers")
    n_heads: int = declare(4, doc="query heads")
    n_kv_heads: int = declare(4, doc="key/value heads (grouped-query attention: divides n_heads)")
    ffn_hidden: int = declare(688, doc="width of the dense SwiGLU MLP")
    head_dim: int = declare(0, doc="width of a query/key/value head (0: dim / n_heads)")
    norm_eps: float = declare(1e-5, doc="RMSNorm epsilon")
    rope_theta: float = declare(10000.0, doc="rotary base frequency")
    max_seq_len: int = declare(2048, doc="longest sequence the rotary tables cover")
    tie_embeddings: bool = declare(False, doc="the LM head shares the embedding's weight")
    init_std: float = declare(
        0.02,
        doc="standard deviation of the initial weights (residual outputs scaled by 1/sqrt(2 "
            "n_layers))")
    # Mixture of Experts (moe_experts == 0 -> dense model)
    moe_experts: int = declare(0, doc="routed experts per MoE layer (0: a dense model)")
    moe_topk: int = declare(2, doc="experts each token is routed to")
    moe_ffn_hidden: int = declare(0, doc="width of one expert (0: ffn_hidden)")
    moe_shared_experts: int = declare(
        0, doc="shared experts every token passes, each moe_ffn_hidden wide")
    moe_first_dense: int = declare(0, doc="the first k layers keep a dense MLP (DeepSeek-V3: 3)")
    moe_aux_loss_coef: float = declare(0.01, doc="weight of the aux / seq_aux balancing loss")
    # load balancing: "aux" (Switch loss on each global micro-batch's statistics), "seq_aux"
    # (the same per sequence, DeepSeek-V3), "bias" (auxiliary-loss-free: a per-expert bias on
    # the top-k selection, moved by moe_bias_rate against each step's load error)
    moe_balance: str = declare(
        "aux",
        doc="load balancing: aux (Switch loss on the global micro-batch), seq_aux (per "
            "sequence), bias (auxiliary-loss-free selection bias)")
    moe_bias_rate: float = declare(0.001, doc="step of the bias balancing per optimizer step")
    moe_capacity: float = declare(
        0.0,
        doc="capacity factor per expert and sequence (0: dropless); copies past it are "
            "dropped")
    # the attention kernel (a name registered in models/attention.py, described for the
    # planner in models/attention_spec.py) and the sliding window: a query sees the keys at
    # most sliding_window - 1 positions before it (0: every earlier key; Mistral, gpt-oss)
    attention: str = declare(
        "sdpa", doc="the attention kernel: sdpa | eager | flex (models/attention.py)")
    sliding_window: int = declare(
        0, doc="a query sees the last N positions, itself included (0: every earlier one)")
    # Routing as published: the router's scores (softmax: Mixtral, Qwen3-MoE; sigmoid:
    # DeepSeek-V3), whether the top-k weights are renormalised to sum to 1 (Qwen3's
    # norm_topk_prob), group-limited selection (DeepSeek-V3: the experts in moe_n_group groups,
    # the top-k taken inside the moe_topk_group best groups) and the routed output's scale
    # (DeepSeek-V3's routed_scaling_factor)
    moe_score: str = declare(
        "softmax", doc="router scores: softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3)")
    moe_norm_topk: bool = declare(
        True, doc="renormalise the chosen experts' weights to sum to 1 (Qwen3's norm_topk_prob)")
    moe_n_group: int = declare(1, doc="expert groups of group-limited routing (DeepSeek-V3: 8)")
    moe_topk_group: int = declare(1, doc="best groups the top-k is chosen inside (DeepSeek-V3: 4)")
    moe_routed_scale: float = declare(
        1.0, doc="scale of the routed experts' output (DeepSeek-V3's routed_scaling_factor)")
    # Multi-head latent attention (DeepSeek-V2/V3) when kv_lora_rank > 0: keys and values from
    # a compressed latent of kv_lora_rank (with its RMSNorm), queries through a q_lora_rank
    # latent (0: a direct projection, DeepSeek-V2-Lite); each head's query/key is a
    # qk_nope_head_dim part and a qk_rope_head_dim rotary part (the rotary key shared by all
    # heads), its value v_head_dim wide
    q_lora_rank: int = declare(0, doc="width of MLA's query latent (0: a direct query projection)")
    kv_lora_rank: int = declare(
        0,
        doc="width of MLA's key-value latent (0: grouped-query attention, > 0: multi-head "
            "latent attention)")
    qk_nope_head_dim: int = declare(0, doc="MLA: the non-rotary part of a query/key head")
    qk_rope_head_dim: int = declare(
        0, doc="MLA: the rotary part of a query/key head (its key shared by all heads)")
    v_head_dim: int = declare(0, doc="MLA: the width of a value head")
    # YaRN rotary scaling (Peng et al. 2023; DeepSeek-V3's rope_scaling) when rope_factor > 1:
    # the context rope_original_max_len was trained at, stretched rope_factor times
    rope_factor: float = declare(
        1.0, doc="YaRN: how many times the trained context is stretched (1: no scaling)")
    rope_original_max_len: int = declare(0, doc="YaRN: the context the model was trained at")
    rope_beta_fast: float = declare(
        32.0, doc="YaRN: rotations per context above which a frequency is kept")
    rope_beta_slow: float = declare(
        1.0, doc="YaRN: rotations per context below which a frequency is interpolated")
    rope_mscale: float = declare(1.0, doc="YaRN: attention temperature factor")
    rope_mscale_all_dim: float = declare(
        0.0, doc="YaRN: the temperature factor's divisor (DeepSeek's mscale_all_dim)")
    # RMSNorm of each head's query and key before the rotation (Qwen3)
    qk_norm: bool = declare(
        False, doc="RMSNorm of each head's query and key before the rotation (Qwen3)")
    # Multi-token prediction (DeepSeek-V3): mtp_depth extra modules, depth k predicting the
    # token k + 1 ahead; their mean loss enters the objective times mtp_loss_weight
    mtp_depth: int = declare(
        0,
        doc="multi-token prediction modules (DeepSeek-V3: 1); depth k predicts the token k + "
            "1 ahead")
    mtp_loss_weight: float = declare(
        0.3, doc="weight of the multi-token prediction loss (mean over depths) in the objective")

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    # ----------------------------------------------------------------- validation
    def problems(self) -> list[str]:
        """Every inconsistency of the shape, as messages naming the field."""
        out: list[str] = []
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"):
            if getattr(self, f) <= 0:
                out.append(f"model.{f} must be positive, got {getattr(self, f)}")
        for f in ("head_dim", "moe_ffn_hidden", "moe_shared_experts", "moe_first_dense"):
            if getattr(self, f) < 0:
                out.append(f"model.{f} must be >= 0, got {getattr(self, f)}")
        for f in ("rope_theta", "init_std", "max_seq_len"):
            if not getattr(self, f) > 0:
                out.append(f"model.{f} must be positive, got {getattr(self, f)}")
        if self.moe_aux_loss_coef < 0:
            out.append(f"model.moe_aux_loss_coef={self.moe_aux_loss_coef} must be >= 0")
        if out:
            return out
        if not self.is_mla and self.head_dim == 0 and self.dim % self.n_heads:
            out.append(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            out.append(
                f"model.n_heads={self.n_heads} is not divisible by "
                f"model.n_kv_heads={self.n_kv_heads} (grouped-query attention)"
            )
        if not self.is_mla and self.hd % 2:
            out.append(f"head dimension {self.hd} must be even for rotary embeddings")
        if self.moe_experts < 0 or (self.moe_experts and not 1 <= self.moe_topk <= self.moe_experts):
            out.append(
                f"model.moe_topk={self.moe_topk} must lie in [1, moe_experts={self.moe_experts}]"
            )
        if self.moe_balance not in MOE_BALANCE:
            out.append(f"model.moe_balance={self.moe_balance!r} is not one of "
                       f"{', '.join(MOE_BALANCE)}")
        if self.moe_capacity < 0:
            out.append(f"model.moe_capacity={self.moe_capacity} must be >= 0 (0: dropless)")
        if self.moe_bias_rate < 0:
            out.append(f"model.moe_bias_rate={self.moe_bias_rate} must be >= 0")
        if self.sliding_window < 0:
            out.append(f"model.sliding_window={self.sliding_window} must be >= 0 (0: none)")
        if self.attention not in SPECS:
            out.append(f"model.attention={self.attention!r} is not one of {', '.join(SPECS)}")
        if self.moe_first_dense > self.n_layers:
            out.append(f"model.moe_first_dense={self.moe_first_dense} exceeds n_layers")
        return out + self._routing_problems() + self._mla_problems() + self._mtp_problems()

    def _routing_problems(self) -> list[str]:
        out: list[str] = []
        if self.moe_score not in MOE_SCORES:
            out.append(f"model.moe_score={self.moe_score!r} is not one of {', '.join(MOE_SCORES)}")
        if not self.moe_routed_scale > 0:
            out.append(f"model.moe_routed_scale={self.moe_routed_scale} must be positive")
        g, tg = self.moe_n_group, self.moe_topk_group
        if g < 1 or tg < 1:
            out.append(f"model.moe_n_group={g} and model.moe_topk_group={tg} must be >= 1")
        elif tg > g:
            out.append(f"model.moe_topk_group={tg} exceeds model.moe_n_group={g} (the groups "
                       "the top-k is taken from are some of the n_group groups)")
        elif self.is_moe and self.moe_experts % g:
            out.append(f"model.moe_n_group={g} does not divide model.moe_experts="
                       f"{self.moe_experts} (experts fall into n_group equal groups)")
        elif self.is_moe and g > 1 and self.moe_topk > tg * (self.moe_experts // g):
            out.append(f"model.moe_topk={self.moe_topk} exceeds the experts of "
                       f"model.moe_topk_group={tg} groups ({tg * (self.moe_experts // g)})")
        return out

    def _mla_problems(self) -> list[str]:
        out: list[str] = []
        for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "rope_original_max_len"):
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
        if self.rope_factor < 1:
            out.append(f"model.rope_factor={self.rope_factor} must be >= 1 (1: no YaRN scaling)")
        elif self.rope_factor > 1 and self.rope_original_max_len <= 0:
            out.append(f"model.rope_factor={self.rope_factor} needs model.rope_original_max_len "
                       "(the context the model was trained at before YaRN)")
        return out

    def _mtp_problems(self) -> list[str]:
        out: list[str] = []
        if self.mtp_depth < 0:
            out.append(f"model.mtp_depth={self.mtp_depth} must be >= 0 (0: no multi-token "
                       "prediction)")
        if self.mtp_loss_weight < 0:
            out.append(f"model.mtp_loss_weight={self.mtp_loss_weight} must be >= 0")
        return out

    # ----------------------------------------------------------------- derived
    @property
    def hd(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3) instead of grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def attention_layer(self) -> str:
        """The kind of attention layer, as ``models/attention_cost.py`` describes it: "mla"
        (multi-head latent attention) or "gqa" (grouped-query attention)."""
        return "mla" if self.is_mla else "gqa"

    @property
    def rope_dim(self) -> int:
        """Dimensions of a query/key head that are rotated (MLA: only its rotary part)."""
        return self.qk_rope_head_dim if self.is_mla else self.hd

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def expert_hidden(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.moe_first_dense

    @property
    def n_moe_layers(self) -> int:
        return max(0, self.n_layers - self.moe_first_dense) if self.is_moe else 0

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # ----------------------------------------------------------------- counts
    @property
    def qk_head_dim(self) -> int:
        """Features of one query / key head: MLA's no-rotary plus rotary parts, else ``hd``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.hd

    @property
    def value_head_dim(self) -> int:
        """Features of one value head (MLA: ``v_head_dim``, else ``hd``)."""
        return self.v_head_dim if self.is_mla else self.hd

    def attention_norm_params(self) -> int:
        """Norm weights inside one layer's attention: MLA's latent norms (``q_a_norm`` when
        ``q_lora_rank`` > 0, ``kv_a_norm``), Qwen3's ``q_norm`` and ``k_norm``."""
        if self.is_mla:
            return self.q_lora_rank + self.kv_lora_rank
        return 2 * self.hd if self.qk_norm else 0

    def attention_params(self) -> int:
        """One layer's attention (no biases): q, k, v and output projections, or MLA's
        projections (module docstring), with the norms inside attention."""
        if self.is_mla:
            nh, rope = self.n_heads, self.qk_rope_head_dim
            q_out = nh * self.qk_head_dim
            q = (self.dim * self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank
                 else self.dim * q_out)
            kv = (self.dim * (self.kv_lora_rank + rope)
                  + self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim))
            o = nh * self.v_head_dim * self.dim
            return q + kv + o + self.attention_norm_params()
        q = self.dim * self.n_heads * self.hd
        kv = 2 * self.dim * self.n_kv_heads * self.hd
        o = self.n_heads * self.hd * self.dim
        return q + kv + o + self.attention_norm_params()

    def mlp_params(self, hidden: int | None = None) -> int:
        """One SwiGLU MLP: gate, up and down projections."""
        return 3 * self.dim * (hidden or self.ffn_hidden)

    def moe_params(self) -> tuple[int, int]:
        """(total, active-per-token) parameters of one MoE MLP, router included."""
        router = self.dim * self.moe_experts
        expert = self.mlp_params(self.expert_hidden)
        shared = self.moe_shared_experts * expert
        total = router + self.moe_experts * expert + shared
        active = router + self.moe_topk * expert + shared
        return total, active

    def layer_params(self, layer: int, active: bool = False) -> int:
        """Decoder layer ``layer`` (ids from ``n_layers`` on are MTP blocks: MoE when the
        model is)."""
        norms = 2 * self.dim
        if self.is_moe_layer(layer):
            total, act = self.moe_params()
            mlp = act if active else total
        else:
            mlp = self.mlp_params()
        return self.attention_params() + mlp + norms

    def layer_matmul_params(self, layer: int) -> int:
        """Weights of layer ``layer`` that take part in a matmul for one token (active experts
        only): the layer less its norms."""
        return self.layer_params(layer, active=True) - 2 * self.dim - self.attention_norm_params()

    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    def head_params(self) -> int:
        """Output projection (0 extra parameters when tied to the embedding)."""
        return 0 if self.tie_embeddings else self.vocab_size * self.dim

    def num_params(self, active: bool = False) -> int:
        """All parameters (``active=True``: only those one token uses), multi-token prediction
        excluded (:meth:`mtp_params`), as published totals count them."""
        layers = sum(self.layer_params(i, active) for i in range(self.n_layers))
        return self.embedding_params() + self.head_params() + layers + self.dim  # final norm

    def mtp_depth_params(self, k: int, active: bool = False) -> int:
        """Multi-token prediction module ``k``: ``enorm``, ``hnorm``, ``proj`` (2 dim -> dim),
        a decoder block (layer id ``n_layers + k``) and its ``norm``; the embedding and the
        output head are the main model's (not counted here)."""
        return 3 * self.dim + 2 * self.dim * self.dim + self.layer_params(self.n_layers + k, active)

    def mtp_params(self, active: bool = False) -> int:
        """Parameters of the multi-token prediction modules (0 without them); a model built
        with ``mtp_depth`` > 0 holds ``num_params() + mtp_params()``."""
        return sum(self.mtp_depth_params(k, active) for k in range(self.mtp_depth))

    def matmul_params(self) -> int:
        """Active weights taking part in a matmul per token: layers without norms, plus head
        (the main model's; :meth:`mtp_matmul_params` for multi-token prediction's)."""
        total = 0
        for i in range(self.n_layers):
            total += self.layer_matmul_params(i)
        return total + self.vocab_size * self.dim  # the LM head matmul runs even when tied

    def mtp_matmul_params(self) -> int:
        """Multi-token prediction's matmul weights per token: per depth ``proj``, the block's
        active weights and the shared LM head, which runs once more."""
        return sum(2 * self.dim * self.dim + self.layer_matmul_params(self.n_layers + k)
                   + self.vocab_size * self.dim for k in range(self.mtp_depth))

    def attention_flops(self, seq_len: int) -> int:
        """Score and value matmuls of one layer per trained token (forward + backward): scores
        over ``qk_head_dim``, values over ``value_head_dim``, ``attention_span`` keys per query
        (``12 n_heads hd span`` when both are ``hd``)."""
        span = self.attention_span(seq_len)
        if self.is_mla:
            return 6 * self.n_heads * (self.qk_head_dim + self.value_head_dim) * span
        return 12 * self.n_heads * self.hd * span

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, PaLM convention (see module doc),
        multi-token prediction's modules included when the model has them."""
        layers = self.n_layers + self.mtp_depth
        attn = layers * self.attention_flops(seq_len)
        return 6.0 * (self.matmul_params() + self.mtp_matmul_params()) + attn

    def attention_span(self, seq_len: int) -> int:
        """Keys one query's attention is counted over: the sequence, or the sliding window
        when shorter (its keys are all a query can see)."""
        return min(seq_len, self.sliding_window) if self.sliding_window else seq_len
