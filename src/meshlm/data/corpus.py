"""Find the corpus files, split them into train/validation, and read their documents.

The default corpus is the Python standard library of the running interpreter (~12 MB of
``.py`` files, tests excluded). A user corpus (``data.path``) is one file or a folder searched
recursively for text files and ``.jsonl`` files (one JSON document per line).

Memory: listing files only stats them. Documents are read lazily, one file at a time, except
for a single-file corpus, whose documents are held in memory while it is split. Nothing is
written to disk here.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError

# Suffixes read as plain text when scanning a folder; one file given explicitly is read as
# text whatever its suffix, since the user chose it.
TEXT_SUFFIXES = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp",
    ".hpp", ".rs", ".go", ".java", ".js", ".ts", ".sh", ".tex", ".html", ".css", ".toml",
    ".yaml", ".yml", ".ini", ".cfg", ".csv", ".tsv", ".xml",
})
JSONL_SUFFIXES = frozenset({".jsonl"})

# Directory names never taken from the standard library: installed packages and test suites
# (the latter are huge, repetitive and hold deliberately odd encodings).
_STDLIB_EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
})

# Bump when the way documents are read or split changes, so old caches are not reused.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    rel: str  # posix path relative to the corpus root; names the file in the split and caches
    size: int
    mtime_ns: int

    @property
    def is_jsonl(self) -> bool:
        return self.path.suffix.lower() in JSONL_SUFFIXES


@dataclass(frozen=True)
class Corpus:
    source: str  # human-readable description for logs
    root: Path
    files: tuple[CorpusFile, ...]

    @property
    def n_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _stat(path: Path, root: Path) -> CorpusFile:
    try:
        st = path.stat()
    except OSError as e:  # e.g. a dangling symlink
        raise ConfigError(f"cannot read corpus file {str(path)!r}: {e.strerror}") from None
    rel = path.relative_to(root).as_posix() if path != root else path.name
    return CorpusFile(path=path, rel=rel, size=st.st_size, mtime_ns=st.st_mtime_ns)


def default_corpus() -> Corpus:
    """The ``.py`` files of this interpreter's standard library, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into excluded directories at all.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                files.append(_stat(Path(dirpath) / name, root))
    files.sort(key=lambda f: f.rel)
    return Corpus(source=f"python stdlib ({root})", root=root, files=tuple(files))


def user_corpus(path: str) -> Corpus:
    """One file, or every text/JSONL file below a folder (hidden entries skipped)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"data.path={path!r} does not exist")
    if p.is_file():
        return Corpus(source=str(p), root=p.parent, files=(_stat(p, p.parent),))
    wanted = TEXT_SUFFIXES | JSONL_SUFFIXES
    files = []
    for dirpath, dirnames, filenames in os.walk(p):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git, .cache, ...
        for name in filenames:
            if not name.startswith(".") and Path(name).suffix.lower() in wanted:
                files.append(_stat(Path(dirpath) / name, p))
    files = [f for f in files if f.size > 0]
    if not files:
        raise ConfigError(
            f"data.path={path!r} holds no non-empty text files "
            f"({', '.join(sorted(wanted))})"
        )
    files.sort(key=lambda f: f.rel)
    return Corpus(source=str(p), root=p, files=tuple(files))


def resolve_corpus(path: str) -> Corpus:
    return user_corpus(path) if path else default_corpus()


# ------------------------------------------------------------------ reading documents
# Share of a file's characters that may be undecodable bytes before it is refused as not UTF-8.
MAX_BAD_BYTES = 0.001


def _read_text(f: CorpusFile) -> str:
    """The file as UTF-8 text; ConfigError for a binary file (NUL bytes) or a file in another
    encoding. A few stray bytes are replaced: one in a large corpus should not stop training."""
    try:
        raw = f.path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read corpus file {str(f.path)!r}: {e.strerror}") from None
    if b"\0" in raw[:8192]:
        raise ConfigError(f"corpus file {str(f.path)!r} is binary, not text (NUL bytes); "
                          "point data.path at text or JSONL files")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        text = raw.decode("utf-8", errors="replace")
        bad = text.count("\ufffd")
        if bad > max(8, len(text) * MAX_BAD_BYTES):
            raise ConfigError(
                f"corpus file {str(f.path)!r} is not UTF-8 text ({bad} undecodable bytes, the "
                f"first 0x{raw[e.start]:02x} at offset {e.start}); convert it, e.g. "
                "iconv -t UTF-8") from None
        return text


def read_documents(f: CorpusFile, text_field: str) -> Iterator[str]:
    """The documents of one file: the whole file for text, one per line for JSONL."""
    text = _read_text(f)
    if not f.is_jsonl:
        if text:
            yield text
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{f.path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ConfigError(
                f"{f.path}:{lineno}: no string field {text_field!r} (set data.text_field)"
            )
        if record[text_field]:
            yield record[text_field]


@dataclass(frozen=True)
class DocStream:
    """The documents of one split: whole files, or the head/tail of a single file.

    Iterable more than once (tokenizer training and tokenization each read it).
    """

    files: tuple[CorpusFile, ...]
    text_field: str
    part: str = "all"  # "all" | "head" | "tail" (head/tail only for a one-file corpus)
    val_fraction: float = 0.0

    def __iter__(self) -> Iterator[str]:
        if self.part == "all":
            for f in self.files:
                yield from read_documents(f, self.text_field)
            return
        docs = list(read_documents(self.files[0], self.text_field))
        if len(docs) >= 2:
            n_val = min(len(docs) - 1, max(1, round(len(docs) * self.val_fraction)))
            yield from docs[: len(docs) - n_val] if self.part == "head" else docs[-n_val:]
        elif docs:
            # One document: split its characters, the last val_fraction for validation.
            text = docs[0]
            cut = len(text) - max(1, int(len(text) * self.val_fraction))
            piece = text[:cut] if self.part == "head" else text[cut:]
            if piece:
                yield piece

    def describe(self) -> str:
        if self.part == "all":
            return f"{len(self.files)} files"
        return f"{'first' if self.part == 'head' else 'last'} part of {self.files[0].rel}"


def split_corpus(
    corpus: Corpus, val_fraction: float, text_field: str
) -> tuple[DocStream, DocStream]:
    """(train, val) by file: a file is held out when crc32(rel path) / 2**32 < val_fraction.

    Hashing the path (not shuffling) keeps a file on the same side when others are added.
    With two or more files each side gets at least one; one file is split inside itself.
    """
    files = corpus.files
    if len(files) == 1:
        return (DocStream(files, text_field, "head", val_fraction),
                DocStream(files, text_field, "tail", val_fraction))

    def score(f: CorpusFile) -> float:
        return zlib.crc32(f.rel.encode("utf-8")) / 2**32

    val = {f.rel for f in files if score(f) < val_fraction}
    if not val:
        val = {min(files, key=score).rel}
    if len(val) == len(files):
        val.discard(max(files, key=score).rel)
    train = tuple(f for f in files if f.rel not in val)
    held = tuple(f for f in files if f.rel in val)
    return DocStream(train, text_field), DocStream(held, text_field)


def fingerprint(corpus: Corpus, *parts: object) -> str:
    """Hex digest of the file list (paths, sizes, mtimes) and every setting in ``parts``."""
    payload = {
        "version": FORMAT_VERSION,
        "root": str(corpus.root.resolve()),
        "files": [[f.rel, f.size, f.mtime_ns] for f in corpus.files],
        "parts": [str(p) for p in parts],
    }
    return hashlib.sha256(json.dumps(payload).encode("utf-8")).hexdigest()
