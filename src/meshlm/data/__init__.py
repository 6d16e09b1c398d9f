"""Data pipeline: prepared (sharded, tokenized) datasets, and the step sampler.

:func:`build_data` gives training its tokens from one of three places:

- ``data.mix`` ("DIR_A:0.7,DIR_B:0.3"): prepared folders (``meshlm prepare``), opened and
  checked to share one tokenizer;
- ``data.path`` naming a prepared folder (it has a manifest.json): opened directly;
- otherwise a raw corpus (``data.path`` = text / JSONL / Parquet files or folders, a
  ``datasets`` folder; "" = this interpreter's standard library), prepared by the same code
  as ``meshlm prepare`` into ``<cache root>/<fingerprint>/``, where the fingerprint covers the
  file list (paths, sizes, mtimes), the settings and the tokenizer, then opened. A second
  call finds the manifest there and only re-reads the file list and verifies the shards'
  sizes.

Disk: 2 (uint16) or 4 bytes per token. Memory: shards are memory-mapped, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError, DataSection, parse_mix
from .prepare import (
    NoDocuments,
    Settings,
    inputs_digest,
    make_plan,
    resolve_inputs,
    summary,
    tokenizer_spec,
)
from .prepare import prepare as prepare_dataset
from .sampler import StepSampler, val_batches
from .shards import PreparedDataset, TokenStream, is_prepared, open_prepared, tokenizer_fingerprint
from .sources import Source
from .tokenizer import EOT, Tokenizer, train_bpe

__all__ = [
    "EOT", "DataBundle", "PreparedDataset", "StepSampler", "TokenStream", "Tokenizer",
    "build_data", "default_cache_root", "open_prepared", "prepare_dataset", "train_bpe", "val_batches",
]

Log = Callable[[str], None]
# Worker processes used to prepare a raw corpus for training; below PARALLEL_BYTES of input
# (the default corpus: 12 MB) one process is quicker than starting workers.
TRAIN_PREPARE_WORKERS = 4
PARALLEL_BYTES = 64 * 2**20


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train_tokens: TokenStream  # of the first (or only) source; indexable like a numpy array
    val_tokens: TokenStream
    source: str  # where the text came from, for logs
    cache_dir: Path  # the dataset folder of the first source (tokenizer.json, shards)
    # (name, weight, dataset) of every source: one entry of weight 1.0 without data.mix
    sources: list[tuple[str, float, PreparedDataset]] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def default_cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "meshlm"


def cache_root(cfg: DataSection) -> Path:
    """The cache folder of ``data.cache_dir`` (default: :func:`default_cache_root`)."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_root()


def _where(cfg: DataSection) -> str:
    return f"data.path={cfg.path!r}" if cfg.path else "the default corpus"


def _cache_folder(cfg: DataSection, sources: list[Source]) -> Path:
    """``<cache root>/<fingerprint of the file list, settings and tokenizer>``."""
    settings = Settings(cfg.text_field, cfg.val_fraction)
    plan = make_plan(sources, settings, tokenizer_spec(cfg.tokenizer or None, cfg.vocab_size))
    key = hashlib.sha256(json.dumps([inputs_digest(plan), plan["tokenizer"]]).encode())
    folder = cache_root(cfg) / key.hexdigest()[:16]  # 64 bits: ample, and short to read
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"data.cache_dir: cannot create {str(folder.parent)!r}: "
                          f"{e.strerror}") from None
    return folder


