"""Precision as the planner sees it (torch-free): bytes per state and activation, the dtypes
the matmuls run in, the casts, the peak an MFU counts against.

The precisions themselves are :mod:`meshlm.precision` (autocast, loss scaling) and
:mod:`meshlm.parallel.float8` (float8 linears); ``precision.dtype`` accepts exactly the names of
:data:`PRECISION`, ``precision.fp8_rest`` those of :data:`COMPUTE` that :data:`FP8_REST` lists.
A description is registered by name, as the config names it.

**States** (:data:`STATE_MODES`): bytes per parameter of weights / gradients / optimizer states
``(w, g, o)``: ``mixed`` is the ZeRO paper's mixed precision (Rajbhandari et al. 2020, sec. 3:
16-bit weights and gradients, K = 12 bytes of fp32 master weights, momentum and variance):
``(2, 2, 12)``; ``fp32`` is meshlm's (fp32 weights and gradients, AdamW's two fp32 moments,
``parallel/data.py``: 16Ψ): ``(4, 4, 8)``. Which of them a rank holds whole and which 1 / N of
is the ZeRO stage's (``parallel/zero_cost.py``). Under ``fp32`` states the residual stream stays
fp32 under autocast (its embeddings and adds are not autocast ops), and every forward casts
each fp32 weight to the matmuls' dtype.

**Compute dtypes** (:data:`COMPUTE`): what runs outside float8 matmuls -- activations, the
autocast weight copies, norms and casts -- in bytes per value (fp32 4, bf16 and fp16 2) and
in memory-bound traffic: the bytes every non-matmul aten op of meshlm's block reads and writes,
forward + backward (counted with TorchDispatchMode), per byte the block saves for backward --
7.6 in fp32 (7.5 for ``tiny``), 11.0 under bf16 autocast (its casts and fp32 norms; fp16
assumed the same). A test recounts both (tests/test_planner.py). Under a 16-bit compute dtype
autocast keeps a copy of each matmul weight in that dtype from its first use in the forward to
its backward.

**Precisions** (:data:`PRECISION`): ``fp32``, ``bf16`` and ``fp16`` run everything in their
compute dtype (fp16 adds loss scaling: one 4-byte all-reduce per step, not counted). ``fp8``
(``parallel/float8.py``) runs the decoder blocks' linears -- attention, the dense MLP, a MoE
layer's shared experts -- in float8 and the rest in ``precision.fp8_rest`` (bf16 autocast or
fp32): the LM head, the router, the routed experts, materialised attention scores, and every
activation (each float8 linear saves its own autocast copy of its input, as autocast's linear
does). The float8 linears save their fp32 weights themselves: only the head, the router and the
routed experts have 16-bit weight copies. Each of their three matmuls casts both operands to
float8 (:meth:`PrecisionCost.cast_peak`: :data:`FP8_CAST` bytes per element cast, beside the
float8 copy of the other operand), a transient inside one linear's forward or backward.
Frameworks other than meshlm (the planner's ``megatron`` profile) may run the head in float8
too: the planner times it at the linears' rate there.

**Weight casts** (``fp32`` states with matmuls in a narrower dtype, meshlm's autocast): every
forward casts each weight to the compute dtype (read 4, write 2 bytes), every backward casts
its 16-bit weight gradient back to fp32 (read 2, write 4); each micro-batch after the first
adds its gradient into the fp32 one (read 4 + 4, write 4): :data:`CAST_BYTES` per parameter.
Weight-only ops are left out of the traffic ratio above (they do not grow with the tokens),
so they are counted here.

**Float8 as a stack runs it** (the planner's ``megatron`` profile, ``planner/stacks.py``): the
linears' GEMMs at the accelerator's float8 rate; the LM head, the router, attention's scores
and the extra training heads' linears in the rest dtype (no published stack runs them in
float8: Transformer Engine's Megatron output layer is not a TE module, torchao's converter
skips ``output``, DeepSeek-V3 keeps the head, the gating and attention in BF16, its sec.
3.3.1); the routed
experts in float8 where the stack's grouped linears are (Transformer Engine, DeepSeek-V3).
The casts move :data:`FP8_CAST_TRAFFIC` bytes per element of each cast operand beyond the
GEMMs (:meth:`PrecisionCost.cast_traffic`): none where they are fused into the kernels that
produce the operand (Transformer Engine's ``LayerNormLinear`` and fused cast-transpose,
Inductor under torch.compile); as separate kernels (torchao eager) an amax pass (read),
the scaled cast (read, write one byte) and, for the transposed operand the other GEMM reads,
a transposed copy (read and write one byte) -- tensorwise scaling casts each operand once;
rowwise and blockwise scaling cast it once per orientation (a scale per row or block of the
orientation the GEMM reduces over), so twice. Weights are cast from their 16-bit copy each
micro-batch.

**MFU peak**: the accelerator's datasheet peak the MFU is counted against -- fp32's for fp32,
the 16-bit one otherwise, fp8 runs too (as torchtitan reports them).

Communication: under fp8, per float8 linear and micro-batch, the amax all-reduces (max) that
make every shard cast with the one-process scale (a few values each; not timed by the
planner); fp16: one 4-byte all-reduce per step. Memory: as above.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from .dtypes import AUTOCAST_NAMES, FP8_RECIPES
from .named import Registry

# bytes per element a float8 cast holds at its peak (torchao's ``hp_tensor_and_scale_to_float8``):
# the scaled fp32 copy, its clamped copy and the float8 result (counted; a test recounts it)
FP8_CAST = 4 + 4 + 1
# bytes per parameter of the weight casts under fp32 states (module docstring)
CAST_BYTES = {"forward": 6.0, "backward": 6.0, "accumulate": 12.0}
# float8 casts' traffic beyond the GEMMs, bytes per element of a cast operand whose source has
# ``a`` bytes per value (module docstring): "fused" none; "separate" per scaling granularity:
# tensorwise amax read (a) + cast read and write (a + 1) + transposed copy (1 + 1); rowwise /
# blockwise one amax and cast per orientation, 2 (2a + 1)
FP8_CAST_TRAFFIC = {"fused": {}, "separate": {"tensorwise": (2, 3), "rowwise": (4, 2),
                                              "blockwise": (4, 2)}}
FP8_SCALINGS = ("tensorwise", "rowwise", "blockwise")
# bytes moved by memory-bound ops per byte meshlm's block saves, by compute dtype (counted;
# module docstring)
C_TRAFFIC = {"fp32": 7.6, "bf16": 11.0, "fp16": 11.0}  # fp16: bf16's casts


@dataclass(frozen=True)
class StatesCost:
    """How weights, gradients and optimizer states are held (module docstring)."""

    name: str
    doc: str
    weight: float  # bytes per parameter
    grad: float
    optim: float
    fp32_master: bool  # the weights the matmuls read are fp32: autocast casts them each forward

    @property
    def bytes(self) -> tuple[float, float, float]:
        """``(w, g, o)``: bytes per parameter of weights, gradients, optimizer states."""
        return self.weight, self.grad, self.optim

    def residual_bytes(self, act_bytes: float) -> float:
        """Bytes per value of the residual stream (norms and adds): fp32 beside fp32 master
        weights, else the compute dtype's ``act_bytes``."""
        return 4 if self.fp32_master else act_bytes


