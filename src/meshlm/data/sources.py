"""Inputs of ``meshlm prepare``: find the files, cut them into work units, read documents.

An input is a text file, a JSONL file (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``), a Parquet
file, a folder of those (searched recursively, hidden entries skipped), or a Hugging Face
``datasets`` folder written by ``save_to_disk`` (its arrow files). The default input is this
interpreter's standard library (``.py`` files, tests and installed packages excluded).

Work units are deterministic: files in sorted order, cut into pieces (byte ranges at line
boundaries of an uncompressed JSONL file, row groups of a Parquet file, one arrow file, a
whole text or compressed file), pieces packed in order into units of about ``unit_bytes``.
Every document has a key (its file's relative path, plus the byte offset of its line or its
row number) that decides its split, so the split depends on neither units nor workers.

Memory: planning stats the files and reads a few bytes per JSONL cut (Parquet / arrow
metadata only). Reading holds one piece's raw bytes, one row group's column, or one line of a
compressed JSONL file (decompressed as a stream) at a time; a text file is read whole.
Nothing is written here.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError

# Suffixes read as plain text when scanning a folder; one file given explicitly is read as
# text whatever its suffix (the user chose it), unless it is a known binary container.
TEXT_SUFFIXES = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp",
    ".hpp", ".rs", ".go", ".java", ".js", ".ts", ".sh", ".tex", ".html", ".css", ".toml",
    ".yaml", ".yml", ".ini", ".cfg", ".csv", ".tsv", ".xml",
})
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
# Containers meshlm cannot read: refused by name rather than read as (binary) text.
UNKNOWN_SUFFIXES = (".gz", ".zst", ".bz2", ".xz", ".zip", ".tar", ".7z", ".feather", ".npy",
                    ".npz", ".pt", ".safetensors", ".pkl")
DATASETS_MARKERS = ("state.json", "dataset_info.json")
SUPPORTED = ("text files, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, or a Hugging Face "
             "datasets folder (save_to_disk)")

# Directory names never taken from the standard library: installed packages and test suites
# (the latter are huge, repetitive and hold deliberately odd encodings).
_STDLIB_EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
})
# Share of a text file's characters that may be undecodable bytes before it is refused.
MAX_BAD_BYTES = 0.001


@dataclass(frozen=True)
class InputFile:
    path: Path
    rel: str  # posix path relative to its input's root: names the file in keys and plans
    size: int
    mtime_ns: int
    kind: str  # "text" | "jsonl" | "parquet" | "arrow"


@dataclass(frozen=True)
class Source:
    """One input argument and the files it stands for (sorted by relative path)."""

    path: str  # as resolved (absolute), for the manifest and messages
    files: tuple[InputFile, ...]

    @property
    def n_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class Piece:
    """Part of one file: a byte range (jsonl), a row-group range (parquet), or all of it."""

    source: int
    file: int
    start: int
    end: int
    n_bytes: int  # on disk, for packing and progress


@dataclass(frozen=True)
class Unit:
    index: int
    pieces: tuple[Piece, ...]

    @property
    def name(self) -> str:
        return f"u{self.index:06d}"

    @property
    def n_bytes(self) -> int:
        return sum(p.n_bytes for p in self.pieces)

    def describe(self) -> list[list[int]]:
        """JSON form, compared on resume."""
        return [[p.source, p.file, p.start, p.end] for p in self.pieces]


# ------------------------------------------------------------------ finding files
def _kind_of(name: str) -> str | None:
    low = name.lower()
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if low.endswith(".arrow"):
        return "arrow"
    if low.endswith(UNKNOWN_SUFFIXES):
        return None
    return "text"


def _stat(path: Path, rel: str, kind: str) -> InputFile:
    try:
        st = path.stat()
    except OSError as e:  # e.g. a dangling symlink
        raise ConfigError(f"cannot read corpus file {str(path)!r}: {e.strerror}") from None
    return InputFile(path=path, rel=rel, size=st.st_size, mtime_ns=st.st_mtime_ns, kind=kind)


def is_datasets_folder(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in DATASETS_MARKERS)


def _arrow_files(folder: Path, root: Path) -> list[InputFile]:
    """The arrow files of a ``save_to_disk`` folder, in the order state.json lists them."""
    names: list[str] = []
    state = folder / "state.json"
    if state.is_file():
        try:
            names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{state} is not a datasets state.json ({e})") from None
    else:
        names = sorted(p.name for p in folder.glob("*.arrow"))
    return [_stat(folder / n, (folder / n).relative_to(root).as_posix(), "arrow")
            for n in names]


def _walk(root: Path) -> list[InputFile]:
    files: list[InputFile] = []
    if is_datasets_folder(root):
        return _arrow_files(root, root)
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .git, .cache
        for d in list(dirnames):
            if is_datasets_folder(here / d):
                dirnames.remove(d)
                files += _arrow_files(here / d, root)
        for name in filenames:
            kind = _kind_of(name)
            low = name.lower()
            if name.startswith(".") or kind in (None, "arrow"):  # arrow: datasets folders
                continue
            if kind == "text" and Path(low).suffix not in TEXT_SUFFIXES:
                continue
            files.append(_stat(here / name, (here / name).relative_to(root).as_posix(), kind))
    return files


def resolve_source(path: str) -> Source:
    """One input: a file, a folder (recursive) or a datasets folder."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"input {path!r} does not exist")
    if p.is_file():
        kind = _kind_of(p.name)
        if kind is None:
            raise ConfigError(f"input {path!r}: unknown input type (supported: {SUPPORTED})")
        return Source(str(p.resolve()), (_stat(p, p.name, kind),))
    files = [f for f in _walk(p) if f.size > 0]
    if not files:
        raise ConfigError(f"input {path!r} holds no non-empty text files ({SUPPORTED})")
    files.sort(key=lambda f: f.rel)
    return Source(str(p.resolve()), tuple(files))


