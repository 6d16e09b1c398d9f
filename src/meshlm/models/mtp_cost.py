"""Multi-token prediction as the planner sees it (torch-free; the modules are ``models/mtp.py``).

DeepSeek-V3's multi-token prediction (DeepSeek-AI 2024, sec. 2.2): ``model.mtp_depth`` = D
modules after the main model, on the last pipeline stage. Module k takes the main model's (or
module k - 1's) hidden state and the embedding of the token k + 1 ahead, normalises both
(``enorm``, ``hnorm``), projects their concatenation (``proj``: 2 h -> h), runs one decoder
block (layer id ``n_layers + k``, MoE when the model is) and predicts through its ``norm`` and
the shared LM head. What it adds to the last stage, per micro-batch of ``T`` tokens on a rank:

- **blocks** (:meth:`MTPCost.blocks`): D more decoder blocks, costed as the stage's own layers
  (parameters, saved activations, GEMMs, attention, their collectives under tp / cp / ep);
- **head passes** (:meth:`MTPCost.head_passes`): the LM head and the loss run ``1 + D``
  times: each pass's GEMM, loss and kept logits (the loss's backward transient stays one
  pass's: they run one after the other);
- **its own layers** (:meth:`MTPCost.linears`, :meth:`MTPCost.params`): ``proj`` per depth
  (column parallel over tp: ``2 h^2 / t`` on a rank) and three norms; under pipelining
  the embedding of the tokens ahead is a copy on the last stage (``V h / t``, as a tied head
  is), whose gradient is summed with the first stage's once per step (not counted);
- **saved** (:meth:`MTPCost.saved`): per depth the two input norms' tensors -- meshlm:
  ``enorm``'s fp32 input, normalised copy and 1/rms, ``hnorm``'s normalised copy and 1/rms
  (its input is the hidden state the previous head pass's norm keeps already),
  ``(3 h + 2) 4`` bytes; ``megatron``: ``enorm``'s 16-bit input -- and ``proj``'s input
  (``2 h`` in the compute dtype). Measured with saved-tensor hooks on meshlm's model (CPU,
  fp32): within 0.5 % of the whole model's activations with and without MTP.

Communication: the blocks' own (as any layer's); under tensor parallelism, per depth and
micro-batch, what ``parallel/tensor_cost.py`` composes from this description as
``parallel/tensor.py`` applies it: the vocab-parallel lookup of the tokens ahead
(:meth:`MTPCost.lookups`), ``proj``'s input made whole and its column shards gathered
(:meth:`MTPCost.linears`), one more head input and vocab-parallel loss
(:meth:`MTPCost.head_passes`) and, with sequence parallelism, the gradients of its three norms
(:meth:`MTPCost.norms`). Once per step (:meth:`MTPCost.step_collectives`), preparing the
targets of every depth: under cp the all-gather of the step's targets (int64, the whole
sequences), under document masking the all-reduce over dp of the counted predictions (``D``
float64). Not counted: the cross-entropy's per-depth target shift (local).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..schema import declare

# (models/config.py's ModelConfig, which lists this module: named for the annotations only)
ModelConfig = Any


@dataclass(frozen=True)
class MTPKeys:
    """Multi-token prediction's config keys and the shape hooks it answers (a base of
    ``ModelConfig``): ``mtp_depth`` more blocks after the main model (``n_blocks``), their
    parameters apart from the published totals (``extra_params``) and their matmuls in the
    FLOPs (``extra_matmul_params``; their attention through ``n_blocks``).

    Each depth is ``enorm``, ``hnorm`` (``2 dim``), ``proj`` (``2 dim * dim``), one decoder
    block (layer id ``n_layers + k``, MoE when the model is) and a ``norm`` (``dim``); the
    embedding and the LM head are shared, the LM head runs once more per depth. Published
    totals leave the modules out (DeepSeek-V3: 671 B without its MTP module)."""

    # depth k predicts the token k + 1 ahead; the mean loss over depths enters the objective
    # times mtp_loss_weight
    mtp_depth: int = declare(
        0,
        doc="multi-token prediction modules (DeepSeek-V3: 1); depth k predicts the token k + "
            "1 ahead")
    mtp_loss_weight: float = declare(
        0.3, doc="weight of the multi-token prediction loss (mean over depths) in the objective")

    def technique_problems(self) -> list[str]:
        out: list[str] = super().technique_problems()  # type: ignore[misc]
        if self.mtp_depth < 0:
            out.append(f"model.mtp_depth={self.mtp_depth} must be >= 0 (0: no multi-token "
                       "prediction)")
        if self.mtp_loss_weight < 0:
            out.append(f"model.mtp_loss_weight={self.mtp_loss_weight} must be >= 0")
        return out

    def run_problems(self, seq_len: int) -> list[str]:
        out: list[str] = super().run_problems(seq_len)  # type: ignore[misc]
        if seq_len <= self.mtp_depth + 1:
            out.append(f"data.seq_len={seq_len} leaves no target for multi-token prediction "
                       f"depth model.mtp_depth={self.mtp_depth} (needs seq_len > mtp_depth + 1)")
        return out

    def extra_blocks(self) -> int:
        return super().extra_blocks() + self.mtp_depth  # type: ignore[misc]

    def mtp_depth_params(self: Any, k: int, active: bool = False) -> int:
        """Module ``k``: ``enorm``, ``hnorm``, ``proj`` (2 dim -> dim), a decoder block (layer
        id ``n_layers + k``) and its ``norm``; the embedding and the output head are the main
        model's (not counted here)."""
        return 3 * self.dim + 2 * self.dim * self.dim + self.layer_params(self.n_layers + k,
                                                                          active)

    def mtp_params(self, active: bool = False) -> int:
        """Parameters of the modules (0 without them); a model built with ``mtp_depth`` > 0
        holds ``num_params() + mtp_params()``."""
        return sum(self.mtp_depth_params(k, active) for k in range(self.mtp_depth))

    def extra_params(self, active: bool = False) -> int:
        return super().extra_params(active) + self.mtp_params(active)  # type: ignore[misc]

    def extra_matmul_params(self: Any) -> int:
        """Per depth ``proj``, the block's active weights and the shared LM head once more."""
        own = sum(2 * self.dim * self.dim + self.layer_matmul_params(self.n_layers + k)
                  + self.vocab_size * self.dim for k in range(self.mtp_depth))
        return super().extra_matmul_params() + own  # type: ignore[misc]

    def info(self) -> dict[str, Any]:
        """``meshlm info``'s fields and its table column ``MTP`` (total / active, or -)."""
        out: dict[str, Any] = super().info()  # type: ignore[misc]
        out.update(mtp_depth=self.mtp_depth, mtp_params=self.mtp_params(),
                   mtp_active_params=self.mtp_params(active=True))
        return out

    @classmethod
    def info_columns(cls) -> list[tuple[str, str, str, str, str]]:
        """(column, what, depth field, total field, active field) of ``meshlm info``."""
        return [*super().info_columns(),  # type: ignore[misc]
                ("MTP", "multi-token prediction", "mtp_depth", "mtp_params",
                 "mtp_active_params")]


