"""Model shape: the one source of parameter and FLOP counts.

The trainer's MFU, the planner's memory and time models and ``meshlm info`` all read these
numbers, so they agree by construction. Counts are analytic (no weights are allocated), and
a test checks them against ``sum(p.numel())`` of a model built on the meta device.

FLOP convention (PaLM, Chowdhery et al. 2022, appendix B): per trained token,
``6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len``, where ``N_matmul`` counts every
weight that takes part in a matmul for that token (active experts only, the LM head included,
the embedding lookup excluded) and the second term is the attention score and value matmuls
(no discount for the causal mask; a sliding window ``W`` shorter than the sequence counts
``W`` keys per query, all a query can see). Attention parameters per layer (grouped-query
attention): ``dim * (n_heads + 2 n_kv_heads) * hd + n_heads * hd * dim``; Qwen3's query/key
norms add ``2 * head_dim``. Norms are parameters but no matmul weights.

Techniques that change the shape (another attention layer, extra blocks after the main model)
are bases of :class:`ModelConfig`, listed in ``models/techniques.py``: each brings its config
keys and overrides the hooks of :class:`ModelShape` it changes (the head widths, the attention
parameters and FLOPs, ``extra_blocks``, ``extra_params``, ``extra_matmul_params``), so every
count here includes it. Modules that published totals leave out are not in
:meth:`~ModelShape.num_params` but in :meth:`~ModelShape.extra_params`; their matmuls run in
training, so :meth:`~ModelShape.flops_per_token` counts them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..schema import declare
from . import flex_spec  # noqa: F401  (registers flex's description)
from .attention_spec import SPECS
from .techniques import KEYS

MOE_BALANCE = ("aux", "seq_aux", "bias")  # load-balancing methods (models/moe.py)
MOE_SCORES = ("softmax", "sigmoid")  # router scores (Mixtral / Qwen3-MoE, DeepSeek-V3)


@dataclass(frozen=True)
class ModelShape:
    """Shape of a Llama-style decoder, dense or Mixture-of-Experts, with grouped-query
    attention and no extra blocks: :class:`ModelConfig` adds the techniques' keys and hooks."""

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
        out += self.head_problems()
        if self.n_heads % self.n_kv_heads:
            out.append(
                f"model.n_heads={self.n_heads} is not divisible by "
                f"model.n_kv_heads={self.n_kv_heads} (grouped-query attention)"
            )
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
        return out + self._routing_problems() + self._rope_problems() + self.technique_problems()

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

    def _rope_problems(self) -> list[str]:
        out: list[str] = []
        if self.rope_original_max_len < 0:
            out.append(f"model.rope_original_max_len must be >= 0, got "
                       f"{self.rope_original_max_len}")
        if self.rope_factor < 1:
            out.append(f"model.rope_factor={self.rope_factor} must be >= 1 (1: no YaRN scaling)")
        elif self.rope_factor > 1 and self.rope_original_max_len <= 0:
            out.append(f"model.rope_factor={self.rope_factor} needs model.rope_original_max_len "
                       "(the context the model was trained at before YaRN)")
        return out

    # ------------------------------------------------------- hooks of the techniques
    # A technique that changes the shape is a base of ModelConfig (models/techniques.py) and
    # overrides these, calling super() for what it does not change.
    def technique_problems(self) -> list[str]:
        """Inconsistencies of the techniques' own keys."""
        return []

    def head_problems(self) -> list[str]:
        """Inconsistencies of the attention heads' widths."""
        out: list[str] = []
        if self.head_dim == 0 and self.dim % self.n_heads:
            out.append(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if self.hd % 2:
            out.append(f"head dimension {self.hd} must be even for rotary embeddings")
        return out

    def run_problems(self, seq_len: int) -> list[str]:
        """Inconsistencies with the training sequence length (``data.seq_len``)."""
        return []

    def extra_blocks(self) -> int:
        """Decoder blocks the techniques add after the ``n_layers`` of the main model."""
        return 0

    def extra_params(self, active: bool = False) -> int:
        """Parameters of modules the techniques add that published totals leave out."""
        return 0

    def extra_matmul_params(self) -> int:
        """Matmul weights per trained token of those modules (their blocks' attention is
        counted through :attr:`n_blocks`)."""
        return 0

    def info(self) -> dict[str, Any]:
        """Fields the techniques add to ``meshlm info``."""
        return {}

    @classmethod
    def info_columns(cls) -> list[tuple[str, str, str, str, str]]:
        """``meshlm info``'s columns of extra modules: (header, what they are, depth field,
        total field, active field), each field one of :meth:`info`'s."""
        return []

    def tp_split_heads(self) -> tuple[tuple[str, str], ...]:
        """(key, what) of each head count tensor parallelism splits."""
        return (("n_heads", "query heads"), ("n_kv_heads", "KV heads"))

    # ----------------------------------------------------------------- derived
    @property
    def hd(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def attention_layer(self) -> str:
        """The kind of attention layer, as ``models/attention_cost.py`` describes it ("gqa":
        grouped-query attention; a technique's layer names its own)."""
        return "gqa"

    @property
    def rope_dim(self) -> int:
        """Dimensions of a query/key head that are rotated."""
        return self.hd

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def expert_hidden(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.moe_first_dense

    @property
    def n_blocks(self) -> int:
        """Decoder blocks the model holds: its ``n_layers`` and those techniques add after them
        (ids ``n_layers`` ... ``n_blocks - 1``)."""
        return self.n_layers + self.extra_blocks()

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
        """Features of one query / key head."""
        return self.hd

    @property
    def value_head_dim(self) -> int:
        """Features of one value head."""
        return self.hd

    def attention_norm_params(self) -> int:
        """Norm weights inside one layer's attention (Qwen3's ``q_norm`` and ``k_norm``)."""
        return 2 * self.hd if self.qk_norm else 0

    def attention_params(self) -> int:
        """One layer's attention (no biases): q, k, v and output projections, with the norms
        inside attention."""
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
        """Decoder layer ``layer`` (ids from ``n_layers`` on are blocks techniques add: MoE
        when the model is)."""
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
        """All parameters (``active=True``: only those one token uses), the techniques' extra
        modules excluded (:meth:`extra_params`), as published totals count them."""
        layers = sum(self.layer_params(i, active) for i in range(self.n_layers))
        return self.embedding_params() + self.head_params() + layers + self.dim  # final norm

    def matmul_params(self) -> int:
        """Active weights taking part in a matmul per token: layers without norms, plus head
        (the main model's; :meth:`extra_matmul_params` for the techniques' extra modules)."""
        total = 0
        for i in range(self.n_layers):
            total += self.layer_matmul_params(i)
        return total + self.vocab_size * self.dim  # the LM head matmul runs even when tied

    def attention_flops(self, seq_len: int) -> int:
        """Score and value matmuls of one layer per trained token (forward + backward): scores
        over ``qk_head_dim``, values over ``value_head_dim``, ``attention_span`` keys per query
        (``12 n_heads hd span`` when both are ``hd``)."""
        span = self.attention_span(seq_len)
        return 12 * self.n_heads * self.hd * span

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, PaLM convention (see module doc),
        the techniques' extra modules included (:meth:`extra_matmul_params`)."""
        attn = self.n_blocks * self.attention_flops(seq_len)
        return 6.0 * (self.matmul_params() + self.extra_matmul_params()) + attn

    def attention_span(self, seq_len: int) -> int:
        """Keys one query's attention is counted over: the sequence, or the sliding window
        when shorter (its keys are all a query can see)."""
        return min(seq_len, self.sliding_window) if self.sliding_window else seq_len


@dataclass(frozen=True)
class ModelConfig(*KEYS, ModelShape):  # type: ignore[misc]
    """Shape of a Llama-style decoder, dense or Mixture-of-Experts, with the config keys of the
    techniques that change it (``models/techniques.py``)."""