def default_source() -> Source:
    """The ``.py`` files of this interpreter's standard library, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into excluded directories at all.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath) / name
                files.append(_stat(p, p.relative_to(root).as_posix(), "text"))
    files.sort(key=lambda f: f.rel)
    return Source(str(root), tuple(files))


# ------------------------------------------------------------------ cutting into pieces
def _jsonl_cuts(f: InputFile, chunk: int) -> list[tuple[int, int]]:
    """Byte ranges of about ``chunk`` bytes, each starting at a line start."""
    if not f.path.name.lower().endswith(".jsonl") or f.size <= chunk:
        return [(0, f.size)]
    starts = [0]
    with open(f.path, "rb") as fh:
        while starts[-1] + chunk < f.size:
            fh.seek(starts[-1] + chunk)
            fh.readline()  # to the end of the line the cut fell in
            if fh.tell() >= f.size:
                break
            starts.append(fh.tell())
    return list(zip(starts, starts[1:] + [f.size], strict=True))


def _arrow_schema_check(f: InputFile, names: list[str], types: list[Any], field: str) -> None:
    import pyarrow as pa

    if field not in names:
        raise ConfigError(f"{f.path}: no column {field!r} (columns: {', '.join(names)}; set "
                          "--text-field / data.text_field)")
    t = types[names.index(field)]
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise ConfigError(f"{f.path}: column {field!r} holds {t}, not text")


def _parquet_pieces(f: InputFile, text_field: str) -> list[tuple[int, int, int]]:
    """(first row group, end row group, bytes) per row group, after checking the column."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(f.path).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise ConfigError(f"{f.path}: not a readable Parquet file ({e})") from None
    schema = meta.schema.to_arrow_schema()
    _arrow_schema_check(f, schema.names, schema.types, text_field)
    return [(g, g + 1, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]


def _arrow_open(path: Path) -> Any:
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_stream(source)  # what datasets writes
    except pa.ArrowInvalid:
        return pa.ipc.open_file(pa.memory_map(str(path)))


def _arrow_check(f: InputFile, text_field: str) -> None:
    try:
        schema = _arrow_open(f.path).schema
    except Exception as e:
        raise ConfigError(f"{f.path}: not a readable arrow file ({e})") from None
    _arrow_schema_check(f, schema.names, schema.types, text_field)


def _pieces_of(src: int, i: int, f: InputFile, text_field: str, chunk: int) -> list[Piece]:
    if f.kind == "jsonl":
        return [Piece(src, i, a, b, b - a) for a, b in _jsonl_cuts(f, chunk)]
    if f.kind == "parquet":
        return [Piece(src, i, a, b, n) for a, b, n in _parquet_pieces(f, text_field)]
    if f.kind == "arrow":
        _arrow_check(f, text_field)
    return [Piece(src, i, 0, f.size, f.size)]


def plan_units(sources: list[Source], text_field: str, unit_bytes: int) -> list[Unit]:
    """Pieces of every file in order, packed into units of about ``unit_bytes``."""
    units: list[Unit] = []
    batch: list[Piece] = []
    size = 0
    for s, source in enumerate(sources):
        for i, f in enumerate(source.files):
            for piece in _pieces_of(s, i, f, text_field, unit_bytes):
                alone = f.kind == "arrow"  # one arrow file of a datasets folder per unit
                if batch and (size + piece.n_bytes > unit_bytes or alone):
                    units.append(Unit(len(units), tuple(batch)))
                    batch, size = [], 0
                batch.append(piece)
                size += piece.n_bytes
                if alone:
                    units.append(Unit(len(units), tuple(batch)))
                    batch, size = [], 0
    if batch:
        units.append(Unit(len(units), tuple(batch)))
    return units


# ------------------------------------------------------------------ reading documents
def _read_bytes(f: InputFile, start: int = 0, end: int | None = None) -> bytes:
    try:
        with open(f.path, "rb") as fh:
            fh.seek(start)
            return fh.read((f.size if end is None else end) - start)
    except OSError as e:
        raise ConfigError(f"cannot read corpus file {str(f.path)!r}: {e.strerror}") from None


def decode_text(f: InputFile, raw: bytes) -> str:
    """UTF-8 text; ConfigError for a binary file (NUL bytes) or another encoding. A few stray
    bytes are replaced: one in a large corpus should not stop the work."""
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


def _compressed_lines(f: InputFile) -> Iterator[bytes]:
    """The lines of a .gz / .zst file, decompressed as a stream (never whole in memory)."""
    try:
        if f.path.name.lower().endswith(".gz"):
            with gzip.open(f.path, "rb") as fh:
                yield from fh
        else:
            import zstandard

            with open(f.path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(
                    raw) as zs:
                yield from io.BufferedReader(zs)
    except (OSError, EOFError, ValueError) as e:  # zstandard.ZstdError is a ValueError
        raise ConfigError(f"{f.path}: cannot decompress ({e})") from None


def _jsonl_lines(f: InputFile, piece: Piece) -> Iterator[tuple[int, bytes]]:
    """(byte offset in the decompressed file, line) of every line of the piece."""
    if not f.path.name.lower().endswith(".jsonl"):
        offset = 0
        for line in _compressed_lines(f):
            yield offset, line
            offset += len(line)
        return
    offset = piece.start
    for line in _read_bytes(f, piece.start, piece.end).splitlines(keepends=True):
        yield offset, line
        offset += len(line)


def _line_number(f: InputFile, offset: int) -> int:
    """1-based line number of the line at byte ``offset`` (errors only: counts newlines)."""
    if f.path.name.lower().endswith(".jsonl"):
        return _read_bytes(f, 0, offset).count(b"\n") + 1
    return sum(1 for o, _ in _jsonl_lines(f, Piece(0, 0, 0, 0, 0)) if o < offset) + 1


def _jsonl_docs(f: InputFile, piece: Piece, text_field: str) -> Iterator[tuple[str, str]]:
    for here, line in _jsonl_lines(f, piece):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            reason = getattr(e, "msg", None) or "not UTF-8"
            raise ConfigError(f"{f.path}:{_line_number(f, here)}: not valid JSON "
                              f"({reason})") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"{f.path}:{_line_number(f, here)}: no string field "
                              f"{text_field!r} (set --text-field / data.text_field)")
        if text:
            yield f"{f.rel}:{here}", text


def _table_docs(f: InputFile, piece: Piece, text_field: str) -> Iterator[tuple[str, str]]:
    if f.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(f.path)
        row = sum(pf.metadata.row_group(g).num_rows for g in range(piece.start))
        batches = (pf.read_row_group(g, columns=[text_field]).column(0)
                   for g in range(piece.start, piece.end))
    else:
        row = 0
        reader = _arrow_open(f.path)
        batches = (b.column(b.schema.get_field_index(text_field)) for b in reader)
    for column in batches:
        for text in column.to_pylist():
            if text:
                yield f"{f.rel}:{row}", text
            row += 1


def read_piece(sources: list[Source], piece: Piece, text_field: str
               ) -> Iterator[tuple[str, str]]:
    """(key, text) of every non-empty document of ``piece``."""
    f = sources[piece.source].files[piece.file]
    if f.kind == "jsonl":
        yield from _jsonl_docs(f, piece, text_field)
    elif f.kind in ("parquet", "arrow"):
        yield from _table_docs(f, piece, text_field)
    else:
        text = decode_text(f, _read_bytes(f))
        if text:
            yield f.rel, text


def split_score(key: str) -> int:
    """crc32 of a document's key; the document is validation when below val_fraction * 2^32."""
    return zlib.crc32(key.encode("utf-8"))