def _prepare_cached(cfg: DataSection, log: Log) -> PreparedDataset:
    """Prepare the raw corpus of ``data.path`` into the cache (once) and open it."""
    inputs = [cfg.path] if cfg.path else []
    sources = resolve_inputs(inputs)
    folder = _cache_folder(cfg, sources)
    n_files, n_bytes = sum(len(s.files) for s in sources), sum(s.n_bytes for s in sources)
    log(f"data: {_where(cfg)}: {n_files} files, {n_bytes / 1e6:.1f} MB")
    workers = min(TRAIN_PREPARE_WORKERS, os.cpu_count() or 1) if n_bytes >= PARALLEL_BYTES else 1

    def attempt() -> PreparedDataset:
        try:
            result = prepare_dataset(
                inputs, folder, tokenizer=cfg.tokenizer or None, vocab_size=cfg.vocab_size,
                workers=workers, text_field=cfg.text_field, val_fraction=cfg.val_fraction,
                log=log, sources=sources, owned=True)
        except NoDocuments:
            raise ConfigError(f"{_where(cfg)} gives a train split of 0 tokens: it holds no "
                              f"documents ({n_files} files)") from None
        log(f"data: {summary(result, folder)}")
        return open_prepared(folder)

    had = is_prepared(folder)
    try:
        return attempt()
    except ConfigError as e:
        if not had:  # a mistake in the inputs: preparing again would not help
            raise
        # The cache is ours and keyed by its inputs: a damaged one is rebuilt, not trusted.
        log(f"data: cached dataset {folder} is damaged ({e}); rebuilding")
        shutil.rmtree(folder, ignore_errors=True)
        return attempt()


def _check_tokenizers(sources: list[tuple[str, float, PreparedDataset]], cfg: DataSection
                      ) -> None:
    """One tokenizer for every source, and it is data.tokenizer's when that is set."""
    name0, _, first = sources[0]
    for name, _, ds in sources[1:]:
        if ds.tokenizer_sha256 != first.tokenizer_sha256:
            raise ConfigError(
                f"data.mix: {name0!r} and {name!r} were prepared with different tokenizers "
                f"(fingerprints {first.tokenizer_sha256[:12]} vs {ds.tokenizer_sha256[:12]}); "
                "prepare both with the same --tokenizer")
    if cfg.tokenizer:
        want = tokenizer_fingerprint(cfg.tokenizer)
        for name, _, ds in sources:
            if ds.tokenizer_sha256 != want:
                raise ConfigError(
                    f"dataset {name} was prepared with another tokenizer than data.tokenizer="
                    f"{cfg.tokenizer}: fingerprints {ds.tokenizer_sha256[:12]} vs {want[:12]}")


def _check_size(tokens: TokenStream, name: str, cfg: DataSection, where: str,
                n_files: int | None) -> None:
    need = cfg.seq_len + 2  # one window of seq_len + 1 tokens, and two possible offsets
    if len(tokens) < need:
        files = f"{n_files} files; " if n_files is not None else ""
        raise ConfigError(
            f"{where} gives a {name} split of {len(tokens)} tokens but data.seq_len="
            f"{cfg.seq_len} needs at least {need} ({files}use more data, "
            "a smaller data.seq_len or a different data.val_fraction)"
        )


def _open_sources(cfg: DataSection, log: Log) -> list[tuple[str, float, PreparedDataset]]:
    if cfg.mix:
        return [(folder, w, open_prepared(folder)) for folder, w in parse_mix(cfg.mix)]
    if cfg.path and is_prepared(cfg.path):
        return [(cfg.path, 1.0, open_prepared(cfg.path))]
    return [(cfg.path or "the default corpus", 1.0, _prepare_cached(cfg, log))]


def build_data(cfg: DataSection, log: Log = print) -> DataBundle:
    """Open (preparing a raw corpus first, cached) the token streams and the tokenizer."""
    t0 = time.perf_counter()
    sources = _open_sources(cfg, log)
    _check_tokenizers(sources, cfg)
    for name, weight, ds in sources:
        where = _where(cfg) if not cfg.mix else f"data.mix entry {name!r}"
        n_files = sum(s["files"] for s in ds.manifest["sources"])
        _check_size(ds.train, "train", cfg, where, n_files)
        _check_size(ds.val, "validation", cfg, where, n_files)
        log(f"data: {name} (weight {weight:.3g}): train {len(ds.train):,} "
            f"tokens, val {len(ds.val):,} ({ds.train.dtype}) in {ds.path}")
    first = sources[0][2]
    tok = Tokenizer.load(first.tokenizer_path)
    log(f"data: ready in {time.perf_counter() - t0:.1f}s (tokenizer vocab {tok.vocab_size}, "
        f"eot id {tok.eot_id})")
    source = f"mix {cfg.mix}" if cfg.mix else sources[0][0]
    return DataBundle(tok, first.train, first.val, source, first.path, sources)

