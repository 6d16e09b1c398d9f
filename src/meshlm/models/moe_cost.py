"""How a MoE layer's routed experts are computed, as the planner sees it (torch-free): one
description per kernel family, named by the planner's ``Workload.experts``.

The experts of a rank are ``E_l = moe_experts / ep`` weight stacks (``(E, F, H)``,
``models/moe.py``); a balanced router hands each of them ``R / E_l`` of the rank's
``R = T top_k`` routed rows. Both families run ``E_l`` products of ``R / E_l`` rows by one
expert's weights -- the FLOPs of one ``R``-row GEMM, but each expert's weights are read (and
their gradients written) once, so few rows per expert turn the GEMMs memory-bound (the
planner's per-GEMM roofline, :func:`meshlm.planner.timing._gemm`) -- and differ in how:

- ``grouped``: one grouped GEMM for all local experts (``torch._grouped_mm``, CUTLASS,
  Transformer Engine's GroupedGEMM, DeepGEMM): no per-expert launches or eager ops -- meshlm's
  (``GroupedExperts``) adds 38 eager ops to a MoE layer beyond its routing and shared expert,
  whatever the number of experts (counted with TorchDispatchMode on ``tiny-moe`` with 4, 8
  and 16 experts, forward + backward; ``tests/test_planner.py`` recounts them). Its
  GEMMs run at the dense GEMM rate of their per-expert shape (:attr:`ExpertKernel.efficiency`
  1.0): DeepGEMM's published H800 tables (deepseek-ai/DeepGEMM README, initial release)
  give 1288 TFLOPS for 8 groups of 4096 x 4096 x 7168 against 1304 for one dense
  4096 x 4096 x 7168 GEMM (0.99), and 1093 against 1025 for 7168 x 2048 (1.07);
- ``loop``: one GEMM per expert from Python (meshlm before issue 49, Megatron's
  SequentialMLP): the same GEMMs plus ``ops_per_expert`` eager ops per local expert (40,
  counted with TorchDispatchMode on meshlm's loop, forward + backward).

Communication: none (expert parallelism's all-to-alls are the planner's ``ep`` events).
Memory: none beyond the MoE layer's saved tensors (the planner's ``routed copies``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..named import Registry


@dataclass(frozen=True)
class ExpertKernel:
    """One family of routed-expert kernels (module docstring)."""

    name: str
    doc: str
    ops_per_expert: float = 0.0  # eager ops per local expert, forward + backward
    ops: float = 0.0  # eager ops of the expert computation as a whole, forward + backward
    efficiency: float = 1.0  # share of the dense GEMM rate of the same per-expert shape

    def gemms(self, rows: float, experts: float) -> tuple[float, float]:
        """(how many GEMMs, rows of each) for ``rows`` routed rows over ``experts`` local
        experts (a balanced router)."""
        return experts, rows / experts

    def eager_ops(self, experts: float) -> float:
        """Eager ops of the routed experts on a rank holding ``experts`` of them."""
        return self.ops + self.ops_per_expert * experts


EXPERT_KERNELS: Registry[ExpertKernel] = Registry("expert kernels")
EXPERT_KERNELS.register(ExpertKernel(
    "grouped", "one grouped GEMM over the local experts (torch._grouped_mm, DeepGEMM, "
               "Transformer Engine)", ops=38.0))
EXPERT_KERNELS.register(ExpertKernel(
    "loop", "one GEMM per expert from Python (a launch and eager ops per expert)",
    ops_per_expert=40.0))

__all__ = ["EXPERT_KERNELS", "ExpertKernel"]
