"""Hugging Face architecture names and ``config.json`` value readers (torch-free), shared by
``models/hf_config.py`` and the techniques' HF parts (``models/hf_techniques.py``).

No communication; no memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LLAMA = "LlamaForCausalLM"
MIXTRAL = "MixtralForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"


def get_key(d: Mapping[str, Any], key: str, default: Any) -> Any:
    """``d[key]``, or ``default`` when the file leaves the key out (a null stays null)."""
    return d[key] if key in d else default


def int_key(d: Mapping[str, Any], key: str, default: int) -> int:
    """``d[key]`` as an integer (``default`` when left out, 0 for null); ValueError naming the
    key for a value that is not one."""
    v = get_key(d, key, default)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int | float) or v != int(v):
        raise ValueError(f"{key}={v!r}: expected an integer")
    return int(v)


__all__ = ["DEEPSEEK_V3", "LLAMA", "MIXTRAL", "QWEN3", "QWEN3_MOE", "get_key", "int_key"]