@dataclass(frozen=True)
class MTPCost:
    """Multi-token prediction's cost, as the planner reads it (module docstring); every
    method returns nothing (0, ``()``, 1 head pass) for a model without it."""

    name: str = "mtp"

    def blocks(self, c: ModelConfig) -> tuple[bool, ...]:
        """Whether each module's block is MoE (the last stage holds them after its layers)."""
        return tuple(c.is_moe_layer(c.n_layers + k) for k in range(c.mtp_depth))

    def head_passes(self, c: ModelConfig) -> int:
        """LM head and loss passes per micro-batch: the main model's and one per depth."""
        return 1 + c.mtp_depth

    def lookups(self, c: ModelConfig) -> int:
        """Embedding lookups per micro-batch (the tokens ahead, one per depth)."""
        return c.mtp_depth

    def norms(self, c: ModelConfig) -> int:
        """Norm weights outside the blocks (``enorm``, ``hnorm``, ``norm`` per depth)."""
        return 3 * c.mtp_depth

    def linears(self, c: ModelConfig, t: int) -> list[tuple[float, float]]:
        """``(in, out)`` of each ``proj`` on a rank (column parallel over tp)."""
        return [(2 * c.dim, c.dim / t)] * c.mtp_depth

    def params(self, c: ModelConfig, t: int) -> float:
        """Parameters on a rank besides the blocks: ``proj`` and the three norms per depth
        (the embedding's copy on the last stage is ``HeadCosts.params``', counted once for
        every head that looks tokens up)."""
        return c.mtp_depth * (2 * c.dim * c.dim / t + 3 * c.dim)

    def step_collectives(self, c: ModelConfig, tokens: float, doc_masking: bool
                         ) -> list[tuple[str, str, float]]:
        """Per step: the targets of the whole sequences gathered over cp (``tokens`` int64
        values, the all-gather's output), and with document ids the counted predictions of
        each depth summed over dp (``D`` float64)."""
        if not c.mtp_depth:
            return []
        out = [("all_gather", "cp", 8.0 * tokens)]
        if doc_masking:
            out.append(("all_reduce", "dp", 8.0 * c.mtp_depth))
        return out

    def saved(self, c: ModelConfig, a: float, profile: str, out_t: int) -> float:
        """Bytes per token kept for backward beyond the blocks and the head passes (``out_t``:
        how many ways tensors outside tp regions are split, sequence parallelism's)."""
        if profile == "megatron":
            norms = c.dim * 2.0
        else:
            norms = (3 * c.dim + 2) * 4.0
        return c.mtp_depth * (norms / out_t + 2 * c.dim * a)


MTP = MTPCost()

__all__ = ["MTP", "MTPCost", "MTPKeys"]
