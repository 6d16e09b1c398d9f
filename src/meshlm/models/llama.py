"""Llama-style decoder in plain single-device PyTorch.

Token embedding -> n_layers x [RMSNorm -> grouped-query attention (RoPE, causal SDPA) ->
residual -> RMSNorm -> SwiGLU MLP (or MoE) -> residual] -> RMSNorm -> LM head.

Parallelism is applied from outside (``meshlm.parallelize``), never written here. The module
names (``layers.{i}.attention.wq`` ...) are the parameter names of checkpoints; the rotary
convention is the "rotate half" one of Hugging Face Llama, so HF weights load by renaming only.

Extension points -- declared slots the model's own forwards call, filled in one place by
``meshlm.parallel.extensions`` and shown by ``print(model)``:

- ``Attention.kernel`` (the same slot in every attention layer, ``layers.KernelSlot``; the
  layer a block holds is the registered one ``ModelConfig.attention_layer`` names,
  ``layers.ATTENTION_LAYERS``): the attention core, a parameterless
  module: the registered kernel ``model.attention`` names (``models/attention.py``: ``sdpa``
  by default), with context parallelism's ring / all-to-all composed around it, or wrapped
  to be recomputed or kept out of compiled graphs;
- ``Block.run_layer`` / ``Block.run_ffn``: how the layer / its feed-forward is run (compiled,
  recomputed, kept eager); None runs it directly. ``Block.choices`` names them (its repr);
- ``Transformer.head_input`` (a module: what the LM head's input passes first) and
  ``Transformer.run_head`` (how the final norm + head is run).

Document masking (``data.doc_mask``): inside ``with model.packed(doc_ids):`` -- ``doc_ids``
(B, S) the document index of every position of the packed sequences -- attention stays inside
each document and rotary positions restart at each document's first token. The ids travel to
every layer and kernel as an argument (so recomputation and compiled blocks see the ids of the
micro-batch they run), never as state read later. Copied to the device, they keep the host
tensor they came from (:func:`host_copy`): what is decided from them on the host (ring
attention's skipped blocks) never waits for the device.

Initial weights depend only on (seed, model config): every parameter is drawn from its own
generator seeded by (seed, parameter name), so any layout can materialise exactly the tensor
a single-process run would have.

Memory (fp32, one rank): 4 bytes per parameter; activations per layer roughly
``b * s * (34 h + 5 a s)`` bytes with eager attention (Korthikanti et al. 2022), less with SDPA.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from . import (
    attention_layers,  # noqa: F401  (registers the techniques' attention layers)
    flex_attention,  # noqa: F401  (registers the flex kernel)
    training_heads,  # noqa: F401  (registers the techniques' extra training heads)
)
from .attention import SDPA, EagerAttention, build_kernel, document_mask  # noqa: F401  (re-exported)
from .config import ModelConfig
from .heads import TRAINING_HEADS, TrainingHead
from .layers import (  # noqa: F401  (KernelSlot, rms_norm re-exported)
    KernelSlot,
    RMSNorm,
    apply_rope,
    build_attention_layer,
    register_attention_layer,
    rms_norm,
)
from .moe import MoE, SwiGLU
from .rope import model_rope_tables, rope_tables  # noqa: F401  (rope_tables re-exported)


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) position of every token inside its document: 0 at each document's first token
    (a document cut by the window's start begins at 0 there too)."""
    s = doc_ids.shape[-1]
    ar = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    first = torch.where(start, ar, torch.zeros_like(ar)).cummax(dim=-1).values
    return ar - first


HOST_COPY = "host_copy"  # the attribute of device document ids naming their host tensor


