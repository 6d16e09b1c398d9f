"""Software stacks as the planner sees them: the kernel family and framework defaults of a run,
named by the ``stack`` column of ``benchmarks/data/published_runs.csv``.

A published run's throughput depends on the software that ran it as much as on its layout:
whether the memory-bound kernels are fused, in which dtype gradients are reduced, how the
pipeline sends its boundary activations, how float8 casts run. Each of these is a property of
the stack, stated once here and read from the row's ``stack`` value -- never from who published
the run -- so a run from a publisher the planner has never seen is modelled by what it ran.
:func:`workload_options` turns a stack into the planner's ``Workload`` fields,
:func:`layout_defaults` into the layout a row leaves blank.

Stacks (the CSV's values):

- ``megatron``: Megatron-LM before Transformer Engine (2019-2023): apex / custom fused
  kernels, the pipeline's scatter/gather of boundary activations under tp, gradients reduced
  in fp32 for bf16 (``accumulate_allreduce_grads_in_fp32``, forced for bf16) and in fp16 for
  fp16 runs, gradient accumulation fused into the weight-gradient GEMM.
- ``megatron-te``: Megatron-Core, NeMo or Megatron-LM with Transformer Engine (2023 on): as
  ``megatron``, and float8 casts fused into the norm / activation kernels that produce the
  GEMM inputs (``LayerNormLinear``, fused cast-transpose), amax kept by the kernels, the
  routed experts' grouped linears in float8 too. The distributed optimizer (ZeRO-1) where a
  row states no stage, its gradient reduce-scatter overlapped with the backward of each model
  chunk's last micro-batch and its parameter all-gather with the next forward
  (``overlap_grad_reduce`` / ``overlap_param_gather``, on in NeMo's and Megatron-Bridge's
  recipes, ``--overlap-grad-reduce`` in Megatron-LM), and Transformer Engine's
  tensor-parallel communication overlap (userbuffers) available: a row that does not say
  whether it used it is completed like a blank micro-batch. With tp > 1 a MoE layer's
  routed rows are split over tp (each rank dispatches and computes 1/tp of them: sequence
  parallelism's tokens, or expert tensor parallelism's share of each expert). Under FP8 the
  linears save the float8 copy of their input for backward and the weights are held in
  float8 and gathered in float8 by the distributed optimizer (FP8 primary weights,
  ``fp8_param_gather``, on in NeMo's and Megatron-Bridge's FP8 recipes), and the
  sequence-parallel all-gathers carry float8 (the LayerNormLinear input forward, the
  row-parallel output gradient backward). An interleaved schedule's sends and receives
  overlap the compute (``overlap_p2p_comm``).
- ``megatron-deepspeed``: Megatron's tensor parallelism under DeepSpeed's engine (MT-NLG,
  BLOOM): fused kernels, DeepSpeed's pipeline engine (whole activations between stages),
  gradients reduced in the 16-bit dtype.
- ``deepspeed``: DeepSpeed ZeRO over a Hugging Face model: eager kernels, 16-bit reduction.
- ``torchtitan``: eager PyTorch, FSDP2 with ``reduce_dtype`` float32, a multi-stage pipeline
  schedule whose split is not given runs 2 stages per rank (``generate_split_points``),
  torchao float8 casts as separate kernels (an amax reduction, then the scaled cast); under
  tensorwise scaling torchao's float8 tensor-parallel styles all-gather in float8; under
  rowwise scaling the two backward GEMMs run cuBLAS's tensorwise kernel with unit scales and
  apply the row scales in a pass of their own (below).
- ``torchtitan-compile``: the same under ``torch.compile``: memory-bound kernels and the
  float8 casts fused by Inductor.
- ``nanotron``: flash-attn's fused RMSNorm and rotary kernels, gradients accumulated and
  reduced in fp32 (``FP32GradientAccumulator``: its own pass per micro-batch).
- ``llm-foundry``: MosaicML's MPT blocks in eager PyTorch with flash-attn's fused
  cross-entropy as the default loss; float8 through Transformer Engine (fused casts).
- ``meshlm``: this framework (the planner's own ``meshlm`` profile is more exact: use it).
- ``in-house``: a stack that is not published (Meta's Llama 3 training, DeepSeek's HAI-LLM):
  modelled as an optimised one -- fused kernels, fp32 gradient reduction, fused float8 casts,
  float8 experts (DeepSeek-V3's, sec. 3.3).
- ``gpt-neox``: EleutherAI's Megatron-DeepSpeed derivative: as ``megatron-deepspeed``.
- ``maxtext``: Google's MaxText on GPUs (JAX / XLA): XLA fuses the memory-bound kernels and
  the float8 casts; fp32 parameters, so gradients are reduced in fp32.

No communication, no memory: a table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..named import Registry

FP8_CASTS = ("fused", "separate")


@dataclass(frozen=True)
class Stack:
    """One software stack's kernel family and defaults (module docstring)."""

    name: str
    doc: str
    kernels: str  # memory-bound kernels: "fused" | "eager" (Workload.kernels)
    p2p_split: bool  # Megatron's scatter/gather of pipeline boundary activations under tp
    grad_reduce: str  # dp gradient reduction of 16-bit training: "fp32" | "16bit" | "bf16-fp32"
    grad_accum_pass: bool = False  # fp32 accumulation as its own pass per micro-batch
    loss: str = "torch"  # default loss kernel: "torch" | "fused"
    interleaved_vpp: int = 0  # stages per rank of an interleaved schedule without a split
    fp8_casts: str = "fused"  # float8 casts: "fused" into producers | "separate" kernels
    fp8_experts: bool = False  # a MoE layer's routed experts in float8 under an FP8 run
    # Megatron-Core's overlap_grad_reduce / overlap_param_gather (on in NeMo's and Megatron-
    # Bridge's recipes): each model chunk's gradient reduce-scatter starts as its last
    # backward ends, pipelined or not, and the distributed optimizer's parameter all-gather
    # runs under the next forward (Workload.dp_overlap)
    dp_overlap: bool = False
    zero_default: int = 0  # ZeRO stage of a row that states none (1: distributed optimizer)
    # tensor-parallel communication overlapped with its GEMMs is available (Transformer
    # Engine's userbuffers): a row that leaves ``tp_comm_overlap`` blank has it completed
    tp_overlap: bool = False
    # a MoE layer's routed rows split over tp (Megatron-Core's sequence-parallel token
    # dispatch / expert tensor parallelism; Workload.experts_over_tp)
    experts_over_tp: bool = False
    # an FP8 run's linears save the float8 copy of their input for backward (Transformer
    # Engine's Linear / LayerNormLinear, TE 1.x and 2.x; DeepSeek-V3's cached FP8 activations,
    # sec. 3.3.3) -- torchao's Float8Linear saves the 16-bit input (Workload.fp8_saved_inputs)
    fp8_saved_inputs: bool = False
    # an FP8 run holds the block linears' weights in float8 (Transformer Engine's FP8 primary
    # weights: NeMo's fp8_params, Megatron-Bridge's fp8_param_gather, set by their FP8
    # precision recipes) (Workload.fp8_params)
    fp8_params: bool = False
    # an interleaved schedule's p2p overlapped with compute (Megatron-Core's overlap_p2p_comm,
    # set by NeMo / Megatron-Bridge whenever there are virtual stages) (Workload.pp_overlap)
    pp_overlap: bool = False
    # the float8 scalings under which an FP8 run's sequence-parallel all-gathers carry float8
    # (Workload.fp8_tp_gather): Transformer Engine quantizes a LayerNormLinear's input before
    # its all-gather and a row-parallel linear's output gradient before the backward one
    # (per-tensor and MX-block scaling alike); torchao's Float8ColwiseParallel /
    # Float8RowwiseParallel do the same, for tensorwise scaling only
    fp8_tp_gather: tuple[str, ...] = ()
    # the float8 scalings whose two backward GEMMs (dx, dW) apply their scales after the GEMM,
    # in a pass of their own that reads and writes the output (Workload.fp8_rescale):
    # torchao's ``addmm_float8_unwrapped`` runs rowwise GEMMs without fast accumulation --
    # its backward ones -- as cuBLAS's tensorwise kernel with unit scales, then multiplies the
    # output by the row scales (``output *= post_inverse_scale``; pytorch/ao #1325, since
    # 2024-12): "the rowwise CUTLASS-based kernel is so slow without fast-accum"; under
    # torch.compile Inductor still launches one extra kernel per GEMM for it (pytorch/ao
    # #2184). Transformer Engine scales inside its GEMMs.
    fp8_rescale: tuple[str, ...] = ()

    def fp32_grad_reduce(self, precision: str) -> bool:
        """Whether 16-bit training's gradients go over the wire in fp32 (``precision`` is the
        run's precision text: Megatron reduces fp16 runs' gradients in fp16)."""
        if self.grad_reduce == "bf16-fp32":
            return "fp16" not in precision.lower()
        return self.grad_reduce == "fp32"


