"""A technique is one place (DESIGN.md, principle 2): multi-head latent attention and
multi-token prediction are named only in their own modules, the lists that register them and
the data that uses them (presets, published shapes) -- never in the generic code that composes
them (the model, the trainer, the pipeline executor, tensor parallelism, the planner, the
Hugging Face mapping). The check reads every module of ``src/meshlm`` (code, docstrings and
comments alike), so a generic file that starts naming either technique fails it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "meshlm"

# modules that list the techniques of a kind (each registration is one line there)
INDEXES = {"models/techniques.py", "models/hf_techniques.py", "models/attention_layers.py",
           "models/training_heads.py", "parallel/attention_plans.py",
           "parallel/training_heads.py"}
# data that uses a technique's keys: preset shapes and published models with their sources
DATA = {"models/presets.py", "models/published.py"}

TECHNIQUES = {
    "multi-token prediction": (
        r"(?i)(?<![a-z])mtp|multi[-_ ]?token|nextn",
        {"models/mtp.py", "models/mtp_cost.py", "models/mtp_hf.py", "parallel/multi_token.py"}),
    "multi-head latent attention": (
        r"(?i)(?<![a-z])mla(?![a-z])|kv_lora|q_lora|qk_rope|qk_nope|v_head_dim"
        r"|latent[-_ ]attention",
        {"models/mla.py", "models/mla_cost.py", "models/mla_hf.py", "parallel/mla_tp.py"}),
}


def _naming(pattern: str) -> set[str]:
    return {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
            if re.search(pattern, p.read_text(encoding="utf-8"))}


@pytest.mark.parametrize("technique", sorted(TECHNIQUES))
def test_a_technique_is_named_only_in_its_own_files(technique: str) -> None:
    pattern, own = TECHNIQUES[technique]
    naming = _naming(pattern)
    assert own <= naming, f"{technique}: its own modules moved ({sorted(own - naming)})"
    generic = sorted(naming - own - INDEXES - DATA)
    assert not generic, (f"{technique} is named in generic modules {generic}: move the "
                         "knowledge to its own files behind a hook (docs/architecture.md, "
                         "'How to add a technique')")
    # the existing files that use it, besides its own and the lists: data only, at most 3
    assert len(naming & DATA) <= 3


def test_the_pattern_finds_what_it_should() -> None:
    """The patterns match the techniques' names and keys and nothing generic."""
    mtp, _ = TECHNIQUES["multi-token prediction"]
    mla, _ = TECHNIQUES["multi-head latent attention"]
    assert re.search(mtp, "cfg.mtp_depth") and re.search(mtp, "num_nextn_predict_layers")
    assert not re.search(mtp, "class _ReduceFromTP")  # (tp's f, not MTP)
    assert re.search(mla, "cfg.kv_lora_rank") and re.search(mla, "MLA's latents")
    assert not re.search(mla, "value_head_dim") and not re.search(mla, "mlanguage")
