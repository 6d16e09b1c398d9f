"""Hugging Face interop: read and write ``LlamaForCausalLM``, ``MixtralForCausalLM``,
``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` and ``DeepseekV3ForCausalLM`` folders.

An HF folder is ``config.json`` plus safetensors weights, either one ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``. meshlm uses HF's "rotate half" rotary
convention, so most weights convert by renaming only (``hf_names.py`` has the table); the
reshapings are:

- experts, stored per expert by HF (``mlp.experts.{e}.gate_proj.weight``, Mixtral's
  ``block_sparse_moe.experts.{e}.w1.weight``, 2-D) and stacked along dim 0 by meshlm
  (``feed_forward.experts.w1``, 3-D);
- rows stored in another order (a part's :meth:`~meshlm.models.hf_part.HFPart.row_order`, a
  permutation): picked in meshlm's order at load and put back in HF's at save, exactly;
- HF keys stored as copies of a meshlm tensor (a part's
  :meth:`~meshlm.models.hf_part.HFPart.copies`): checked equal to it at load (each rank the
  boxes it reads) and written at save; stored keys a model leaves out (a part's
  :meth:`~meshlm.models.hf_part.HFPart.dropped`) are skipped;
- DeepSeek-V3's ``e_score_correction_bias``, the MoE's auxiliary-loss-free selection bias: not
  a parameter in meshlm (the checkpoint's ``moe_bias`` table): :meth:`HFSource.expert_biases`
  and :func:`write_hf`'s ``expert_biases``;
- FP8 block-quantised weights (DeepSeek-V3 as published: ``quantization_config`` ``fp8``,
  ``weight_scale_inv`` per block) are dequantised as read, box by box.

- :func:`model_config_from_hf` / :func:`hf_config_from_model`: config.json <-> ModelConfig,
  refusing (``ValueError`` naming the field) whatever the other side cannot express.
- :func:`hf_name` / :func:`meshlm_name`: Llama/Mixtral parameter names both ways
  (:class:`~meshlm.checkpoint.hf_names.HFNames` for every architecture).
- :class:`HFSource`: a :class:`~meshlm.distributed.source.TensorSource` over an HF folder.
- :func:`write_hf`: an HF folder from any TensorSource.

Files written by transformers 5.x: ``save_pretrained`` reverts its in-memory MoE layout
(fused ``mlp.experts.gate_up_proj`` (E, 2F, H) and ``mlp.experts.down_proj`` (E, H, F)) to the
per-expert names above, which every version loads; a folder saved in the fused layout
(``save_original_format=False``) is read too. :func:`write_hf` writes the per-expert names.

No communication: everything runs on the calling process. Memory: :meth:`HFSource.read` holds
the requested box only (it reads it with ``get_slice``; for stacked experts, only the experts
inside the box; for reordered rows, the range of HF rows covering them; a copy's same box to
compare); :func:`write_hf` holds one global tensor of the source at a time and streams it
to disk. Nothing is unpickled: weights are read from safetensors only.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from ..distributed.boxes import Box
from ..distributed.source import TensorSource
from ..models.config import ModelConfig
from ..models.hf_config import (  # noqa: F401 - re-exported
    _ARCH_OF_MODEL_TYPE,
    _DEFAULT_EPS,
    _DEFAULT_MAX_POS,
    _DEFAULT_THETA,
    _MODEL_TYPE_OF_ARCH,
    CONFIG_FILE,
    DEEPSEEK_V3,
    INDEX_FILE,
    LLAMA,
    MIXTRAL,
    QWEN3,
    QWEN3_MOE,
    SINGLE_FILE,
    _architecture,
    _hf_dict,
    _rope_theta,
    hf_architecture,
    hf_config_from_model,
    is_hf_folder,
    model_config_from_hf,
)
from ..models.hf_config import (
    _read_json as _read_config_json,
)
from .hf_names import GLOBAL as _GLOBAL
from .hf_names import HFNames
from .state import CheckpointError

# ---------------------------------------------------------------------------------- names
# (Llama / Mixtral, the cfg-less functions below; HFNames has every architecture's)
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.weight": "block_sparse_moe.gate.weight",
}
_EXPERT_PROJ = ("w1", "w2", "w3")  # meshlm and HF-Mixtral use the same letters
_GLOBAL_INV = {v: k for k, v in _GLOBAL.items()}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_LAYER_INV["mlp.gate.weight"] = "feed_forward.router.weight"  # transformers 5.x in memory
_LAYER_INV["mlp.experts.down_proj"] = "feed_forward.experts.w2"  # 5.x fused: (E, H, F)
_MESHLM_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123])\.weight$")
_FUSED_GATE_UP = "mlp.experts.gate_up_proj"  # 5.x fused: (E, 2F, H), gate rows then up rows
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")
_SCALE_INV = "_scale_inv"  # FP8 block scales: ``<key>_scale_inv`` beside ``<key>``


def is_stacked_expert(name: str) -> bool:
    """True for meshlm's stacked expert tensors ``layers.{i}.feed_forward.experts.w{1,2,3}``
    (and those of a technique's own blocks, ``<part>.{k}.block.feed_forward.experts.*``)."""
    m = _MESHLM_LAYER.match(name) or re.match(r"^\w+\.(\d+)\.block\.(.+)$", name)
    return bool(m) and m.group(2) in {f"feed_forward.experts.{w}" for w in _EXPERT_PROJ}


def hf_name(name: str, expert: int | None = None) -> str:
    """The HF Llama/Mixtral name of meshlm parameter ``name``.

    Stacked expert tensors map to one HF tensor per expert: pass ``expert`` for them.
    """
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _MESHLM_LAYER.match(name)
    if m:
        layer, rest = m.groups()
        if rest in _LAYER:
            return f"model.layers.{layer}.{_LAYER[rest]}"
        if is_stacked_expert(name):
            if expert is None:
                raise ValueError(f"{name} is stacked over experts: pass expert=")
            proj = rest.rsplit(".", 1)[1]
            return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight"
    raise ValueError(f"{name!r} has no Hugging Face Llama/Mixtral counterpart")


def meshlm_name(name: str) -> tuple[str, int | None]:
    """(meshlm name, expert index or None) of HF Llama/Mixtral tensor ``name`` (inverse of
    :func:`hf_name`).

    Reads the 5.x in-memory names too (``mlp.gate``, fused ``mlp.experts.down_proj``); the fused
    ``mlp.experts.gate_up_proj`` holds two meshlm tensors (w1 and w3) and raises ValueError.
    """
    if name in _GLOBAL_INV:
        return _GLOBAL_INV[name], None
    m = _HF_LAYER.match(name)
    if m:
        layer, rest = m.groups()
        if rest in _LAYER_INV:
            return f"layers.{layer}.{_LAYER_INV[rest]}", None
        e = _HF_EXPERT.match(rest)
        if e:
            return f"layers.{layer}.feed_forward.experts.{e.group(2)}", int(e.group(1))
        if rest == _FUSED_GATE_UP:
            raise ValueError(f"{name} holds both layers.{layer}.feed_forward.experts.w1 and .w3")
    raise ValueError(f"{name!r} has no meshlm counterpart")


def iter_meshlm_names(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, global shape) of every parameter of the one-process model; a tied head once."""
    from ..models.llama import build_model

    model = build_model(cfg, device="meta")
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def moe_layer_ids(cfg: ModelConfig) -> list[int]:
    """Layer ids of the MoE blocks of the one-process model (``cfg.n_blocks``: the blocks
    techniques add come last): the rows of the selection-bias table that are not zero."""
    return [i for i in range(cfg.n_blocks) if cfg.is_moe_layer(i)]


# ---------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Recipe:
    """Where one meshlm tensor lives in the HF files.

    ``keys``: one HF key, or (``stacked``) one per expert, ``keys[e]`` holding expert ``e``.
    ``offset``: first row along dim 1 (fused ``gate_up_proj``: 0 for w1, F for w3).
    ``rows``: the HF row of each meshlm row when HF stores them in another order.
    ``copies``: HF keys holding a copy of the tensor (checked equal when read).
    """

    keys: tuple[str, ...]
    stacked: bool = False
    offset: int = 0
    rows: tuple[int, ...] | None = None
    copies: tuple[str, ...] = ()


def _norm_box(box: Box, shape: tuple[int, ...], name: str) -> tuple[slice, ...]:
    """``box`` padded to ``shape``'s rank with explicit, non-negative bounds and steps."""
    if len(box) > len(shape):
        raise ValueError(f"box {box} has more dims than {name} {shape}")
    out = []
    for s, n in zip(tuple(box) + (slice(None),) * (len(shape) - len(box)), shape, strict=True):
        start, stop, step = s.indices(n)
        if step <= 0:
            raise ValueError(f"box {box} of {name}: only positive steps are supported")
        out.append(slice(start, max(start, stop), step))
    return tuple(out)


def _box_shape(box: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(s.start, s.stop, s.step)) for s in box)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; CheckpointError naming the file otherwise."""
    try:
        return _read_config_json(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _fp8_block(hf_config: dict[str, Any], path: Path) -> tuple[int, int] | None:
    """The (rows, columns) block of FP8 block-quantised weights (DeepSeek-V3 as published),
    None without quantisation; CheckpointError for a quantisation meshlm does not read."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict) or q.get("quant_method") != "fp8" or \
            q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{path / CONFIG_FILE}: quantization_config={q}: meshlm reads "
                              "unquantised weights or DeepSeek's FP8 (fp8, e4m3, dynamic, "
                              "weight_block_size) only")
    block = q.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise CheckpointError(f"{path / CONFIG_FILE}: quantization_config.weight_block_size="
                              f"{block}: expected two positive integers")
    return block[0], block[1]


