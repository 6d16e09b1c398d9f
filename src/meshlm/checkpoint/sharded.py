"""Sharded checkpoints: each rank writes what it owns; any layout reads the slices it needs.

Layout of ``checkpoints/step_NNNNNNN/``:

- ``rank_NNNNN.safetensors`` -- one per rank: the pieces of weights and AdamW moments this rank
  owns, each a box of a global tensor (the one-process model's name; a tied head stored once,
  as ``tok_embeddings.weight``), plus this rank's RNG states as tensors. The file's metadata
  lists its pieces (kind, name, key, box).
- islands (DiLoCo, ``parallel.islands`` > 1): each island's weights and moments under the kinds
  ``islandK/weight``, ``islandK/exp_avg``, ``islandK/exp_avg_sq``; ``weight`` holds the outer
  reference weights (the model every island last agreed on: what ``generate``, the Hugging
  Face export and a run without islands read) and ``outer_momentum`` DiLoCo's outer momentum.
- ``index.json`` -- every tensor's global shape and dtype, every file's byte size and pieces.
- ``trainer.json`` -- step, sampler position, AdamW step count, loss-scaler state, layout.
- ``config.toml`` (the resolved config) and ``tokenizer.json``.

Who writes what: every rank lists what its engine owns (:meth:`Engine.owned`: flat ranges of
local tensors, whole tensors without ZeRO); a range replicated on some axis is written by the
copy at coordinate 0 of that axis only, so each element of each tensor is written exactly once.
Ranges are cut into boxes of the global tensor (:func:`~meshlm.distributed.source.local_pieces`;
vocabulary padding left out). Nothing is gathered: no rank holds more than its own shards.

Why safetensors files with our own index rather than ``torch.distributed.checkpoint``: DCP
describes a shard as a box, but a ZeRO shard is a flat range (not a box) of a tp slice, and
DCP's default metadata file is pickled; here the index is JSON, every file is safetensors (no
code can run on load), each flat range becomes at most ``2 ndim - 1`` boxes, and a reader needs
nothing but ``safe_open(...).get_slice``: any layout, ``meshlm.load_model`` and the Hugging Face
export read the same files.

Atomic: the directory is written as ``step_NNNNNNN.tmp`` and renamed by rank 0 after a barrier
that every rank reaches only once its file is fsynced (rank 0 flushes the rest and the
directory before the rename, the parent after it); ``checkpoint.keep`` prunes old ones.

Asynchronous saves (``checkpoint.async``, :mod:`.async_save`) run the same steps -- the
contents of :func:`rank_contents`, :func:`write_contents`, :func:`complete_checkpoint` -- on
a background thread, from a host copy taken at the save.

Communication: three barriers per save, none per load. Memory: each rank's pieces are copied
once to CPU while its file is written (its shards, never more); a load reads only the boxes
the rank needs. Disk: 12 bytes per parameter (fp32 weights + two moments), once in total.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..distributed.boxes import Box, box_shape, from_json, intersect, shift, to_json, volume
from ..distributed.comm import Comm
from ..distributed.faults import kill_if_asked
from ..distributed.mesh import Mesh
from ..distributed.source import local_pieces, read_local
from ..distributed.spec import ShardSpec, first_copy
from ..parallel.engine import STATE_TENSORS, Engine
from .state import CheckpointError, checkpoints, prune, remove_partial, step_dir

FORMAT = "meshlm-sharded/1"
INDEX, TRAINER = "index.json", "trainer.json"
REQUIRED = (INDEX, TRAINER, "config.toml")
KINDS = ("weight", *STATE_TENSORS)
OUTER_MOMENTUM = "outer_momentum"
_ISLAND_KIND = re.compile(rf"^island\d+/({'|'.join(KINDS)})$")


def known_kind(kind: str) -> bool:
    return kind in KINDS or kind == OUTER_MOMENTUM or _ISLAND_KIND.match(kind) is not None


def island_prefix(mesh: Mesh) -> str:
    """Kind prefix of this rank's island ("" without islands)."""
    return f"island{mesh.island}/" if mesh.islands > 1 else ""