def with_host_copy(doc_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``doc_ids`` on ``device``, remembering the host tensor they came from (when they came
    from one, as the data pipeline's do): see :func:`host_copy`."""
    out = doc_ids.to(device)
    if doc_ids.device.type == "cpu":
        # (an alias, not the tensor itself: when ``out`` is ``doc_ids`` no cycle is made)
        setattr(out, HOST_COPY, doc_ids.detach())
    return out


def host_copy(doc_ids: torch.Tensor) -> torch.Tensor | None:
    """The host tensor device document ids were copied from (None: unknown), so that
    decisions taken on the host -- which ring-attention blocks documents mask entirely --
    read them without waiting for the device."""
    return getattr(doc_ids, HOST_COPY, None)


@register_attention_layer("gqa")
class Attention(KernelSlot):
    """Grouped-query causal self-attention; the core is the module ``kernel``, the registered
    kernel ``model.attention`` names (default :class:`SDPA`), with the model's sliding window.

    ``model.qk_norm`` (Qwen3): each query and key head is RMS-normalised (``q_norm``,
    ``k_norm``: one weight of ``head_dim`` shared by all heads) before the rotation."""

    linears = ("wq", "wk", "wv", "wo")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.hd
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.hd, cfg.dim, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.hd, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.hd, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *doc_ids: torch.Tensor) -> torch.Tensor:
        """``doc_ids`` (optional, (B, S) of the sequence attention sees): document masking."""
        b, s, _ = x.shape
        # Head counts are read from the weights so tensor parallelism can shard them.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, nh, S, hd)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, nkv, S, hd)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, nkv, S, hd)
        if self.qk_norm:  # (each head over its own hd features)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.kernel(q, k, v, *doc_ids)  # (B, nh, S, hd)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (B, S, nh*hd) -> (B, S, h)


class Block(nn.Module):
    """Pre-norm decoder layer: attention and MLP, each with a residual connection."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention: KernelSlot = build_attention_layer(cfg)  # (cfg.attention_layer's)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = (
            MoE(cfg) if cfg.is_moe_layer(layer_id) else SwiGLU(cfg.dim, cfg.ffn_hidden)
        )
        # How the layer runs (set by meshlm.parallel.extensions; None: directly), and the
        # names of the choices that made them (shown by repr)
        self.run_layer: Callable[..., torch.Tensor] | None = None
        self.run_ffn: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.choices: dict[str, str | bool] = {}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *doc_ids: torch.Tensor) -> torch.Tensor:
        if self.run_layer is not None:
            return self.run_layer(x, cos, sin, *doc_ids)
        return self.layer(x, cos, sin, *doc_ids)

    def layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              *doc_ids: torch.Tensor) -> torch.Tensor:
        """The layer's computation (what ``run_layer`` compiles or recomputes); ``doc_ids``:
        document masking (see the module docstring)."""
        x = x + self.attention(self.attention_norm(x), cos, sin, *doc_ids)
        h = self.ffn_norm(x)
        return x + (self.feed_forward(h) if self.run_ffn is None else self.run_ffn(h))

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.choices.items())


class Transformer(nn.Module):
    """The decoder. ``model(input_ids)`` -> logits (B, S, vocab).

    It also holds the extra training heads its config adds (``models/heads.py``), each the
    attribute of its registered name (None when the config adds none), which only training
    runs: a training forward hands them its last layer's output (:meth:`head`) and the
    training objectives run them after it; ``model(input_ids)``, evaluation and generation
    are the main model's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # an empty table: init_weights sets every weight (nn.Embedding's own normal_ on the meta
        # device would import torch._dynamo, ~2 s per process)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim,
                                           _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # The extra training heads (models/heads.py), each under its registered name (None:
        # the config adds none); their blocks' layer ids follow the layers'.
        self.head_names: tuple[str, ...] = tuple(TRAINING_HEADS)
        for name, build in TRAINING_HEADS.items():  # (None: a plain attribute, not a module)
            setattr(self, name, build(cfg, lambda i: Block(cfg, i)))
        if torch.get_default_device().type == "meta":  # shapes only: build_buffers makes them
            cos = torch.empty(cfg.max_seq_len, cfg.rope_dim)
            sin = torch.empty(cfg.max_seq_len, cfg.rope_dim)
        else:  # (sin sign-folded; cfg.rope_dim wide; YaRN: models/rope.py)
            cos, sin = model_rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Context parallelism sets this: (tokens held, device) -> their global positions, or
        # None when the tokens are the whole sequence (positions 0 ... n - 1). It refuses
        # positions beyond max_seq_len itself, on the host (reading them here would wait for
        # the device).
        self.positions: Callable[[int, torch.device], torch.Tensor | None] | None = None
        # What the LM head's input passes first (tensor parallelism: copy to the tp region or
        # the sequence-parallel all-gather); identity by default.
        self.head_input: nn.Module = nn.Identity()
        # How the final norm + head runs (compiled: set by meshlm.parallel.extensions)
        self.run_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The names of the run-time choices applied (meshlm.parallel.extensions; shown by repr)
        self.choices: dict[str, str | bool] = {}
        # True: forward returns the LM head's input instead of logits (a chunked loss then runs
        # the head itself, see parallel/loss.py); ``logits_out`` switches it off for sampling.
        self.emit_hidden = False
        # (B, S) document ids of the micro-batch being run (document masking; ``packed``)
        self.doc_ids: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.choices.items())

    def build_buffers(self, device: torch.device | str) -> None:
        """The rotary tables (and MoE selection biases) on ``device`` (a model built on the meta
        device has none yet)."""
        if self.rope_cos.is_meta or self.rope_cos.device != torch.device(device):
            cos, sin = model_rope_tables(self.cfg)
            self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        for layer in self.blocks().values():
            if isinstance(layer.feed_forward, MoE):
                layer.feed_forward.build_buffers(device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]  # (a context-parallel share: see ``rope``)
        h = self.tok_embeddings(input_ids)  # (B, S, h)
        return self.head(self.run_layers(h, s))  # (B, S, V)

    @contextlib.contextmanager
    def packed(self, doc_ids: torch.Tensor | None) -> Iterator[None]:
        """Forwards inside this block mask attention at the document boundaries of ``doc_ids``
        ((B, S): the document of every position of the whole sequences; None: no masking)."""
        saved = self.doc_ids
        self.doc_ids = (None if doc_ids is None
                        else with_host_copy(doc_ids, self.rope_cos.device))
        try:
            yield
        finally:
            self.doc_ids = saved

    def rope(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables (cos, sin) of the ``seq_len`` tokens attention sees on this rank:
        positions 0 ... seq_len - 1, or the global positions of a context-parallel share;
        under :meth:`packed`, each token's position inside its document ((B, 1, S, hd))."""
        pos = self.positions(seq_len, self.rope_cos.device) if self.positions else None
        if self.doc_ids is not None:
            in_doc = doc_positions(self.doc_ids)  # (B, S) of the whole sequences
            if pos is not None:
                in_doc = in_doc[:, pos]
            elif in_doc.shape[1] != seq_len:
                raise ValueError(f"document ids cover {in_doc.shape[1]} positions, attention "
                                 f"sees {seq_len}")
            return self.rope_cos[in_doc][:, None], self.rope_sin[in_doc][:, None]
        if pos is None:
            if seq_len > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {seq_len} exceeds max_seq_len "
                                 f"{self.cfg.max_seq_len}")
            return self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        return self.rope_cos[pos], self.rope_sin[pos]

    def run_layers(self, h: torch.Tensor, seq_len: int, layer_ids: list[int] | None = None
                   ) -> torch.Tensor:
        """The decoder layers ``layer_ids`` (default: all, in order) on hidden states ``h``.

        ``seq_len`` is the number of tokens attention sees on this rank -- the sequence, or a
        context-parallel share of it (``h`` may hold a sequence-parallel shard of those): the
        rotary tables are taken at their positions. A pipeline stage runs its layers through this.
        """
        cos, sin = self.rope(seq_len)
        docs = () if self.doc_ids is None else (self.doc_ids,)
        keys = self.layers.keys() if layer_ids is None else [str(i) for i in layer_ids]
        for key in keys:
            h = self.layers[key](h, cos, sin, *docs)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden states -> logits (or the head's input, when
        ``emit_hidden``), through ``run_head`` when set. A training forward hands ``h`` to
        the extra training heads (``keep``)."""
        if self.training and torch.is_grad_enabled():
            for extra in self.training_heads().values():
                extra.keep(h)
        return self.final(h) if self.run_head is None else self.run_head(h)

    def blocks(self) -> dict[int, Block]:
        """Every decoder block this model holds, by layer id: its layers, then the blocks of
        the extra training heads (layer ids ``n_layers`` and up)."""
        out = {int(k): b for k, b in self.layers.items()}
        for extra in self.training_heads().values():
            out.update(extra.blocks())
        return out

    def training_heads(self) -> dict[str, TrainingHead]:
        """The extra training heads this model holds, by name (none that the config does not
        add, or that a pipeline split left on another stage)."""
        held = {name: getattr(self, name) for name in self.head_names}
        return {name: m for name, m in held.items() if m is not None}

    def final(self, h: torch.Tensor) -> torch.Tensor:
        """The computation of :meth:`head` (what ``run_head`` compiles)."""
        x = self.head_input(self.norm(h))
        return x if self.emit_hidden else self.output(x)

    @contextlib.contextmanager
    def logits_out(self) -> Iterator[None]:
        """Forwards return logits inside this block, whatever ``emit_hidden`` says."""
        saved, self.emit_hidden = self.emit_hidden, False
        try:
            yield
        finally:
            self.emit_hidden = saved

    def aux_loss(self, layer_ids: list[int] | None = None) -> torch.Tensor | float:
        """Sum of the MoE load-balancing losses of the last forward of ``layer_ids`` (default:
        every layer); 0.0 when none has one (dense models)."""
        blocks = self.blocks()
        keys = blocks.keys() if layer_ids is None else layer_ids
        losses = [ff.last_aux_loss for k in keys
                  if isinstance(ff := blocks[k].feed_forward, MoE)]
        losses = [x for x in losses if x is not None]
        return torch.stack(losses).sum() if losses else 0.0

    def set_expert_biases(self, table: list[list[float]] | None) -> None:
        """Auxiliary-loss-free selection biases per layer (a checkpoint's ``moe_bias``) into
        the MoE layers this model holds; None leaves them as they are."""
        if table is None:
            return
        for i, layer in self.blocks().items():  # (the training heads' rows follow)
            ff = layer.feed_forward
            if isinstance(ff, MoE) and ff.expert_bias is not None and i < len(table):
                ff.expert_bias.copy_(torch.tensor(table[i], dtype=torch.float32))

    def num_params(self) -> int:
        """Unique parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())


# ---------------------------------------------------------------------- initialisation
def param_seed(seed: int, name: str) -> int:
    """Generator seed of one parameter: a function of the run seed and its name only."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_std(cfg: ModelConfig, name: str) -> float | None:
    """Standard deviation of a parameter's normal init; None for norm weights (ones).

    Output projections of residual branches (``wo``, ``w2``) are scaled by 1/sqrt(2 L)
    (GPT-2, Radford et al. 2019, section 2.3) so the residual stream does not grow with depth.
    """
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("wo.weight", "w2.weight", "w2")):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def initial_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The whole initial tensor of parameter ``name``: a function of (seed, name) only."""
    std = init_std(cfg, name)
    if std is None:
        return torch.ones(shape)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g)


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Initialise every parameter from (seed, its name), independent of order or layout."""
    for name, p in model.named_parameters():
        p.copy_(initial_value(model.cfg, name, tuple(p.shape), seed))


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> Transformer:
    """A model with the seed's initial weights (on the meta device: shapes only, no init)."""
    with torch.device(device):
        model = Transformer(cfg)
    if str(device) != "meta":
        init_weights(model, seed)
    return model