class HFSource:
    """TensorSource over an HF folder: meshlm names in, fp32 boxes out (see module docstring).

    ``cfg``: the meshlm model to fill (default: :func:`model_config_from_hf` of the folder). It
    may untie a tied HF head (``output.weight`` then reads ``model.embed_tokens.weight``) and
    leave out stored layers a technique lets it drop (:meth:`HFNames.dropped`).
    The folder is checked on construction: a missing file, a missing or extra tensor or a wrong
    shape raises :class:`CheckpointError` naming it.
    """

    def __init__(self, path: str | Path, cfg: ModelConfig | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a folder")
        self.hf_config = _read_json(self.path / CONFIG_FILE)
        try:
            self.arch = _architecture(self.hf_config)
            self.cfg = cfg if cfg is not None else model_config_from_hf(self.path)
        except ValueError as e:
            raise CheckpointError(f"{self.path / CONFIG_FILE}: {e}") from None
        self.hf_names = HFNames(self.cfg, self.arch, self.hf_config)
        self._fp8 = _fp8_block(self.hf_config, self.path)
        self._handles: dict[Path, Any] = {}
        self._file_of, self._hf_shape = self._scan_files()
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._recipes: dict[str, _Recipe] = {}
        self._biases: list[list[float]] | None = None
        self._plan()

    def for_model(self, cfg: ModelConfig) -> HFSource:
        """This folder read into the model ``cfg`` (the folder's shape with overrides)."""
        if cfg == self.cfg:
            return self
        return HFSource(self.path, cfg)

    # -------------------------------------------------------------- construction
    def _open(self, file: Path) -> Any:
        if file not in self._handles:
            if not file.is_file():
                raise CheckpointError(f"missing file {file}")
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read {file}: {e}") from None
        return self._handles[file]

    def _scan_files(self) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
        """HF key -> file and HF key -> shape, from the safetensors headers only."""
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map")
            file_of = {k: self.path / v for k, v in weight_map.items()}
        elif (self.path / SINGLE_FILE).is_file():
            f = self._open(self.path / SINGLE_FILE)
            file_of = dict.fromkeys(f.keys(), self.path / SINGLE_FILE)
        else:
            raise CheckpointError(f"{self.path} has neither {SINGLE_FILE} nor {INDEX_FILE} "
                                  "(meshlm reads safetensors only)")
        keys_in: dict[Path, set[str]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for key, file in file_of.items():
            if file not in keys_in:
                keys_in[file] = set(self._open(file).keys())
            if key not in keys_in[file]:
                raise CheckpointError(f"{file} has no tensor {key!r} (listed in {INDEX_FILE})")
            shapes[key] = tuple(self._open(file).get_slice(key).get_shape())
        return file_of, shapes

    def _require(self, key: str, shape: tuple[int, ...]) -> None:
        if key not in self._hf_shape:
            raise CheckpointError(f"{self.path}: missing tensor {key!r}")
        if self._hf_shape[key] != shape:
            raise CheckpointError(f"{self._file_of[key]}: tensor {key!r} has shape "
                                  f"{self._hf_shape[key]}, the model expects {shape}")
        if self._fp8 is not None and key + _SCALE_INV in self._hf_shape:
            blocks = tuple(-(-n // b) for n, b in zip(shape, self._fp8, strict=False))
            if len(shape) != 2 or self._hf_shape[key + _SCALE_INV] != blocks:
                raise CheckpointError(f"{self._file_of[key + _SCALE_INV]}: tensor "
                                      f"{key + _SCALE_INV!r} has shape "
                                      f"{self._hf_shape[key + _SCALE_INV]}, expected {blocks} "
                                      f"(blocks of {self._fp8} over {shape})")

    def _plan(self) -> None:
        hf_ties = bool(self.hf_config.get("tie_word_embeddings", False))
        used: set[str] = set()
        for name, shape in iter_meshlm_names(self.cfg):
            if self.hf_names.is_stacked_expert(name):
                recipe = self._expert_recipe(name, shape)
            elif name == "output.weight" and (hf_ties or "lm_head.weight" not in self._hf_shape):
                if not hf_ties:
                    raise CheckpointError(f"{self.path}: missing tensor 'lm_head.weight'")
                recipe = _Recipe(("model.embed_tokens.weight",))
                self._require(recipe.keys[0], shape)
            else:
                recipe = self._plain_recipe(name, shape)
            copies = tuple(k for k in self.hf_names.copies(name) if k in self._hf_shape)
            for k in copies:
                self._require(k, shape)
            if copies:
                recipe = _Recipe(recipe.keys, recipe.stacked, recipe.offset, recipe.rows, copies)
            self._recipes[name], self._shapes[name] = recipe, shape
            used.update(recipe.keys + copies)
        if self.cfg.tie_embeddings and not hf_ties and "lm_head.weight" in self._hf_shape:
            raise CheckpointError(f"{self.path}: the model ties its head but the folder holds a "
                                  "separate 'lm_head.weight' (tie_word_embeddings is false)")
        used.add("lm_head.weight")  # a tied HF head may be stored anyway
        used.update(self._plan_biases())
        used.update(k + _SCALE_INV for k in list(used))
        extra = sorted(k for k in self._hf_shape
                       if k not in used and not _IGNORED.search(k) and not self._dropped(k))
        if extra:
            raise CheckpointError(f"{self.path}: tensors the model has no place for: {extra[:3]}"
                                  + (f" (+{len(extra) - 3} more)" if len(extra) > 3 else ""))

    def _plain_recipe(self, name: str, shape: tuple[int, ...]) -> _Recipe:
        try:
            key = self.hf_names.key(name)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: {e}") from None
        if name.endswith("feed_forward.router.weight") and key not in self._hf_shape:
            for a, b in ((".block_sparse_moe.", ".mlp."), (".mlp.", ".block_sparse_moe.")):
                if a in key and key.replace(a, b) in self._hf_shape:
                    key = key.replace(a, b)
                    break
        self._require(key, shape)
        return _Recipe((key,), rows=self.hf_names.row_order(name))

    def _dropped(self, key: str) -> bool:
        """A stored key the model leaves out (:meth:`HFNames.dropped`)."""
        return self.hf_names.dropped(key)

    def _plan_biases(self) -> list[str]:
        """Read DeepSeek-V3's selection biases (one tiny vector per MoE layer) into the table
        :meth:`expert_biases` returns; the keys read."""
        if self.arch != DEEPSEEK_V3 or not self.cfg.is_moe:
            return []
        table = [[0.0] * self.cfg.moe_experts for _ in range(self.cfg.n_blocks)]
        keys = []
        for i in moe_layer_ids(self.cfg):
            key = self.hf_names.bias_key(i)
            assert key is not None
            self._require(key, (self.cfg.moe_experts,))
            table[i] = self._slice(key, (slice(0, self.cfg.moe_experts, 1),)).double().tolist()
            keys.append(key)
        if self.cfg.moe_balance != "bias" and any(any(r) for r in table):
            raise CheckpointError(f"{self.path}: the MoE layers' e_score_correction_bias is not "
                                  f"zero but model.moe_balance={self.cfg.moe_balance!r}: "
                                  "selecting by it needs model.moe_balance='bias'")
        self._biases = table if self.cfg.moe_balance == "bias" else None
        return keys

    def _expert_recipe(self, name: str, shape: tuple[int, ...]) -> _Recipe:
        n_exp, rows, cols = shape
        keys = tuple(self.hf_names.expert_key(name, e) for e in range(n_exp))
        alternatives = [keys]
        if self.arch == MIXTRAL:  # (the same letters under mlp.)
            alternatives.append(tuple(k.replace(".block_sparse_moe.", ".mlp.") for k in keys))
        for option in alternatives:
            if option[0] in self._hf_shape:
                for k in option:
                    self._require(k, (rows, cols))
                return _Recipe(option, stacked=True)
        fused = self.hf_names.fused_expert(name)
        if fused is not None and fused[0] in self._hf_shape:
            key, half = fused
            self._require(key, shape if key.endswith("down_proj") else (n_exp, 2 * rows, cols))
            return _Recipe((key,), offset=half * rows)
        raise CheckpointError(f"{self.path}: missing tensor {keys[0]!r}")

    # -------------------------------------------------------------- TensorSource
    def model_config(self) -> ModelConfig:
        """The meshlm model this source fills."""
        return self.cfg

    def names(self) -> list[str]:
        """The meshlm names this source holds, in the model's order."""
        return list(self._recipes)

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self._shapes.get(name)

    def expert_biases(self) -> list[list[float]] | None:
        """DeepSeek-V3's ``e_score_correction_bias`` per block (rows ``cfg.n_blocks``, zeros
        for dense layers; :meth:`~meshlm.models.llama.Transformer.set_expert_biases`),
        None for other architectures or when the model does not balance by bias."""
        return self._biases

    def read(self, name: str, box: Box) -> torch.Tensor:
        """fp32 values of ``name`` inside ``box``; reads only that box from disk."""
        if name not in self._recipes:
            raise CheckpointError(f"{self.path}: no tensor for {name!r}")
        recipe, shape = self._recipes[name], self._shapes[name]
        b = _norm_box(box, shape, name)
        out_shape = _box_shape(b)
        if 0 in out_shape:
            return torch.empty(out_shape, dtype=torch.float32)
        if recipe.stacked:
            parts = [self._slice(recipe.keys[e], b[1:]) for e in range(b[0].start, b[0].stop,
                                                                      b[0].step)]
            t = torch.stack(parts)
        elif recipe.offset:
            s1 = b[1]
            b = (b[0], slice(s1.start + recipe.offset, s1.stop + recipe.offset, s1.step), *b[2:])
            t = self._slice(recipe.keys[0], b)
        elif recipe.rows is not None:
            t = self._rows(recipe.keys[0], torch.tensor(recipe.rows)[b[0]], b[1:])
        else:
            t = self._slice(recipe.keys[0], b)
        for key in recipe.copies:
            if not torch.equal(self._slice(key, b), t):
                raise CheckpointError(f"{self._file_of[key]}: {key!r} is not a copy of "
                                      f"{recipe.keys[0]!r} (meshlm shares the one tensor "
                                      "where the folder stores copies)")
        return t.to(torch.float32).contiguous()

    def _rows(self, key: str, rows: torch.Tensor, rest: tuple[slice, ...]) -> torch.Tensor:
        """Rows ``rows`` (any order) of HF tensor ``key`` over ``rest``: the covering range is
        read and the rows picked from it."""
        lo, hi = int(rows.min()), int(rows.max()) + 1
        return self._slice(key, (slice(lo, hi, 1), *rest))[rows - lo]

    def _slice(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        """``box`` of HF tensor ``key``, read through ``get_slice`` (nothing else is loaded);
        FP8 block-quantised weights come back dequantised (fp32)."""
        t = self._open(self._file_of[key]).get_slice(key)[box]
        scale_key = key + _SCALE_INV
        if self._fp8 is None or scale_key not in self._hf_shape or len(box) != 2:
            return t
        rows = torch.arange(box[0].start, box[0].stop, box[0].step) // self._fp8[0]
        cols = torch.arange(box[1].start, box[1].stop, box[1].step) // self._fp8[1]
        scale = self._open(self._file_of[scale_key]).get_slice(scale_key)[
            int(rows[0]):int(rows[-1]) + 1, int(cols[0]):int(cols[-1]) + 1].float()
        scale = scale[rows - rows[0]][:, cols - cols[0]]
        return t.float() * scale

    def close(self) -> None:
        """Drop the open safetensors files."""
        self._handles.clear()

    def __enter__(self) -> HFSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class _Entry:
    """One HF tensor to write: its key, the meshlm tensor it comes from (None: ``value``), which
    expert, the HF row of each of its rows (when stored in another order), or its value (a
    selection bias)."""

    key: str
    source: str | None
    expert: int | None
    shape: tuple[int, ...]
    rows: tuple[int, ...] | None = None
    value: tuple[float, ...] | None = None

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape)


def _write_safetensors(path: Path, entries: list[_Entry], tensor_of: Any) -> None:
    """A safetensors file of fp32 ``entries``, streamed: ``tensor_of(entry)`` one at a time.

    Layout (safetensors spec): 8-byte little-endian header length, a JSON header padded with
    spaces to a multiple of 8 bytes, then the tensors' bytes in header order.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.key] = {"dtype": "F32", "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for e in entries:
            _write_tensor(f, tensor_of(e), e)


def _write_tensor(f: BinaryIO, t: torch.Tensor, e: _Entry) -> None:
    if tuple(t.shape) != e.shape:
        raise CheckpointError(f"tensor {e.source!r}: got shape {tuple(t.shape)}, "
                              f"expected {e.shape}")
    f.write(t.numpy().astype("<f4", copy=False).data)  # no copy of a contiguous tensor


def _entries(cfg: ModelConfig, source: TensorSource,
             expert_biases: Sequence[Sequence[float]] | None) -> list[_Entry]:
    """The HF tensors of model ``cfg`` (checked against ``source``'s shapes)."""
    names = HFNames(cfg, hf_architecture(cfg))
    entries: list[_Entry] = []
    for name, shape in iter_meshlm_names(cfg):
        got = source.shape(name)
        if got is None:
            raise CheckpointError(f"the source has no tensor {name!r}")
        if tuple(got) != shape:
            raise CheckpointError(f"tensor {name!r}: the source has shape {tuple(got)}, "
                                  f"the model {shape}")
        if names.is_stacked_expert(name):
            entries += [_Entry(names.expert_key(name, e), name, e, shape[1:])
                        for e in range(shape[0])]
        else:
            entries.append(_Entry(names.key(name), name, None, shape, names.row_order(name)))
        entries += [_Entry(k, name, None, shape) for k in names.copies(name)]
    if names.arch == DEEPSEEK_V3 and cfg.is_moe:  # (every MoE layer has its bias buffer)
        rows = cfg.n_blocks
        if expert_biases is not None and (len(expert_biases) < rows or any(
                len(expert_biases[i]) != cfg.moe_experts for i in moe_layer_ids(cfg))):
            raise CheckpointError(f"expert_biases: expected {rows} rows of {cfg.moe_experts} "
                                  "(one per block, the blocks techniques add last)")
        for i in moe_layer_ids(cfg):
            value = (tuple(float(x) for x in expert_biases[i]) if expert_biases is not None
                     else (0.0,) * cfg.moe_experts)
            key = names.bias_key(i)
            assert key is not None
            entries.append(_Entry(key, None, None, (cfg.moe_experts,), value=value))
    return entries


def write_hf(out_dir: str | Path, cfg: ModelConfig, source: TensorSource,
             max_shard_bytes: int = 5 * 2**30,
             expert_biases: Sequence[Sequence[float]] | None = None) -> Path:
    """Write ``source``'s weights of model ``cfg`` as an HF folder at ``out_dir``; returns it.

    ``config.json`` is :func:`hf_config_from_model`; weights are fp32 under HF names, one
    ``model.safetensors`` or, above ``max_shard_bytes`` in all, ``model-0000k-of-0000n``
    shards plus ``model.safetensors.index.json``. ``expert_biases``: the MoE selection biases
    per layer (a checkpoint's ``moe_bias``), written as DeepSeek-V3's
    ``e_score_correction_bias`` (None: zeros). The folder is written beside ``out_dir`` and
    renamed when complete. Refuses (ValueError) a non-empty ``out_dir``.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not empty; refusing to overwrite it")
    hf_cfg = hf_config_from_model(cfg)
    entries = _entries(cfg, source, expert_biases)

    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                                          for k in range(n)]

    full: dict[str, torch.Tensor] = {}  # the one global tensor being written

    def tensor_of(e: _Entry) -> torch.Tensor:
        if e.value is not None:
            return torch.tensor(e.value, dtype=torch.float32)
        assert e.source is not None
        if e.source not in full:
            full.clear()
            shape = tuple(source.shape(e.source) or ())
            t = source.read(e.source, tuple(slice(0, k) for k in shape))
            full[e.source] = t.detach().to("cpu", torch.float32).contiguous()
        t = full[e.source]
        if e.rows is not None:  # (HF row rows[i] is meshlm row i)
            out = torch.empty_like(t)
            out[torch.tensor(e.rows)] = t
            return out
        return t if e.expert is None else t[e.expert]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2) + "\n")
        for file, shard in zip(files, shards, strict=True):
            _write_safetensors(tmp / file, shard, tensor_of)
        full.clear()
        if n > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                     "weight_map": {e.key: f for f, s in zip(files, shards, strict=True)
                                    for e in s}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