_META_KEY = "meshlm"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def writes(spec: ShardSpec, mesh: Mesh) -> bool:
    """Whether this rank's copy of a range is the one written (coordinate 0 of every axis
    holding copies of it; the tied embedding's copy on the first pipeline stage)."""
    return first_copy(spec, mesh)


# ------------------------------------------------------------------ RNG states as tensors
def rng_tensors() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's torch / CUDA / numpy / python RNG states: tensors + JSON scalars."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss_next = random.getstate()
    tensors = {"rng/torch": torch.get_rng_state(),
               "rng/numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
               "rng/python": torch.tensor(state, dtype=torch.int64)}
    if torch.cuda.is_available():  # GPU only
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    scalars = {"numpy": [kind, int(pos), int(has_gauss), float(cached)],
               "python": [version, gauss_next]}
    return tensors, scalars


def is_rng_key(key: str) -> bool:
    """Whether a rank file's tensor is an RNG state (kept in its own dtype, not a piece)."""
    return key.startswith("rng/")


def restore_rng(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["rng/torch"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    kind, pos, has_gauss, cached = scalars["numpy"]
    np.random.set_state((kind, tensors["rng/numpy"].numpy().astype(np.uint32), pos, has_gauss,
                         cached))
    version, gauss_next = scalars["python"]
    random.setstate((version, tuple(int(x) for x in tensors["rng/python"].tolist()),
                     gauss_next))


# ------------------------------------------------------------------ writing
@dataclass
class RankContents:
    """What one rank writes: its pieces (views of its weights and moments, where they live,
    and its RNG states on CPU) by key, and the file's metadata (pieces, shapes, RNG scalars)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


def rank_contents(engine: Engine, mesh: Mesh,
                  outer: dict[int, dict[str, torch.Tensor]] | None = None) -> RankContents:
    """This rank's owned pieces (weights + moments) and RNG states, not copied.

    ``outer`` (islands): owned index -> DiLoCo's reference weights and outer momentum of that
    range, written by island 0 (the island's own weights then go under ``islandK/``)."""
    tensors, rng_scalars = rng_tensors()
    pieces: list[dict[str, Any]] = []
    shapes: dict[str, list[int]] = {}
    prefix = island_prefix(mesh)
    for i, o in enumerate(engine.owned()):
        if not writes(o.spec, mesh):
            continue
        shapes[o.spec.name] = list(o.spec.global_shape)
        flats = {prefix + k: v for k, v in {"weight": o.weight,
                                             **(engine.moments(o) or {})}.items()}
        if outer is not None and mesh.island == 0:
            flats.update(outer[i])
        for j, piece in enumerate(local_pieces(o.spec, o.lo, o.hi)):
            for kind, flat in flats.items():
                key = f"{kind}/{o.spec.name}/{o.lo}/{j}"
                tensors[key] = piece.of(flat, o.lo).detach()
                pieces.append({"kind": kind, "name": o.spec.name, "key": key,
                               "box": to_json(piece.box)})
    return RankContents(tensors, {"pieces": pieces, "shapes": shapes, "rng": rng_scalars})


def write_contents(directory: Path, rank: int, contents: RankContents) -> Path:
    """``rank_NNNNN.safetensors`` from CPU float32 contiguous tensors, flushed to disk."""
    path = directory / rank_file(rank)
    save_file(contents.tensors, str(path), metadata={_META_KEY: json.dumps(contents.meta)})
    _fsync(path)
    return path


def write_rank_file(directory: Path, rank: int, engine: Engine, mesh: Mesh,
                    outer: dict[int, dict[str, torch.Tensor]] | None = None) -> Path:
    """This rank's owned pieces (weights + moments) and RNG states -> ``rank_NNNNN.safetensors``
    (each piece copied to CPU float32 as it is written; see :func:`rank_contents`)."""
    contents = rank_contents(engine, mesh, outer)
    contents.tensors = {k: t if is_rng_key(k) else t.to("cpu", torch.float32).contiguous()
                        for k, t in contents.tensors.items()}
    return write_contents(directory, rank, contents)


def _fsync(path: Path) -> None:
    """Flush a file or directory to disk (a rename is durable only after its contents are)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_meta(path: Path) -> dict[str, Any]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {})[_META_KEY])
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def write_index(directory: Path, world_size: int, step: int, layout: str) -> dict[str, Any]:
    """``index.json`` from every rank file's metadata (run on one rank after all wrote)."""
    tensors: dict[str, dict[str, Any]] = {}
    files: dict[str, dict[str, Any]] = {}
    for rank in range(world_size):
        path = directory / rank_file(rank)
        meta = _file_meta(path)
        for name, shape in meta["shapes"].items():
            tensors.setdefault(name, {"shape": shape, "dtype": "float32"})
        files[path.name] = {"bytes": path.stat().st_size, "pieces": meta["pieces"]}
    index = {"format": FORMAT, "step": step, "world_size": world_size, "layout": layout,
             "tensors": dict(sorted(tensors.items())), "files": files}
    (directory / INDEX).write_text(json.dumps(index))
    return index


def begin_checkpoint(root: Path, step: int, rank: int) -> Path:
    """The ``.tmp`` folder checkpoint ``step`` is written into; rank 0 removes what an
    interrupted save left and makes it (the others wait for it at a barrier)."""
    tmp = step_dir(root, step).with_name(step_dir(root, step).name + ".tmp")
    if rank == 0:
        remove_partial(root)
        tmp.mkdir(parents=True)
    return tmp


def complete_checkpoint(root: Path, step: int, world_size: int, layout: str,
                        trainer_state: dict[str, Any], extra_files: dict[str, Path | str],
                        keep: int = 0) -> Path:
    """Rank 0, once every rank's file is on disk: the index, ``trainer.json`` (``trainer_state``
    holds the step and AdamW step count) and the extra files, flushed; then the rename that
    makes the checkpoint complete, and ``keep``'s pruning of older ones."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    write_index(tmp, world_size, step, layout)
    (tmp / TRAINER).write_text(json.dumps(trainer_state, indent=1))
    for name, src in extra_files.items():
        if isinstance(src, Path):
            shutil.copyfile(src, tmp / name)
        else:
            (tmp / name).write_text(src)
    for f in tmp.iterdir():
        if not f.name.startswith("rank_"):  # (rank files were flushed by their writers)
            _fsync(f)
    _fsync(tmp)
    if final.exists():  # (re-saving a step: the old copy goes only now)
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync(root)
    prune(root, keep)
    return final


def save_checkpoint(root: Path, step: int, engine: Engine, comm: Comm,
                    trainer_state: dict[str, Any], extra_files: dict[str, Path | str],
                    keep: int = 0, outer: dict[int, dict[str, torch.Tensor]] | None = None
                    ) -> Path:
    """Write checkpoint ``step`` under ``root`` collectively (see module docstring)."""
    mesh = comm.mesh
    tmp = begin_checkpoint(root, step, mesh.rank)
    comm.barrier()
    write_rank_file(tmp, mesh.rank, engine, mesh, outer)
    kill_if_asked("MESHLM_FAULT_KILL_IN_SAVE", step, mesh.rank, mesh.world_size)  # (tests)
    comm.barrier()  # every rank's file is on disk
    if mesh.rank == 0:
        complete_checkpoint(root, step, mesh.world_size, mesh.describe(),
                            {**trainer_state, "step": step, "adam_step": engine.adam_step()},
                            extra_files, keep)
    comm.barrier()
    return step_dir(root, step)


# ------------------------------------------------------------------ reading
@dataclass(frozen=True)
class _Stored:
    file: str
    key: str
    box: Box


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


class ShardedCheckpoint:
    """A validated checkpoint directory, read piece by piece (``with`` closes its files)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.index = validate(self.directory)
        self.trainer = _read_json(self.directory / TRAINER)
        self.shapes = {n: tuple(t["shape"]) for n, t in self.index["tensors"].items()}
        self.stored: dict[tuple[str, str], list[_Stored]] = {}
        for fname, f in self.index["files"].items():
            for p in f["pieces"]:
                self.stored.setdefault((p["kind"], p["name"]), []).append(
                    _Stored(fname, p["key"], from_json(p["box"])))
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.shapes.get(name)

    @property
    def has_moments(self) -> bool:
        return any(self.holds(k) for k in STATE_TENSORS)

    def holds(self, kind: str) -> bool:
        """Whether the checkpoint stores ``kind`` (``weight``, ``exp_avg``, ``island1/weight``...)."""
        return any(k == kind for k, _ in self.stored)

    def _file(self, fname: str) -> Any:
        if fname not in self._handles:
            path = self.directory / fname
            try:
                self._handles[fname] = self._stack.enter_context(
                    safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read {path}: {e}") from None
        return self._handles[fname]

    def read(self, kind: str, name: str, box: Box) -> torch.Tensor:
        """Values of ``kind`` (weight, exp_avg, exp_avg_sq) of tensor ``name`` inside ``box``."""
        out = torch.zeros(box_shape(box), dtype=torch.float32)
        covered = 0
        origin = tuple(-s.start for s in box)
        for st in self.stored.get((kind, name), []):
            inter = intersect(st.box, box)
            if inter is None:
                continue
            rel = shift(inter, tuple(-s.start for s in st.box))
            try:
                data = self._file(st.file).get_slice(st.key)[rel]
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read {st.key} from "
                                      f"{self.directory / st.file}: {e}") from None
            out[shift(inter, origin)] = data
            covered += volume(inter)
        if covered != volume(box):
            raise CheckpointError(f"checkpoint {self.directory}: {kind} of {name} is not fully "
                                  "stored (a missing or edited piece)")
        return out

    def source(self, kind: str = "weight") -> KindSource:
        return KindSource(self, kind)

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """Rank ``rank``'s saved RNG states (None when the checkpoint had fewer ranks)."""
        fname = rank_file(rank)
        if fname not in self.index["files"]:
            return None
        f = self._file(fname)
        tensors = {k: f.get_tensor(k) for k in f.keys() if is_rng_key(k)}
        return tensors, _file_meta(self.directory / fname)["rng"]


class KindSource:
    """One kind of a checkpoint (weights or a moment) as a :class:`TensorSource`."""

    def __init__(self, ckpt: ShardedCheckpoint, kind: str) -> None:
        self.ckpt, self.kind = ckpt, kind

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.ckpt.shapes.get(name)

    def read(self, name: str, box: Box) -> torch.Tensor:
        return self.ckpt.read(self.kind, name, box)


def validate(directory: Path) -> dict[str, Any]:
    """The index of a complete, undamaged checkpoint; CheckpointError naming the first problem.

    Checks: required files present, index readable and of this format, every rank file present
    with its recorded size (truncation) and a readable header listing its pieces, and every
    tensor's stored pieces covering it exactly once.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist")
    for name in REQUIRED:
        if not (directory / name).is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete: missing {name}")
    trainer = _read_json(directory / TRAINER)
    # (a weights-only checkpoint, e.g. one written for model.init_from, has no sampler state;
    # resuming from it is refused by the trainer)
    sampler = trainer.get("sampler", {}) if isinstance(trainer, dict) else None
    counts = [trainer.get("step") if isinstance(trainer, dict) else None,
              *(sampler.get(k) for k in ("next_step", "seed", "seq_len", "global_batch")
                if isinstance(sampler, dict) and sampler)]
    if not isinstance(sampler, dict) or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise CheckpointError(f"{directory / TRAINER}: malformed (step or sampler state "
                              "missing or edited)")
    index = _read_json(directory / INDEX)
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{directory / INDEX}: not a {FORMAT} index")
    try:
        shapes = {n: tuple(t["shape"]) for n, t in index["tensors"].items()}
        files = index["files"]
        covered: dict[tuple[str, str], int] = {}
        for fname, f in files.items():
            path = directory / fname
            if not path.is_file():
                raise CheckpointError(f"checkpoint {directory}: missing shard {fname}")
            size = path.stat().st_size
            if size != f["bytes"]:
                raise CheckpointError(f"{path}: {size} bytes, the index records {f['bytes']} "
                                      "(truncated or replaced)")
            meta = _file_meta(path)
            if meta["pieces"] != f["pieces"]:
                raise CheckpointError(f"{path}: its pieces differ from {INDEX} (index edited)")
            for p in f["pieces"]:
                if p["name"] not in shapes or not known_kind(p["kind"]):
                    raise CheckpointError(f"{directory / INDEX}: unknown tensor {p['name']!r}")
                box = from_json(p["box"])
                full = tuple(slice(0, n) for n in shapes[p["name"]])
                if intersect(box, full) != box:
                    raise CheckpointError(f"{directory / INDEX}: piece {p['key']} lies outside "
                                          f"{p['name']} {list(shapes[p['name']])}")
                covered[(p["kind"], p["name"])] = covered.get((p["kind"], p["name"]), 0) + volume(box)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{directory / INDEX}: malformed ({type(e).__name__}: {e})") from None
    kinds = {k for k, _ in covered}
    for kind in kinds:
        for name, shape in shapes.items():
            if covered.get((kind, name), 0) != math.prod(shape):
                raise CheckpointError(f"checkpoint {directory}: {kind} of {name} is not fully "
                                      "stored (a missing or edited shard)")
    return index


def latest_valid(root: Path, log: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint under ``root`` that passes validation; each damaged one skipped
    is reported in one line (``log``)."""
    found = checkpoints(root)
    for i, path in enumerate(reversed(found)):
        try:
            validate(path)
        except CheckpointError as e:
            older = found[-2 - i].name if i + 1 < len(found) else None
            log(f"{e}; " + (f"falling back to {older}" if older else "no older checkpoint"))
            continue
        return path
    return None


def check_model(ckpt: ShardedCheckpoint, expected: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint holds exactly the model's tensors with its shapes; one line otherwise."""
    for name, shape in expected.items():
        got = ckpt.shapes.get(name)
        if got is None:
            raise CheckpointError(f"checkpoint {ckpt.directory} has no tensor {name} "
                                  "(a checkpoint of another model?)")
        if got != tuple(shape):
            raise CheckpointError(f"checkpoint {ckpt.directory}: {name} has shape {list(got)}, "
                                  f"the model expects {list(shape)}")
    extra = sorted(set(ckpt.shapes) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint {ckpt.directory} holds {extra[0]}, which the model "
                              "does not have (a checkpoint of another model?)")


def load_into(ckpt: ShardedCheckpoint, engine: Engine, device: torch.device,
              log: Callable[[str], None] | None = None, prefix: str = "") -> bool:
    """Fill this rank's weights and (when stored) AdamW moments from ``ckpt``: each rank reads
    only the boxes of the ranges it holds. ``prefix`` (``islandK/``): an island's own weights
    and moments when the checkpoint holds them, else the common ones. Returns whether the
    optimizer state was found (a checkpoint of another optimizer, or of islands resumed
    without them, has none for this run: it starts fresh)."""
    if prefix and not ckpt.holds(prefix + "weight"):
        prefix = ""
    weights = ckpt.source(prefix + "weight")
    for spec, lo, hi, view in engine.held():
        view.copy_(read_local(weights, spec, lo, hi, device))
    kinds = engine.state_kinds()  # (a checkpoint of another optimizer: its state is not ours)
    if not all(ckpt.holds(prefix + k) for k in kinds):
        return False
    step = int(ckpt.trainer.get("adam_step", ckpt.trainer["step"]))
    sources = {k: ckpt.source(prefix + k) for k in kinds}
    for o in engine.owned():
        engine.set_moments(o, step, {k: read_local(s, o.spec, o.lo, o.hi, device)
                                     for k, s in sources.items()})
    return True
