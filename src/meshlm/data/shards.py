"""Read side of a prepared dataset (``meshlm prepare``): verified, memory-mapped token streams.

:func:`open_prepared` checks the folder (manifest, every shard's size, content hashes) and
returns a :class:`PreparedDataset` whose ``train`` / ``val`` are :class:`TokenStream` objects:
the shards of a split seen as one array, indexed like numpy (``stream[idx]`` for an integer
index array of any shape) by looking each position up in the cumulative shard sizes.

Verification: sizes against the manifest on every open; sha256 of a shard (and of its
document index) the first time its (size, mtime_ns) is seen, remembered in ``.verified.json``
(rewritten atomically; several processes may open the dataset at once, and at worst one of
them hashes again). A second open of an unchanged dataset only stats the files.

Memory: shards are mapped read-only on first use (pages shared between processes and loaded
on demand); a lookup reads only the requested tokens. ``doc_starts`` loads the split's
document indexes (8 bytes per document) on first use.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError
from .prepare import FORMAT, FORMAT_VERSION, read_json, sha256_file, write_json

STAMP = ".verified.json"


class TokenStream:
    """The token ids of one split across its shards, indexable like a 1-D numpy array."""

    def __init__(self, folder: Path, shards: list[dict[str, Any]], dtype: np.dtype) -> None:
        self.folder = folder
        self.shards = shards
        self.dtype = np.dtype(dtype)
        sizes = np.array([s["tokens"] for s in shards], dtype=np.int64)
        self.ends = np.cumsum(sizes)  # exclusive end of every shard in the stream
        self.starts = self.ends - sizes
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __repr__(self) -> str:
        return f"TokenStream({len(self):,} {self.dtype} tokens in {len(self.shards)} shards)"

    def _map(self, i: int) -> np.memmap:
        if i not in self._maps:
            self._maps[i] = np.memmap(self.folder / self.shards[i]["name"], dtype=self.dtype,
                                      mode="r", shape=(self.shards[i]["tokens"],))
        return self._maps[i]

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, (int, np.integer)):
            return self[np.array([idx], dtype=np.int64)][0]
        if isinstance(idx, slice):
            return self[np.arange(*idx.indices(len(self)), dtype=np.int64)]
        index = np.asarray(idx)
        if index.dtype.kind not in "iu":
            raise TypeError(f"TokenStream indices must be integers, not {index.dtype}")
        flat = index.reshape(-1).astype(np.int64, copy=False)
        n = len(self)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            bad = flat[(flat < 0) | (flat >= n)][0]
            raise IndexError(f"index {bad} is out of bounds for a stream of {n} tokens")
        out = np.empty(flat.shape, dtype=self.dtype)
        which = np.searchsorted(self.ends, flat, side="right")
        for i in np.unique(which):
            sel = which == i
            out[sel] = self._map(int(i))[flat[sel] - self.starts[i]]
        return out.reshape(index.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Every token, read into memory (small splits and tests)."""
        whole = self[np.arange(len(self), dtype=np.int64)]
        return whole if dtype is None else whole.astype(dtype)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()

    @cached_property
    def doc_starts(self) -> np.ndarray:
        """int64 start offset of every document in the stream, ascending, first 0."""
        parts = [np.load(self.folder / s["index"]) + start
                 for s, start in zip(self.shards, self.starts, strict=True)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass
class PreparedDataset:
    path: Path
    manifest: dict[str, Any]
    train: TokenStream
    val: TokenStream

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest["tokenizer"]["file"]

    @property
    def tokenizer_sha256(self) -> str:
        return self.manifest["tokenizer"]["sha256"]

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eot_id(self) -> int | None:
        return self.manifest["tokenizer"]["eot_id"]


# ------------------------------------------------------------------ checks
def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a dataset folder of meshlm prepare (finished or not)."""
    p = Path(path).expanduser()
    return p.is_dir() and ((p / "manifest.json").is_file() or (p / "plan.json").is_file())


def _load_manifest(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise ConfigError(f"prepared dataset {str(folder)!r} {what}")
    path = folder / "manifest.json"
    if not path.is_file():
        if (folder / "plan.json").is_file():
            raise ConfigError(f"{folder} is an unfinished meshlm prepare (no manifest.json); "
                              "rerun the same meshlm prepare command to finish it")
        raise ConfigError(f"{folder} is not a prepared dataset (no manifest.json; make one "
                          "with meshlm prepare)")
    manifest = read_json(path, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a meshlm dataset manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{path} has format version {manifest.get('format_version')}; this "
                          f"meshlm reads version {FORMAT_VERSION} (prepare it again)")
    try:
        for split in ("train", "val"):
            for s in manifest["splits"][split]["shards"]:
                _ = (s["name"], s["index"], s["tokens"], s["bytes"], s["sha256"])
        _ = (manifest["tokenizer"]["sha256"], manifest["tokenizer"]["vocab_size"],
             manifest["dtype"])
    except (KeyError, TypeError):
        raise ConfigError(f"{path} is corrupt (fields missing)") from None
    return manifest


def _files(manifest: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(relative name, size, sha256) of every shard and document index."""
    out = []
    for split in ("train", "val"):
        for s in manifest["splits"][split]["shards"]:
            out.append((s["name"], s["bytes"], s["sha256"]))
            out.append((s["index"], s["index_bytes"], s["index_sha256"]))
    return out


def _check_sizes(folder: Path, files: list[tuple[str, int, str]]) -> dict[str, os.stat_result]:
    stats = {}
    for name, size, _ in files:
        try:
            st = (folder / name).stat()
        except OSError:
            raise ConfigError(f"{folder}: shard {name} is missing (prepare the dataset "
                              "again)") from None
        if st.st_size != size:
            raise ConfigError(f"{folder}: shard {name} is truncated or altered: expected "
                              f"{size} bytes, found {st.st_size}")
        stats[name] = st
    return stats


def _read_stamp(folder: Path) -> dict[str, Any]:
    try:
        stamp = json.loads((folder / STAMP).read_text())
        return stamp if isinstance(stamp, dict) else {}
    except (OSError, ValueError):
        return {}


def _verify(folder: Path, manifest: dict[str, Any]) -> None:
    """Sizes always; hashes of files whose (size, mtime_ns) was not verified before."""
    files = _files(manifest)
    stats = _check_sizes(folder, files)
    stamp = _read_stamp(folder)
    fresh = {}
    for name, size, digest in files:
        key = [size, stats[name].st_mtime_ns, digest]
        if stamp.get(name) == key:
            fresh[name] = key
            continue
        actual = sha256_file(folder / name)
        if actual != digest:
            raise ConfigError(f"{folder}: shard {name} was altered: sha256 {actual[:16]}... "
                              f"but the manifest says {digest[:16]}... (prepare it again)")
        fresh[name] = key
    if fresh != stamp:
        try:
            write_json(folder / STAMP, fresh)
        except OSError:  # a read-only dataset: verify again next time
            pass


def _verify_tokenizer(path: Path, manifest: dict[str, Any]) -> None:
    """The tokenizer file is small: its hash is checked on every open."""
    tok = path / manifest["tokenizer"]["file"]
    try:
        actual = sha256_file(tok)
    except OSError:
        raise ConfigError(f"{path}: {manifest['tokenizer']['file']} is missing") from None
    if actual != manifest["tokenizer"]["sha256"]:
        raise ConfigError(f"{path}: {manifest['tokenizer']['file']} was altered: sha256 "
                          f"{actual[:16]}... but the manifest says "
                          f"{manifest['tokenizer']['sha256'][:16]}...")


def open_prepared(folder: str | Path) -> PreparedDataset:
    """The dataset in ``folder``, checked; ConfigError (one line) for anything wrong."""
    path = Path(folder).expanduser()
    manifest = _load_manifest(path)
    _verify(path, manifest)
    _verify_tokenizer(path, manifest)
    dtype = np.dtype(manifest["dtype"])
    streams = {split: TokenStream(path, manifest["splits"][split]["shards"], dtype)
               for split in ("train", "val")}
    return PreparedDataset(path, manifest, streams["train"], streams["val"])


def tokenizer_fingerprint(path: str | Path) -> str:
    """sha256 of a tokenizer.json's bytes, as recorded in a manifest."""
    p = Path(path).expanduser()
    try:
        return sha256_file(p)
    except OSError as e:
        raise ConfigError(f"data.tokenizer={str(path)!r} cannot be read: {e.strerror}") from None


__all__ = ["PreparedDataset", "TokenStream", "is_prepared", "open_prepared",
           "tokenizer_fingerprint"]