@dataclass(frozen=True)
class ComputeDtype:
    """One compute dtype: what runs in it outside float8 matmuls (module docstring)."""

    name: str
    bytes: int  # per activation value and per autocast weight copy
    traffic: float  # memory-bound bytes moved per byte the block saves (C_TRAFFIC)

    @property
    def autocast(self) -> bool:
        """Whether it runs under autocast (narrower than fp32): 16-bit weight copies."""
        return self.bytes < 4


@dataclass(frozen=True)
class PrecisionCost:
    """One ``precision.dtype``'s cost, as the planner reads it (module docstring).

    ``linears``: the dtype of the decoder blocks' linears (the accelerator's GEMM rate of that
    name); ``rest``: the compute dtype of everything else (``None``: ``precision.fp8_rest``
    chooses, :meth:`with_rest`); ``peak``: the accelerator peak an MFU counts against."""

    name: str
    doc: str
    linears: str
    rest: str | None
    peak: str
    float8_linears: bool = False  # the decoder-block linears cast to float8 (parallel/float8.py)
    recipes: tuple[str, ...] = ()  # precision.fp8_recipe values

    def with_rest(self, fp8_rest: str) -> PrecisionCost:
        """The description with its compute dtype chosen (``fp8_rest`` where it has none)."""
        return self if self.rest is not None else _with_rest(self, fp8_rest)

    @property
    def compute(self) -> ComputeDtype:
        """The compute dtype of activations and of the matmuls that are not float8."""
        if self.rest is None:
            raise ValueError(f"precision {self.name!r}: choose its rest dtype (with_rest)")
        return COMPUTE[self.rest]

    @property
    def act_bytes(self) -> int:
        """Bytes per activation value."""
        return self.compute.bytes

    @property
    def traffic(self) -> float:
        """Memory-bound bytes moved per byte meshlm's block saves (:data:`C_TRAFFIC`)."""
        return self.compute.traffic

    def weight_copies(self, matmul: float, block_linear: float) -> float:
        """Bytes of autocast's weight copies of ``matmul`` parameters (``block_linear`` of them
        in the decoder-block linears, which float8 linears do not copy); 0 without autocast."""
        if not self.compute.autocast:
            return 0.0
        copied = matmul - (block_linear if self.float8_linears else 0.0)
        return self.compute.bytes * copied

    def weight_cast_bytes(self, states: StatesCost, forwards: int, m: int) -> float:
        """Bytes per parameter and step of the weight casts and the fp32 gradient's
        accumulation (:data:`CAST_BYTES`) over ``m`` micro-batches of ``forwards`` forward
        passes each: 0 unless fp32 master weights feed matmuls narrower than fp32."""
        if not states.fp32_master or self.linears == "fp32":
            return 0.0
        return (m * (forwards * CAST_BYTES["forward"] + CAST_BYTES["backward"])
                + (m - 1) * CAST_BYTES["accumulate"])

    def cast_traffic(self, casts: str, scaling: str, m: float, k: float, n: float,
                     weights: float = 1, weight_bytes: float = 2) -> float:
        """Bytes the float8 casts of one linear move in its forward + backward beyond the GEMMs
        (``m`` tokens, ``k`` input and ``n`` output features; :data:`FP8_CAST_TRAFFIC`): the
        input ``x`` and the output gradient ``dy`` from the rest dtype, ``weights`` k x n
        weights (a MoE layer's local experts, whose rows share the ``m`` tokens) from
        ``weight_bytes`` per value; 0 when the linears are not float8 or the casts fused."""
        if not self.float8_linears or casts not in FP8_CAST_TRAFFIC:
            return 0.0
        per = FP8_CAST_TRAFFIC[casts].get(scaling)
        if per is None:
            return 0.0
        reads, writes = per
        a = self.act_bytes
        return ((reads * a + writes) * (m * k + m * n)
                + (reads * weight_bytes + writes) * weights * k * n)

    def cast_peak(self, m: float, k: float, n: float) -> float:
        """Peak bytes one decoder-block linear's float8 casts allocate in its forward or its
        backward (``m`` tokens, ``k`` input and ``n`` output features), outputs included
        (:func:`fp8_linear_peak`); 0 when the linears are not float8."""
        if not self.float8_linears:
            return 0.0
        return fp8_linear_peak(m, k, n, self.act_bytes)


