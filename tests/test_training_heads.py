"""The generic mechanisms extra training heads use (``models/heads.py``,
``parallel/objective.py``), single process: a second head and objective registered beside
multi-token prediction's is built into the model (its own attribute and parameter names), gets
the last layer's output of a training forward only, runs in the step loop with its own weight
and metric (``{name}_loss``, shown on the progress line) and leaves multi-token prediction's
loss and the main loss exactly as they are without it (the same seed and batch: fp32, bitwise
equal -- the extra objective adds its own term after theirs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from meshlm.models.heads import TRAINING_HEADS, register_training_head
from meshlm.models.llama import build_model
from meshlm.models.presets import get_preset
from meshlm.parallel.loss import cross_entropy
from meshlm.parallel.objective import OBJECTIVES, register_objective
from meshlm.parallel.training_heads import build_objectives, registered
from meshlm.train.progress import summary
from meshlm.train.steps import MicroBatchRunner


class _Probe(nn.Module):
    """A toy head: one linear read on the kept last layer's output."""

    reads_embedding = False

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.read = nn.Linear(dim, 1, bias=False)
        self.input: torch.Tensor | None = None

    def keep(self, h: torch.Tensor) -> None:
        self.input = h

    def blocks(self) -> dict[int, nn.Module]:
        return {}


class _ProbeLoss:
    name = "probe"
    target_docs = False
    weight = 0.5

    @staticmethod
    def enabled(cfg: Any) -> bool:  # noqa: ANN401
        return True

    def __init__(self, model: nn.Module, loss_fn: Callable, comm: Any, cp: Any,  # noqa: ANN401
                 device: torch.device) -> None:
        self.model = model

    def prepare(self, micro: list[tuple[torch.Tensor, ...]]) -> list[None]:
        return [None] * len(micro)

    def __call__(self, prepared: None) -> torch.Tensor:
        head = self.model.probe
        h, head.input = head.input, None
        return head.read(h).pow(2).mean()

    def layer_ids(self) -> list[int]:
        return []


class _OneRank:
    def size(self, axis: str) -> int:
        return 1

    def all_reduce(self, t: torch.Tensor, axis: str, **kw: object) -> None:
        pass


class _Engine:
    def set_sync(self, sync: bool) -> None:
        pass


class _Precision:
    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        yield

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


@pytest.fixture
def probe() -> Iterator[None]:
    registered()  # (the techniques' first, as in a run)
    register_training_head("probe")(lambda cfg, block: _Probe(cfg.dim))
    register_objective(_ProbeLoss)
    try:
        yield
    finally:
        del TRAINING_HEADS["probe"], OBJECTIVES["probe"]


def _step(model: nn.Module, objectives: list) -> tuple[float, dict[str, Any]]:
    runner = MicroBatchRunner(model, _Engine(), cross_entropy, _Precision(), torch.device("cpu"),
                              objectives=objectives)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 2, 17), generator=g)
    loss = runner.forward_backward([(t[:, :-1], t[:, 1:]) for t in tokens])
    return loss, runner.record(0)


def test_a_second_head_and_objective_run_beside_the_first(probe: None) -> None:
    cfg = get_preset("tiny").with_(mtp_depth=1)
    model = build_model(cfg, seed=1).train()
    assert isinstance(model.probe, _Probe) and model.mtp is not None
    assert any(n.startswith("probe.read.") for n, _ in model.named_parameters())
    assert set(model.training_heads()) == {"mtp", "probe"}
    with torch.no_grad():  # (evaluation keeps nothing for the heads)
        model(torch.zeros(1, 4, dtype=torch.long))
    assert model.probe.input is None
    both = build_objectives(cfg, model, cross_entropy, _OneRank(), None, torch.device("cpu"))
    assert [o.name for o in both] == ["mtp", "probe"]
    loss, rec = _step(model, both)
    assert set(rec) == {"mtp_loss", "probe_loss"} and rec["probe_loss"] > 0
    assert model.probe.read.weight.grad is not None
    line = summary({**_record(loss), **rec})
    assert f"| mtp {rec['mtp_loss']:.4f} | probe {rec['probe_loss']:.4f} |" in line

    alone = build_model(cfg, seed=1).train()  # the same weights: only the first objective
    first = build_objectives(cfg, alone, cross_entropy, _OneRank(), None, torch.device("cpu"))
    loss_alone, rec_alone = _step(alone, first[:1])
    assert loss_alone == loss and rec_alone == {"mtp_loss": rec["mtp_loss"]}
    grads = {n: p.grad for n, p in alone.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():  # the extra head's gradient reaches the layers only
        if n.startswith("mtp."):
            assert torch.equal(p.grad, grads[n]), n


def test_no_objective_and_no_head_without_the_keys() -> None:
    model = build_model(get_preset("tiny"), seed=1).train()
    assert model.mtp is None and model.training_heads() == {}
    assert build_objectives(model.cfg, model, cross_entropy, _OneRank(), None,
                            torch.device("cpu")) == []
    loss, rec = _step(model, [])
    assert rec == {} and loss > 0


def _record(loss: float) -> dict[str, Any]:
    return {"loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, "mfu": 0.0,
            "mem_peak_bytes": 0}
