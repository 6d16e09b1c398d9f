"""The model part: shard-only construction, parallelisation, the loss, MoE routing statistics.

The model is built on the meta device and parallelised (``parallel.*``: tensor, context,
expert, pipeline, data parallelism and the optimizer states' place), then each rank
materialises only its own shards -- initial values from (seed, name), or the slices of
``model.init_from`` (a Hugging Face folder or a meshlm checkpoint). Communication at
construction: parallelize's (none for the values themselves) and one all-gather of each rank's
peak memory; per step, :class:`Routing`'s all-reduces of the MoE layers' loads (MoE only);
per checkpoint, one tiny all-reduce over pp of the MoE selection biases (bias balancing only).
Checkpoints hold its weights and moments (the engine's owned ranges), the model's shape and the
MoE selection biases. Memory: this rank's shards of weights, gradients and optimizer states.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ...checkpoint.sharded import ShardedCheckpoint, check_model, island_prefix, load_into
from ...checkpoint.state import CheckpointError
from ...config import ModelSection, ParallelSection, TrainSection
from ...distributed.comm import Comm
from ...distributed.source import InitSource, TensorSource
from ...models.config import ModelConfig
from ...models.llama import Transformer, build_model
from ...parallel import parallelize
from ...parallel.compile import compile_loss, configure_cache
from ...parallel.engine import Engine
from ...parallel.expert import moe_layers, router_step
from ...parallel.loss import build_loss
from ...parallel.tensor import TensorParallel
from ...precision import PrecisionPlan
from ..metrics import PhasePeaks
from . import Shards

Log = Callable[[str], None]


class ModelPart:
    """This rank's model, its engine (gradients and optimizer) and the parallel techniques
    applied to it (``tp``, ``pipe``, ``cp``: None where off), and the loss function.

    ``precision``: the run's (its converter is applied before parallelism; gradients are
    reduced in its ``grad_reduce`` dtype)."""

    SECTION = "model"

    def __init__(self, section: ModelSection, parallel: ParallelSection, train: TrainSection,
                 precision: PrecisionPlan, shape: Callable[[int], ModelConfig],
                 vocab_size: int, comm: Comm, device: torch.device, run_dir: Path,
                 memory: PhasePeaks, log: Log, compile_cache: Path | None = None) -> None:
        self.section, self.parallel = section, parallel
        self.comm, self.device, self.run_dir, self.log = comm, device, run_dir, log
        self.compile_cache = configure_cache(compile_cache) if train.compile else None
        init, vocab = self.open_init_from(vocab_size)
        self.model_cfg: ModelConfig = shape(vocab)
        biases = None  # a Hugging Face folder's MoE selection biases (DeepSeek-V3's)
        if init is not None and not isinstance(init, ShardedCheckpoint):
            init = init.for_model(self.model_cfg)  # (the folder's shape with the overrides)
            biases = init.expert_biases()
        self.model: Transformer = build_model(self.model_cfg, device="meta")
        self.param_shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        source: TensorSource = (init if init is not None else
                                InitSource(self.model_cfg, train.seed, self.param_shapes))
        if isinstance(init, ShardedCheckpoint):
            check_model(init, self.param_shapes)
            source = init.source("weight")
        par = parallelize(self.model, comm, parallel, train, source=source,
                          offload_file=self.offload_file(), precision=precision)
        self.engine: Engine = par.engine
        self.tp: TensorParallel | None = par.tp
        self.pipe, self.cp = par.pipe, par.cp
        if isinstance(init, ShardedCheckpoint):
            init.close()
        self.model.set_expert_biases(biases)
        del source, init
        memory.measure("construction", comm)
        self.engine.reduce_dtype = precision.grad_reduce_dtype
        self.loss_fn = build_loss(self.model, self.tp, train.loss, train.loss_chunk)
        if train.compile:
            self.loss_fn = compile_loss(self.loss_fn)

    def open_init_from(self, vocab: int) -> tuple[object | None, int]:
        """(source of ``model.init_from`` or None, vocabulary size of the model)."""
        path = self.section.init_from
        if not path:
            return None, vocab
        from ...checkpoint.loading import is_hf_folder, resolve_checkpoint

        p = Path(path).expanduser()
        if is_hf_folder(p):
            from ...checkpoint.hf import HFSource

            init: object = HFSource(p)
        else:
            init = ShardedCheckpoint(resolve_checkpoint(p))
        size = init.shape("tok_embeddings.weight")[0]
        if vocab > size:
            raise CheckpointError(f"model.init_from={path}: its vocabulary has {size} tokens, "
                                  f"the tokenizer {vocab}")
        return init, size

    def offload_file(self) -> Path | None:
        """This rank's file of AdamW moments under ``parallel.offload=disk``:
        ``<parallel.offload_dir or run.dir/offload>/rank_NNNNN.adam`` (see parallel/offload.py)."""
        par = self.parallel
        if par.offload == "cpu" and self.device.type == "cpu":
            self.log("parallel.offload=cpu: the optimizer states live in host memory already "
                     "on a CPU run (the same as none)")
        if par.offload != "disk":
            return None
        folder = Path(par.offload_dir).expanduser() if par.offload_dir else (
            self.run_dir / "offload")
        self.log(f"parallel.offload=disk: AdamW moments in {folder}/rank_*.adam")
        return folder / f"rank_{self.comm.mesh.rank:05d}.adam"

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``model`` (the shape) and, under bias balancing, ``moe_bias``
        (collective over pp)."""
        mc = self.model_cfg
        return {"model": asdict(mc), **({"moe_bias": self.expert_biases()}
                                        if mc.moe_balance == "bias" and mc.is_moe else {})}

    def shards(self) -> Shards:
        return Shards(engine=self.engine)

    def load_state_dict(self, state: Mapping[str, Any], ckpt: ShardedCheckpoint) -> None:
        """This rank's slices of the weights and (when stored for this run) the optimizer
        moments -- an island's own under DiLoCo -- and the MoE selection biases."""
        check_model(ckpt, self.param_shapes)
        if not load_into(ckpt, self.engine, self.device, prefix=island_prefix(self.comm.mesh)):
            self.log(f"checkpoint {ckpt.directory.name} holds no "
                     f"{' / '.join(self.engine.state_kinds())} for this run (another optimizer, "
                     "or DiLoCo islands): the optimizer state starts fresh")
        self.model.set_expert_biases(state.get("moe_bias"))

    def expert_biases(self) -> list[list[float]]:
        """Every MoE layer's selection bias (zeros for dense layers); the pipeline stages'
        layers summed over pp (one tiny all-reduce), so every rank has them all."""
        mc = self.model_cfg
        table = torch.zeros(mc.n_blocks, mc.moe_experts, dtype=torch.float64,
                            device=self.device)  # (the training heads' blocks last)
        for i, moe in moe_layers(self.model).items():
            table[i] = moe.expert_bias.double()
        self.comm.all_reduce(table, "pp", purpose="state")
        return table.cpu().tolist()

    def startup_lines(self) -> list[str]:
        """The experts line of the start-up log (MoE only)."""
        mc = self.model_cfg
        if not mc.is_moe:
            return []
        ep = self.comm.size("ep")
        return [f"experts: {mc.moe_experts} per MoE layer, top-{mc.moe_topk}, "
                + (f"{mc.moe_experts // ep} per rank (ep={ep}), " if ep > 1 else "")
                + f"balance {mc.moe_balance}, "
                + (f"capacity factor {mc.moe_capacity:g}" if mc.moe_capacity else "dropless")]


class Routing:
    """The last step's routing per MoE layer (``router`` in the record; nothing when dense)."""

    def __init__(self, model: Transformer, comm: Comm, model_cfg: ModelConfig) -> None:
        self.model, self.comm, self.model_cfg = model, comm, model_cfg
        self.last: dict[str, Any] = {}

    def update(self) -> None:
        """End of a step: statistics and the balancing bias (MoE only; collective)."""
        if self.model_cfg.is_moe:
            self.last = router_step(self.model, self.comm, self.model_cfg.n_blocks,
                                    self.model_cfg.moe_experts)

    def record(self, step: int) -> dict[str, Any]:
        return {"router": self.last} if self.last else {}
