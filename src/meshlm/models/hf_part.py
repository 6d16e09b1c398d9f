"""A technique's share of the Hugging Face mapping (torch-free): :class:`HFPart`.

``models/hf_config.py`` (``config.json``), ``checkpoint/hf_names.py`` (tensor names) and
``checkpoint/hf.py`` (tensors) hold what every architecture has: embeddings, norms, grouped-
query attention, the MLP and the MoE layers. A technique that gives a model more config keys,
other layer weights or extra stored layers describes its share once, as an :class:`HFPart`
listed in ``models/hf_techniques.py``; the three files loop over the listed parts and name
none. Every method has a do-nothing default, so a part overrides only what it changes:

- ``config.json``: :meth:`HFPart.export_arch` (the architecture a model using the technique
  exports as), :meth:`HFPart.refuse_export` (why an architecture cannot express the model),
  :meth:`HFPart.to_hf` / :meth:`HFPart.from_hf` (its keys both ways) and
  :meth:`HFPart.from_folder` (a field the stored tensors decide);
- tensor names: :meth:`HFPart.layer_names` (its weights inside every decoder layer),
  :meth:`HFPart.block_of` (its own decoder blocks, stored as HF decoder layers),
  :meth:`HFPart.key` (its weights outside blocks), :meth:`HFPart.copies` (HF keys stored as
  copies of a meshlm tensor), :meth:`HFPart.dropped` (stored keys a model may leave out);
- tensors: :meth:`HFPart.row_order` (a weight whose rows HF stores in another order, as the
  HF row of each meshlm row: a permutation, applied exactly both ways).

Arguments: ``cfg`` the meshlm model, ``arch`` the HF architecture name, ``d`` the HF
``config.json`` as a dict (None when writing one), ``rest`` a name inside a decoder block
(``attention.wq.weight``). No communication; no memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import ModelConfig


class HFPart:
    """One technique's share of the HF mapping (module docstring); the defaults do nothing."""

    name: str = ""

    # ------------------------------------------------------------------ config.json
    def export_arch(self, cfg: ModelConfig) -> str | None:
        """The HF architecture ``cfg`` must export as because it uses the technique."""
        return None

    def refuse_export(self, cfg: ModelConfig, arch: str) -> str | None:
        """Why ``arch`` cannot express ``cfg`` (a message naming the field), or None."""
        return None

    def to_hf(self, cfg: ModelConfig, arch: str) -> dict[str, Any]:
        """The technique's ``config.json`` keys of ``cfg`` in ``arch``."""
        return {}

    def from_hf(self, d: Mapping[str, Any], arch: str,
                fields: Mapping[str, Any]) -> dict[str, Any]:
        """ModelConfig fields of ``config.json`` ``d`` (``fields``: those read so far);
        ValueError naming the key for what meshlm cannot express."""
        return {}

    def from_folder(self, fields: Mapping[str, Any], d: Mapping[str, Any], arch: str,
                    keys: Callable[[], list[str]]) -> dict[str, Any]:
        """Fields the folder's stored tensors decide (``keys()``: their names)."""
        return {}

    # ------------------------------------------------------------------ tensor names
    def layer_names(self, cfg: ModelConfig, arch: str) -> Mapping[str, str]:
        """meshlm name -> HF name of the technique's weights in every decoder layer (without
        the ``layers.{i}.`` / ``model.layers.{i}.`` prefixes)."""
        return {}

    def block_of(self, cfg: ModelConfig, name: str) -> tuple[int, str] | None:
        """(HF decoder layer, name inside the block) of a parameter of the technique's own
        decoder blocks; None for other names."""
        return None

    def key(self, cfg: ModelConfig, arch: str, name: str) -> str | None:
        """The HF key of the technique's parameter ``name`` outside decoder blocks."""
        return None

    def copies(self, cfg: ModelConfig, arch: str, name: str) -> list[str]:
        """HF keys ``arch`` stores as copies of meshlm parameter ``name``."""
        return []

    def dropped(self, cfg: ModelConfig, arch: str, d: Mapping[str, Any] | None,
                key: str) -> bool:
        """True for a stored HF key ``cfg`` leaves out (the folder holds more than it reads)."""
        return False

    def row_order(self, cfg: ModelConfig, arch: str, d: Mapping[str, Any] | None,
                  rest: str) -> tuple[int, ...] | None:
        """The HF row of each meshlm row (dim 0) of block weight ``rest``, when ``arch`` stores
        its rows in another order; None otherwise."""
        return None


__all__ = ["HFPart"]
