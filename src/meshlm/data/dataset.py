"""Token files: a corpus split tokenized once into a flat array on disk, then memory-mapped.

Layout: ``<name>.bin`` holds the token ids of every document back to back, each document
followed by the end-of-text id, as raw ``uint16`` (vocab <= 65536) or ``uint32``.
``<name>.json`` is a sidecar recording dtype, n_tokens and the corpus fingerprint.

Disk: 2 (or 4) bytes per token. Memory while building: one batch of documents and its ids
(a few MB). The file is written under a temporary name and renamed into place, then the
sidecar likewise, so an interrupted build never leaves a file that looks complete. A file
whose size, dtype or fingerprint disagrees with its sidecar is rebuilt, never trusted.
Reading maps the file read-only: pages are loaded on demand and shared between processes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from .tokenizer import Tokenizer

# Documents are encoded in batches of about this many characters: large enough for the
# tokenizer's worker threads to stay busy, small enough to bound memory.
BATCH_CHARS = 4_000_000
# Longer documents are cut (at a newline) into pieces of about this size so that one huge
# file does not become one huge encode call; tokens near a cut may differ slightly.
MAX_PIECE_CHARS = 1_000_000


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _pieces(text: str) -> Iterator[str]:
    start = 0
    while len(text) - start > MAX_PIECE_CHARS:
        cut = text.rfind("\n", start, start + MAX_PIECE_CHARS) + 1
        if cut <= start:  # no newline in range: cut anywhere
            cut = start + MAX_PIECE_CHARS
        yield text[start:cut]
        start = cut
    yield text[start:]


def _batches(docs: Iterable[str]) -> Iterator[list[list[str]]]:
    """Group documents (each as its list of pieces) into batches of ~BATCH_CHARS."""
    batch: list[list[str]] = []
    chars = 0
    for doc in docs:
        batch.append(list(_pieces(doc)))
        chars += len(doc)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def open_tokens(path: Path, fingerprint: str) -> np.ndarray | None:
    """The cached token array at ``path``, or None if missing, stale or corrupt."""
    try:
        meta = json.loads(_sidecar(path).read_text())
        dtype = np.dtype(meta["dtype"])
        n_tokens = int(meta["n_tokens"])
        size = path.stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if meta.get("fingerprint") != fingerprint or size != n_tokens * dtype.itemsize:
        return None
    if n_tokens == 0:  # np.memmap cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,))


def write_tokens(
    path: Path, docs: Iterable[str], tokenizer: Tokenizer, fingerprint: str
) -> np.ndarray:
    """Tokenize ``docs`` into ``path`` (+ sidecar) atomically and return the mapped array."""
    dtype = token_dtype(tokenizer.vocab_size)
    eot = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    # The pid in the temp name lets several processes build the same cache concurrently:
    # each writes its own file and the identical results replace one another.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    n_tokens = 0
    _sidecar(path).unlink(missing_ok=True)  # the old sidecar must not vouch for a new .bin
    try:
        with open(tmp, "wb") as f:
            for batch in _batches(docs):
                encoded = iter(tokenizer.encode_batch([p for doc in batch for p in doc]))
                ids: list[int] = []
                for doc in batch:
                    for _ in doc:
                        ids.extend(next(encoded))
                    ids.extend(eot)
                f.write(np.asarray(ids, dtype=dtype).tobytes())
                n_tokens += len(ids)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {"dtype": dtype.name, "n_tokens": n_tokens, "fingerprint": fingerprint}
    side_tmp = _sidecar(tmp)
    side_tmp.write_text(json.dumps(meta))
    os.replace(side_tmp, _sidecar(path))  # last: a sidecar implies a complete .bin
    tokens = open_tokens(path, fingerprint)
    assert tokens is not None, f"token file {path} unreadable right after writing it"
    return tokens
