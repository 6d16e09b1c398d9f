"""The attention layer is a registered choice (``layers.ATTENTION_LAYERS``): the decoder builds
the one ``ModelConfig.attention_layer`` names, and the techniques applied from outside read what
the layer declares -- tensor parallelism its registered plan (``tensor.ATTENTION_PLANS``), the
float8 converter its linears -- so a new layer needs no edit of the decoder, tensor.py or
float8.py. One process, no training: the layouts are checked against one process where each
layer lives (tests/test_mla.py, tests/test_tensor_parallel.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch import nn

from meshlm.models import get_preset
from meshlm.models.attention_cost import PROJECTIONS, ProjectionCost
from meshlm.models.config import ModelConfig
from meshlm.models.layers import ATTENTION_LAYERS, build_attention_layer, register_attention_layer
from meshlm.models.llama import Attention, Transformer
from meshlm.parallel.float8 import _block_linears
from meshlm.parallel.tensor import ATTENTION_PLANS, attention_plan, register_attention_plan

LATENT = dict(kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16)


def _linears(layer: nn.Module) -> set[str]:
    return {n for n, m in layer.named_children() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("shape", [{}, LATENT, {**LATENT, "q_lora_rank": 0}],
                         ids=["gqa", "latent", "latent-wq"])
def test_every_layer_declares_its_linears_and_has_a_plan_and_a_cost(shape: dict) -> None:
    cfg = replace(get_preset("tiny"), **shape)
    layer = build_attention_layer(cfg)
    assert type(layer) is ATTENTION_LAYERS[cfg.attention_layer]
    assert layer.layer_name == cfg.attention_layer in PROJECTIONS
    assert attention_plan(layer) is ATTENTION_PLANS[cfg.attention_layer]
    # every matmul linear it holds is declared (float8 converts them all), nothing more
    assert _linears(layer) == set(layer.linears) & set(dict(layer.named_children()))
    model = Transformer(cfg)
    for block in model.blocks().values():
        assert {name for _, name, _ in _block_linears(block)} >= _linears(block.attention)


class _Toy(Attention):
    """A made-up attention layer: grouped-query attention under another name."""


class _ToyConfig(ModelConfig):
    @property
    def attention_layer(self) -> str:
        return "toy"


def test_a_new_layer_is_registrations_only() -> None:
    """Without its cost a layer is refused; registered with a cost and a tp plan, the decoder
    holds it, float8 finds its linears and tensor parallelism its plan."""
    with pytest.raises(ValueError, match="'toy' has no cost"):
        register_attention_layer("toy")(_Toy)
    cfg = _ToyConfig(**{f: getattr(get_preset("tiny"), f)
                        for f in ModelConfig.__dataclass_fields__})
    with pytest.raises(ValueError, match="attention layer 'toy' is not one of"):
        build_attention_layer(cfg)
    PROJECTIONS.register(ProjectionCost("toy", "a made-up attention layer"))
    try:
        register_attention_layer("toy")(_Toy)
        with pytest.raises(ValueError, match="registered twice"):
            register_attention_layer("toy")(_Toy)
        model = Transformer(cfg)
        att = model.layers["0"].attention
        assert type(att) is _Toy and att.layer_name == "toy"
        assert {n for _, n, _ in _block_linears(model.layers["0"])} >= {"wq", "wk", "wv", "wo"}
        with pytest.raises(ValueError, match="'toy' has no tensor-parallel plan"):
            attention_plan(att)
        register_attention_plan("toy", ATTENTION_PLANS["gqa"])
        assert attention_plan(att) is ATTENTION_PLANS["gqa"]
    finally:
        for registry in (PROJECTIONS, ATTENTION_LAYERS, ATTENTION_PLANS):
            registry.pop("toy", None)