STACKS: Registry[Stack] = Registry("stack")
for _stack in (
    Stack("megatron", "Megatron-LM before Transformer Engine", "fused", True, "bf16-fp32"),
    Stack("megatron-te", "Megatron-Core / NeMo with Transformer Engine", "fused", True,
          "bf16-fp32", fp8_experts=True, dp_overlap=True, zero_default=1, tp_overlap=True,
          experts_over_tp=True, fp8_saved_inputs=True, fp8_params=True, pp_overlap=True,
          fp8_tp_gather=("tensorwise", "blockwise")),
    Stack("megatron-deepspeed", "Megatron's tensor parallelism under DeepSpeed", "fused", False,
          "16bit"),
    Stack("gpt-neox", "EleutherAI's GPT-NeoX (Megatron-DeepSpeed)", "fused", False, "16bit"),
    Stack("deepspeed", "DeepSpeed ZeRO over an eager model", "eager", False, "16bit",
          fp8_casts="separate"),
    Stack("torchtitan", "torchtitan, eager", "eager", False, "fp32", interleaved_vpp=2,
          fp8_casts="separate", fp8_tp_gather=("tensorwise",), fp8_rescale=("rowwise",)),
    Stack("torchtitan-compile", "torchtitan under torch.compile", "fused", False, "fp32",
          interleaved_vpp=2, fp8_tp_gather=("tensorwise",), fp8_rescale=("rowwise",)),
    Stack("nanotron", "nanotron", "fused", False, "fp32", grad_accum_pass=True),
    Stack("llm-foundry", "MosaicML llm-foundry (MPT)", "eager", False, "16bit", loss="fused",
          fp8_saved_inputs=True),
    Stack("meshlm", "meshlm", "eager", False, "fp32", fp8_casts="separate",
          fp8_rescale=("rowwise",)),
    Stack("in-house", "an unpublished, optimised stack", "fused", False, "fp32",
          fp8_experts=True, fp8_saved_inputs=True),
    Stack("maxtext", "MaxText (JAX / XLA)", "fused", False, "fp32"),
):
    STACKS.register(_stack)


