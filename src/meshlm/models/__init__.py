"""Plain single-device models: the dense Llama-style decoder and its MoE variant."""

from .config import ModelConfig
from .llama import Transformer, build_model, init_weights
from .presets import PRESETS, get_preset

__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model", "get_preset", "init_weights"]