@functools.lru_cache(maxsize=64)
def _with_rest(cost: PrecisionCost, fp8_rest: str) -> PrecisionCost:
    return replace(cost, rest=COMPUTE[fp8_rest].name)


def fp8_linear_peak(m: float, k: float, n: float, a: int) -> float:
    """Peak bytes one float8 linear allocates in its forward or its backward (``m`` tokens,
    ``k`` input and ``n`` output features, ``a``-byte activations), outputs included: each
    operand cast holds :data:`FP8_CAST` bytes per element at once and keeps its float8 copy
    (1 byte) for its matmul; forward ``x`` then ``W`` then ``y``; backward ``dy`` and ``W``
    for ``dx``, then ``dy`` and ``x`` for ``dW`` (16-bit, then its fp32 copy) beside ``dx``."""
    mk, kn, mn = m * k, k * n, m * n
    forward = max(FP8_CAST * mk, mk + FP8_CAST * kn, mk + kn + a * mn)
    dx = max(FP8_CAST * mn, mn + FP8_CAST * kn, mn + kn + a * mk)
    dw = a * mk + max(FP8_CAST * mn, mn + FP8_CAST * mk, mn + mk + a * kn,
                      a * kn + (4 * kn if a < 4 else 0.0))
    return max(forward, dx, dw)


def value_bytes(dtype: str) -> int:
    """Bytes per value of a compute dtype (a reduction's dtype: ``diloco.reduce_dtype``)."""
    return COMPUTE[dtype].bytes


STATE_MODES: Registry[StatesCost] = Registry("states")
STATE_MODES.register(StatesCost(
    "fp32", "meshlm's: fp32 weights and gradients, AdamW's fp32 moments", 4, 4, 8, True))
STATE_MODES.register(StatesCost(
    "mixed", "the ZeRO paper's mixed precision: 16-bit weights and gradients, fp32 master "
    "weights and moments", 2, 2, 12, False))

COMPUTE: Registry[ComputeDtype] = Registry("compute dtype")
for _name, _bytes in zip(AUTOCAST_NAMES, (4, 2, 2), strict=True):
    COMPUTE.register(ComputeDtype(_name, _bytes, C_TRAFFIC[_name]))

PRECISION: Registry[PrecisionCost] = Registry("precision")
PRECISION.register(PrecisionCost("fp32", "everything in fp32, no autocast", "fp32", "fp32",
                                 "fp32"))
PRECISION.register(PrecisionCost("bf16", "bf16 autocast over fp32 weights", "bf16", "bf16",
                                 "bf16"))
PRECISION.register(PrecisionCost("fp16", "fp16 autocast with dynamic loss scaling", "fp16",
                                 "fp16", "bf16"))
PRECISION.register(PrecisionCost(
    "fp8", "decoder-block linears in float8 with dynamic scales, the rest in "
    "precision.fp8_rest", "fp8", None, "bf16", float8_linears=True, recipes=FP8_RECIPES))

__all__ = ["CAST_BYTES", "COMPUTE", "C_TRAFFIC", "FP8_CAST", "FP8_CAST_TRAFFIC", "FP8_SCALINGS",
           "PRECISION",
           "STATE_MODES", "ComputeDtype", "PrecisionCost", "Registry", "StatesCost",
           "fp8_linear_peak", "value_bytes"]
