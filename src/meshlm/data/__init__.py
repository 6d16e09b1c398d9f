"""Data pipeline: corpus -> tokenizer -> cached token memmaps, plus the step sampler.

:func:`build_data` resolves the corpus (the Python standard library by default), splits it by
file, loads or trains the tokenizer (trained on the train split only) and tokenizes both
splits into memory-mapped token files. Everything is cached under
``<cache root>/<fingerprint>/`` (tokenizer.json, train.bin/.json, val.bin/.json), where the
fingerprint covers the file list (paths, sizes, mtimes) and every setting that changes the
tokens, so a second call only re-reads the file list. Disk: ~2 bytes per token; memory: the
token arrays are mapped, not loaded.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError, DataSection
from .corpus import Corpus, DocStream, fingerprint, resolve_corpus, split_corpus
from .dataset import open_tokens, token_dtype, write_tokens
from .sampler import StepSampler, val_batches
from .tokenizer import EOT, Tokenizer, train_bpe

__all__ = [
    "EOT", "DataBundle", "StepSampler", "Tokenizer", "build_data", "default_cache_root",
    "train_bpe", "val_batches",
]


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train_tokens: np.ndarray  # read-only memmap, uint16 or uint32
    val_tokens: np.ndarray
    source: str  # where the text came from, for logs
    cache_dir: Path  # the fingerprint folder holding tokenizer.json and the token files

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def default_cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "meshlm"


def cache_root(cfg: DataSection) -> Path:
    """The cache folder of ``data.cache_dir`` (default: :func:`default_cache_root`)."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_root()


def _cache_dir(cfg: DataSection, fp: str) -> Path:
    path = cache_root(cfg) / fp[:16]  # 64 bits of the digest: ample to keep corpora apart, short to read
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"data.cache_dir: cannot create {str(path)!r}: {e.strerror}") from None
    return path


def _tokenizer_key(cfg: DataSection) -> str:
    """What identifies the tokenizer in the fingerprint."""
    if not cfg.tokenizer:
        return f"bpe:{cfg.vocab_size}"
    p = Path(cfg.tokenizer).expanduser()
    try:
        st = p.stat()
    except OSError:
        raise ConfigError(f"data.tokenizer={cfg.tokenizer!r} cannot be read") from None
    return f"file:{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _get_tokenizer(
    cfg: DataSection, train: DocStream, cache: Path, log: Callable[[str], None]
) -> Tokenizer:
    if cfg.tokenizer:
        tok = Tokenizer.load(cfg.tokenizer)
        log(f"data: tokenizer {cfg.tokenizer} (vocab {tok.vocab_size}, eot id {tok.eot_id})")
        if tok.eot_id is None:
            log("data: warning: tokenizer has no end-of-text token; documents are joined "
                "without a separator")
        return tok
    path = cache / "tokenizer.json"
    if path.is_file():
        try:
            tok = Tokenizer.load(path)
            log(f"data: tokenizer cached (vocab {tok.vocab_size}) {path}")
            return tok
        except ConfigError:
            log(f"data: cached tokenizer {path} is unreadable; retraining")
    t0 = time.perf_counter()
    tok = train_bpe(train, cfg.vocab_size)
    tok.save(path)
    log(f"data: trained byte-level BPE (vocab {tok.vocab_size}) on the train split in "
        f"{time.perf_counter() - t0:.1f}s -> {path}")
    return tok


def _get_tokens(
    name: str, docs: DocStream, tok: Tokenizer, cache: Path, fp: str,
    log: Callable[[str], None],
) -> np.ndarray:
    path = cache / f"{name}.bin"
    tokens = open_tokens(path, fp)
    if tokens is not None and tokens.dtype == token_dtype(tok.vocab_size):
        log(f"data: {name} tokens cached ({len(tokens):,} {tokens.dtype}) {path}")
        return tokens
    if path.exists():
        log(f"data: {name} token cache {path} is stale or corrupt; rebuilding")
    t0 = time.perf_counter()
    tokens = write_tokens(path, docs, tok, fp)
    dt = time.perf_counter() - t0
    log(f"data: tokenized {name} ({docs.describe()}): {len(tokens):,} tokens in {dt:.1f}s "
        f"({len(tokens) / max(dt, 1e-9) / 1e6:.1f} M tok/s) -> {path}")
    return tokens


def _check_size(tokens: np.ndarray, name: str, cfg: DataSection, corpus: Corpus) -> None:
    need = cfg.seq_len + 2  # one window of seq_len + 1 tokens, and two possible offsets
    if len(tokens) < need:
        where = f"data.path={cfg.path!r}" if cfg.path else "the default corpus"
        raise ConfigError(
            f"{where} gives a {name} split of {len(tokens)} tokens but data.seq_len="
            f"{cfg.seq_len} needs at least {need} ({len(corpus.files)} files; use more data, "
            "a smaller data.seq_len or a different data.val_fraction)"
        )


def build_data(cfg: DataSection, log: Callable[[str], None] = print) -> DataBundle:
    """Resolve, split, tokenize (cached) and return the token arrays and tokenizer."""
    t0 = time.perf_counter()
    corpus = resolve_corpus(cfg.path)
    train, val = split_corpus(corpus, cfg.val_fraction, cfg.text_field)
    log(f"data: {corpus.source}: {len(corpus.files)} files, {corpus.n_bytes / 1e6:.1f} MB; "
        f"train {train.describe()}, val {val.describe()}")
    fp = fingerprint(corpus, cfg.text_field, cfg.val_fraction, _tokenizer_key(cfg))
    cache = _cache_dir(cfg, fp)
    tok = _get_tokenizer(cfg, train, cache, log)
    # Token files are also keyed by the tokenizer's content, so a retrained or edited
    # tokenizer can never be paired with ids produced by another one.
    tok_fp = f"{fp}:{hashlib.sha256(tok.tk.to_str().encode()).hexdigest()}"
    train_tokens = _get_tokens("train", train, tok, cache, tok_fp, log)
    val_tokens = _get_tokens("val", val, tok, cache, tok_fp, log)
    _check_size(train_tokens, "train", cfg, corpus)
    _check_size(val_tokens, "validation", cfg, corpus)
    log(f"data: ready in {time.perf_counter() - t0:.1f}s")
    return DataBundle(tok, train_tokens, val_tokens, corpus.source, cache)
