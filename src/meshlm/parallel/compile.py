"""Per-block ``torch.compile`` (``train.compile = true``), applied after parallelisation.

Applied with the model's other choices in one place (``extensions.apply_choices``): each block's
``run_layer`` is :func:`compile_fn` of its computation (``Block.layer``; a recomputed block
checkpoints the compiled function), the model's ``run_head`` that of its final norm + head;
kernels that communicate are wrapped in :class:`Uncompiled`, a MoE feed-forward runs through
:func:`eager_call` (``Block.run_ffn``).

Granularity (torchtitan's): each decoder block's forward is one compiled graph, and the final
norm + LM head and the loss are one more each. Identical blocks share one compiled graph (dynamo
caches per code object and parameters are graph inputs), so compile time does not grow with
depth. Inductor fuses each block's RMSNorms, rotary embedding, SiLU gate and residual adds into
a few loops around the matmuls and the attention kernel, and the loss's log-softmax into its
backward.

Composition with the layouts:

- module hooks stay outside the graphs: ZeRO-3's gather / free hooks on a block, the DDP and
  ZeRO gradient hooks on parameters, pipeline stages calling ``run_layers``;
- tensor / sequence parallel collectives inside a block are custom ops
  (``distributed/traceable.py``): a tp block is still one graph, the comm log unchanged;
- ``recompute=full``: ``torch.utils.checkpoint`` around the compiled block (the recomputation
  re-runs the compiled forward); ``selective`` and ``op`` are traced into the block's graph as
  checkpointed regions (AOTAutograd recomputes them in backward);
- zero-bubble pipeline: the executor turns the stage's linears into split linears
  (``split_linear.py``), two opaque custom ops per linear inside the block's graph. The
  compiled backward run by ``I`` then forms only input and non-matmul weight gradients, each
  linear handing its (input, output gradient) to the executor, and ``W`` forms the linear
  weight gradients ``dy^T x`` eagerly, as eager ZB does: the split and its bubble are kept.
  No communication is added; each linear's input and output gradient are kept (copied when
  captured) from ``I`` until ``W``, as eager ZB keeps them;
- graph breaks by design, each around eager communication with data-dependent shapes: a MoE
  feed-forward (expert dispatch) and a context-parallel attention core (ring / all-to-all).

Only calls that record gradients use compiled code: evaluation and sampling (other shapes, no
backward) run the eager forward and cause no recompilation.

Caches: inductor's FX graph cache and the AOTAutograd cache live in ``<cache dir>/inductor``
(``TORCHINDUCTOR_CACHE_DIR`` set to the cache root of the data, ``data.cache_dir``), so a second run of the same model
and layout starts without compiling kernels.

Communication: none added. Memory: the compiled backward may keep different activations than
eager (AOTAutograd's partitioner recomputes cheap elementwise results instead of saving them):
usually fewer bytes per layer.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.llama import Block
from ..models.moe import MoE


def configure_cache(root: Path) -> Path:
    """Point inductor's caches at ``root / "inductor"`` (``TORCHINDUCTOR_CACHE_DIR``) and make
    sure the FX graph and AOTAutograd caches are on.

    Also starts this process's compilation afresh -- dynamo's in-memory code cache, counters
    and timings cleared -- so a run's statistics are its own and a second run in the same
    process compiles through the on-disk caches as a new process would."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import compilation_time_metrics, counters
    from torch._inductor.utils import clear_caches

    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    folder = root / "inductor"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    clear_caches()  # (in-memory caches of the previous folder)

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return folder


class GradOnly:
    """Calls ``compiled`` when gradients are being recorded, ``eager`` otherwise."""

    def __init__(self, eager: Callable[..., Any], compiled: Callable[..., Any]) -> None:
        self.eager, self.compiled = eager, compiled
        functools.update_wrapper(self, eager)

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args) if torch.is_grad_enabled() else self.eager(*args)


def compile_fn(fn: Callable[..., Any]) -> GradOnly:
    """``fn`` compiled for the training step (static shapes), eager elsewhere."""
    _prepare_eager_calls()
    return GradOnly(fn, torch.compile(fn, dynamic=False))


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


# ``torch.compiler.disable(_call)``, made when something is first compiled (with the float8
# matmul allowed in graphs): doing it at import would import torch._dynamo (about 2 s) into
# every process, compiled or not.
_DISABLED_CALL: Callable[..., Any] | None = None


def _prepare_eager_calls() -> None:
    global _DISABLED_CALL
    if _DISABLED_CALL is None:
        from .float8 import allow_in_compiled_graphs

        _DISABLED_CALL = torch.compiler.disable(_call)
        allow_in_compiled_graphs()


def eager_call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run eagerly from inside a compiled graph (one graph break around it)."""
    return (_DISABLED_CALL or _call)(fn, *args)


class Uncompiled(nn.Module):
    """An attention kernel kept out of compiled graphs (eager communication with
    data-dependent shapes: the context-parallel ring / all-to-all exchange)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return eager_call(self.inner, *args)


def run_ffn(block: Block) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How a compiled block runs its feed-forward: a MoE layer (expert dispatch) eagerly,
    others inside the block's graph (None)."""
    if isinstance(block.feed_forward, MoE):
        return functools.partial(eager_call, block.feed_forward)
    return None


def compile_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                 ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The plain (whole-logits, tp = 1) loss compiled; other losses are returned as they are:
    the vocab-parallel and chunked losses are autograd functions with their own collectives and
    loops, already written to move each logit once."""
    from .loss import cross_entropy

    return compile_fn(cross_entropy) if loss_fn is cross_entropy else loss_fn


def compile_stats() -> dict[str, float]:
    """Counters of this process: seconds spent compiling (dynamo + AOTAutograd + inductor,
    cache loads included), graphs compiled, graph breaks, FX-graph cache hits / misses."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"compile_s": round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 2),
            "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "cache_misses": int(counters["inductor"]["fxgraph_cache_miss"])}


__all__ = ["GradOnly", "Uncompiled", "compile_fn", "compile_loss", "compile_stats",
           "configure_cache", "eager_call", "run_ffn"]