# the CSV's ``fp8_recipe`` values -> the planner's scaling granularity (Workload.fp8_recipe):
# delayed and current scaling are both one scale per tensor; MX blocks are blocks
FP8_RECIPE_SCALING = {"delayed": "tensorwise", "current": "tensorwise",
                      "tensorwise": "tensorwise", "rowwise": "rowwise",
                      "blockwise": "blockwise", "mxfp8": "blockwise"}


def workload_options(stack: Stack, precision: str, pipeline_split: bool = True,
                     loss: bool = True, grad_reduce: bool = True, fp8: bool = True,
                     fp8_recipe: str = "", overlap: bool = True) -> dict[str, Any]:
    """The planner ``Workload`` fields a run on ``stack`` implies (``precision`` the run's
    precision text, ``fp8_recipe`` its scaling, one of :data:`FP8_RECIPE_SCALING` or blank);
    each switch off leaves its fields at the planner's generic default (the published-runs
    validation turns them off one by one)."""
    recipe = fp8_recipe.strip().lower()
    if recipe and recipe not in FP8_RECIPE_SCALING:
        raise ValueError(f"fp8_recipe {recipe!r} is not one of {', '.join(FP8_RECIPE_SCALING)}")
    scaling = FP8_RECIPE_SCALING.get(recipe, "tensorwise")
    return {"kernels": stack.kernels,
            "fp8_casts": stack.fp8_casts if fp8 else "fused",
            "fp8_recipe": scaling if fp8 else "tensorwise",
            "fp8_tp_gather": fp8 and scaling in stack.fp8_tp_gather,
            "fp8_rescale": fp8 and scaling in stack.fp8_rescale,
            "fp8_experts": fp8 and stack.fp8_experts,
            "p2p_split": pipeline_split and stack.p2p_split,
            "loss": stack.loss if loss else "torch",
            "fp32_grad_reduce": grad_reduce and stack.fp32_grad_reduce(precision),
            "grad_accum_pass": grad_reduce and stack.grad_accum_pass,
            "fp8_saved_inputs": fp8 and stack.fp8_saved_inputs,
            "fp8_params": fp8 and stack.fp8_params,
            "fp8_param_gather": fp8 and stack.fp8_params,  # FP8 primary weights: gathered so
            "dp_overlap": overlap and stack.dp_overlap,
            "pp_overlap": overlap and stack.pp_overlap,
            "experts_over_tp": overlap and stack.experts_over_tp}


def layout_defaults(stack: Stack, overlap: bool = True) -> dict[str, Any]:
    """What a run on ``stack`` implies for the layout where the row does not say: the ZeRO
    stage (``zero``) and whether tensor-parallel communication overlap is available to
    complete a blank (``tp_overlap``); ``overlap`` off: neither (the generic defaults)."""
    return {"zero": stack.zero_default if overlap else 0,
            "tp_overlap": overlap and stack.tp_overlap}


__all__ = ["FP8_CASTS", "FP8_RECIPE_SCALING", "STACKS", "Stack", "layout_defaults",
           "workload_options"]
