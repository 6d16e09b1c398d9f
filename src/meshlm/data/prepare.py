"""``meshlm prepare``: tokenize inputs, in worker processes, into a sharded dataset folder.

Folder layout (see docs/data.md)::

    plan.json            what is being prepared (inputs, settings, tokenizer); written first
    tokenizer.json       the tokenizer used (given, or a byte-level BPE trained on train docs)
    shards/uNNNNNN.{train,val}.bin      token ids, uint16 or uint32, each document + eot
    shards/uNNNNNN.{train,val}.idx.npy  int64 start offset of every document of the shard
    units/uNNNNNN.json   done record of one work unit, written after its shards
    manifest.json        written last, atomically: its presence means complete

Every file is written under a temporary name and renamed into place; a unit's done record
is written after its shards, the manifest after every unit. A rerun skips units whose done
record and shards check out and redoes the rest, so an interrupted run resumes, and the
result does not depend on ``--workers`` (units, splits and shards are fixed by the inputs).

Communication: the main process plans units and hands them to ``workers`` processes
(forkserver where available, else spawn; each loads the tokenizer once); a worker returns
the unit's done record (a few hundred bytes). Memory per worker: one unit's raw bytes (about
``unit_bytes``) plus one batch of ``BATCH_CHARS`` characters and its ids. Training a BPE
reads the train documents once in the main process (the tokenizers library keeps word
counts only).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError
from ..run_lock import contents
from ..version import __version__
from .sources import (
    Source,
    Unit,
    default_source,
    plan_units,
    read_piece,
    resolve_source,
    split_score,
)
from .tokenizer import Tokenizer, train_bpe

FORMAT = "meshlm-tokens"
FORMAT_VERSION = 1
UNIT_BYTES = 8 * 2**20  # input bytes per work unit
# Documents are encoded in batches of about this many characters: enough for the tokenizer's
# threads to stay busy, small enough to bound memory.
BATCH_CHARS = 2_000_000
# Longer documents are cut (at a newline) into pieces of about this size so that one huge
# file does not become one huge encode call; tokens near a cut may differ slightly.
MAX_PIECE_CHARS = 1_000_000
SPLITS = ("train", "val")

Log = Callable[[str], None]


class NoDocuments(ConfigError):
    """The inputs hold no document at all."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary name (pid in it) and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, (json.dumps(obj, indent=1) + "\n").encode())


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} {path} is unreadable or corrupt ({e})") from None


# ------------------------------------------------------------------ settings and plan
@dataclass
class Settings:
    text_field: str = "text"
    val_fraction: float = 0.05
    unit_bytes: int = UNIT_BYTES

    @property
    def threshold(self) -> int:
        return int(self.val_fraction * 2**32)


def make_plan(sources: list[Source], settings: Settings, tok_spec: dict[str, Any]
          ) -> dict[str, Any]:
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "sources": [{"path": s.path, "files": [[f.rel, f.size, f.mtime_ns] for f in s.files]}
                    for s in sources],
        "text_field": settings.text_field, "val_fraction": settings.val_fraction,
        "unit_bytes": settings.unit_bytes, "tokenizer": tok_spec,
    }


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def inputs_digest(plan: dict[str, Any]) -> str:
    """What identifies the inputs and settings (everything but the tokenizer)."""
    return _digest({k: v for k, v in plan.items() if k != "tokenizer"})


def tokenizer_spec(tokenizer: str | None, vocab_size: int) -> dict[str, Any]:
    if not tokenizer:
        return {"bpe_vocab_size": vocab_size}
    p = Path(tokenizer).expanduser()
    try:
        return {"sha256": sha256_file(p)}
    except OSError as e:
        raise ConfigError(f"tokenizer {tokenizer!r} cannot be read: {e.strerror}") from None


def _same_tokenizer(spec: dict[str, Any], manifest: dict[str, Any]) -> bool:
    tok = manifest["tokenizer"]
    if "sha256" in spec:
        return spec["sha256"] == tok["sha256"]
    return spec == tok.get("trained")


def _check_finished(out: Path, plan: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest when ``out`` is already prepared from the same inputs and tokenizer; None
    when it is not finished; ConfigError when it was prepared from something else."""
    path = out / "manifest.json"
    if not path.is_file():
        return None
    manifest = read_json(path, "manifest")
    try:
        same_inputs = manifest["inputs_sha256"] == inputs_digest(plan)
        same_tok = _same_tokenizer(plan["tokenizer"], manifest)
    except (KeyError, TypeError):
        raise ConfigError(f"{path} is not a meshlm dataset manifest") from None
    if same_inputs and same_tok:
        return manifest
    what = " and ".join(w for w, same in (("other inputs or settings", same_inputs),
                                          ("another tokenizer", same_tok)) if not same)
    raise ConfigError(f"{out} is already prepared from {what}; nothing was changed (choose "
                      "another --out, or delete the folder to prepare it again)")


def _claim(out: Path, plan: dict[str, Any], owned: bool) -> None:
    """Write plan.json into a new or empty ``out``, or check the one of an unfinished run.
    ``owned``: a cache folder named by the plan's fingerprint, which other processes may be
    filling with the same plan at the same moment (so it need not be empty)."""
    path = out / "plan.json"
    if path.is_file():
        if read_json(path, "plan") != plan:
            raise ConfigError(f"{out} holds an unfinished preparation of other inputs, settings "
                              "or another tokenizer; nothing was changed (rerun that command "
                              "to finish it, choose another --out, or delete the folder)")
        return
    if out.exists() and (not out.is_dir() or (bool(contents(out)) and not owned)):
        raise ConfigError(f"--out {out} exists and is not a dataset folder being prepared "
                          "(choose a new or empty folder)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {out}: {e.strerror}") from None
    write_json(path, plan)


# ------------------------------------------------------------------ encoding
def _pieces(text: str) -> Iterator[str]:
    start = 0
    while len(text) - start > MAX_PIECE_CHARS:
        cut = text.rfind("\n", start, start + MAX_PIECE_CHARS) + 1
        if cut <= start:  # no newline in range: cut anywhere
            cut = start + MAX_PIECE_CHARS
        yield text[start:cut]
        start = cut
    yield text[start:]


def encode_documents(tok: Tokenizer, texts: list[str], dtype: np.dtype
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths): every text's ids followed by eot (when the tokenizer has one), as one
    array of ``dtype``, and the number of tokens of each document."""
    pieces: list[str] = []
    last: list[int] = []  # index of each document's last piece
    for text in texts:
        pieces.extend(_pieces(text))
        last.append(len(pieces) - 1)
    encode = getattr(tok.tk, "encode_batch_fast", tok.tk.encode_batch)  # fast: no offsets
    ids = [e.ids for e in encode(pieces, add_special_tokens=False)]
    if tok.eot_id is not None:
        for i in last:
            ids[i].append(tok.eot_id)
    sizes = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(sizes.sum()))
    ends = np.cumsum(sizes)[last]
    return flat, np.diff(ends, prepend=0)


class ShardWriter:
    """One shard: token ids appended to a temporary file (hashed on the way), renamed with its
    document index when finished."""

    def __init__(self, folder: Path, name: str) -> None:
        self.bin = folder / f"{name}.bin"
        self.idx = folder / f"{name}.idx.npy"
        self.tmp = folder / f".{name}.bin.{os.getpid()}.tmp"
        self.file: io.BufferedWriter | None = None
        self.hash = hashlib.sha256()
        self.tokens = 0
        self.starts: list[np.ndarray] = []

    def write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if self.file is None:
            self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish()/abort()
        data = tokens.tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.starts.append(self.tokens + np.cumsum(lengths) - lengths)
        self.tokens += len(tokens)

    def finish(self) -> dict[str, Any] | None:
        """Rename into place; the shard's record (None when it got no document)."""
        if self.file is None:
            return None
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        buf = io.BytesIO()
        starts = np.concatenate(self.starts).astype(np.int64)
        np.save(buf, starts)
        index = buf.getvalue()
        os.replace(self.tmp, self.bin)
        write_atomic(self.idx, index)
        return {"name": f"shards/{self.bin.name}", "index": f"shards/{self.idx.name}",
                "tokens": self.tokens, "documents": len(starts),
                "bytes": self.bin.stat().st_size, "sha256": self.hash.hexdigest(),
                "index_bytes": len(index), "index_sha256": hashlib.sha256(index).hexdigest()}

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
        self.tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------ one work unit
@dataclass
class _Worker:
    """Per-process state: set once by :func:`_init_worker`."""

    out: Path
    sources: list[Source]
    settings: Settings
    tok: Tokenizer
    tok_sha: str
    dtype: np.dtype


_STATE: _Worker | None = None


def _init_worker(out: Path, sources: list[Source], settings: Settings, tok_path: Path,
                 tok_sha: str, threads: int) -> None:
    global _STATE
    if threads:  # tokenizers' thread pool starts on first use and reads these
        os.environ["RAYON_NUM_THREADS"] = os.environ["RAYON_RS_NUM_CPUS"] = str(threads)
    tok = Tokenizer.load(tok_path)
    _STATE = _Worker(out, sources, settings, tok, tok_sha, token_dtype(tok.vocab_size))


@dataclass
class _Stats:
    """A unit's natural split (before any override): counts and its extreme documents."""

    documents: int = 0
    val_documents: int = 0
    lo: tuple[int, str] | None = None  # (score, key) of the lowest-scoring document
    hi: tuple[int, str] | None = None

    def add(self, score: int, key: str, is_val: bool) -> None:
        self.documents += 1
        self.val_documents += is_val
        self.lo = min(self.lo or (score, key), (score, key))
        self.hi = max(self.hi or (score, key), (score, key))

    def to_json(self) -> dict[str, Any]:
        return {"documents": self.documents, "val_documents": self.val_documents,
                "lo": self.lo and list(self.lo), "hi": self.hi and list(self.hi)}


def route(key: str, text: str, is_val: bool, override: dict[str, Any] | None,
          val_fraction: float) -> list[tuple[str, str]]:
    """[(split, text)] of one document; an override moves (or splits) one document."""
    if override is None or override["key"] != key:
        return [("val" if is_val else "train", text)]
    if override["mode"] != "chars":
        return [(override["mode"], text)]
    cut = len(text) - max(1, int(len(text) * val_fraction))
    return [(s, t) for s, t in (("train", text[:cut]), ("val", text[cut:])) if t]


class _Batches:
    """Documents of each split gathered into encode batches and written to the shards."""

    def __init__(self, st: _Worker, name: str) -> None:
        self.st = st
        self.writers = {s: ShardWriter(st.out / "shards", f"{name}.{s}") for s in SPLITS}
        self.texts: dict[str, list[str]] = {s: [] for s in SPLITS}
        self.chars = dict.fromkeys(SPLITS, 0)

    def add(self, split: str, text: str) -> None:
        self.texts[split].append(text)
        self.chars[split] += len(text)
        if self.chars[split] >= BATCH_CHARS:
            self.flush(split)

    def flush(self, split: str) -> None:
        if self.texts[split]:
            tokens, lengths = encode_documents(self.st.tok, self.texts[split], self.st.dtype)
            self.writers[split].write(tokens, lengths)
        self.texts[split], self.chars[split] = [], 0


def _run_unit(unit: Unit, override: dict[str, Any] | None) -> dict[str, Any]:
    """Tokenize one unit into its shards, then write its done record; returns the record."""
    st = _STATE
    assert st is not None, "_init_worker was not called"
    batches = _Batches(st, unit.name)
    stats = _Stats()
    try:
        for piece in unit.pieces:
            for key, text in read_piece(st.sources, piece, st.settings.text_field):
                score = split_score(key)
                is_val = score < st.settings.threshold
                stats.add(score, key, is_val)
                for split, part in route(key, text, is_val, override, st.settings.val_fraction):
                    batches.add(split, part)
        for split in SPLITS:
            batches.flush(split)
        shards = {split: batches.writers[split].finish() for split in SPLITS}
    except BaseException:
        for w in batches.writers.values():
            w.abort()
        raise
    record = {"unit": unit.describe(), "tokenizer_sha256": st.tok_sha, "override": override,
              "stats": stats.to_json(), "input_bytes": unit.n_bytes, "shards": shards}
    write_json(st.out / "units" / f"{unit.name}.json", record)
    return record | {"name": unit.name}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep_temporaries(out: Path) -> int:
    """Remove temporary files left by killed runs (``.NAME.PID.tmp`` of a process that is
    gone; those of live processes, e.g. another rank preparing the same cache, stay)."""
    removed = 0
    for folder in (out, out / "shards", out / "units"):
        for p in folder.glob(".*.tmp"):
            pid = p.name.split(".")[-2]
            if pid.isdigit() and not _alive(int(pid)):
                p.unlink(missing_ok=True)
                removed += 1
    return removed


def _done_record(out: Path, unit: Unit, tok_sha: str) -> dict[str, Any] | None:
    """The unit's done record when it and its shard files check out (sizes), else None."""
    try:
        record = json.loads((out / "units" / f"{unit.name}.json").read_text())
        if record["unit"] != unit.describe() or record["tokenizer_sha256"] != tok_sha:
            return None
        for shard in record["shards"].values():
            if shard is None:
                continue
            if ((out / shard["name"]).stat().st_size != shard["bytes"]
                    or (out / shard["index"]).stat().st_size != shard["index_bytes"]):
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return record | {"name": unit.name}


# ------------------------------------------------------------------ tiny corpora
def choose_override(records: dict[int, dict[str, Any]], what: str) -> dict[str, Any] | None:
    """Which document to move so that neither split is empty (None: no need).

    Two or more documents: when no document falls in validation, the lowest-scoring one goes
    there; when all do, the highest-scoring one goes to train. One document: its characters
    are split, the last val_fraction for validation.
    """
    stats = [(i, r["stats"]) for i, r in sorted(records.items())]
    docs = sum(s["documents"] for _, s in stats)
    val = sum(s["val_documents"] for _, s in stats)
    if docs == 0:
        raise NoDocuments(f"{what} holds no documents")
    if docs >= 2 and 0 < val < docs:
        return None
    pick_lo = docs == 1 or val == 0
    side = "lo" if pick_lo else "hi"
    cands = [(tuple(s[side]), i) for i, s in stats if s[side] is not None]
    (_, key), unit = min(cands) if pick_lo else max(cands)
    mode = "chars" if docs == 1 else ("val" if pick_lo else "train")
    return {"unit": unit, "key": key, "mode": mode}


# ------------------------------------------------------------------ progress
class _Progress:
    """A rich progress bar on stderr (documents, bytes, tokens/s, ETA); silent when off."""

    def __init__(self, enabled: bool, total_bytes: int) -> None:
        self.t0 = time.perf_counter()
        self.units: dict[str, tuple[int, int]] = {}  # (documents, tokens) of each unit done
        self.bar: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("prepare"), BarColumn(), DownloadColumn(),
            TextColumn("{task.fields[docs]:,} docs"), TextColumn("{task.fields[rate]}"),
            TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True))
        self.bar.start()
        self.task = self.bar.add_task("prepare", total=total_bytes, docs=0, rate="")

    def done(self, record: dict[str, Any]) -> None:
        """A unit finished (again, when redone for a tiny-corpus override: counted once)."""
        first = record["name"] not in self.units
        shards = [s for s in record["shards"].values() if s]
        self.units[record["name"]] = (sum(s["documents"] for s in shards),
                                      sum(s["tokens"] for s in shards))
        if self.bar is not None:
            tokens = sum(t for _, t in self.units.values())
            rate = tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.update(self.task, advance=record["input_bytes"] if first else 0,
                            docs=sum(d for d, _ in self.units.values()),
                            rate=f"{rate / 1e6:.2f} M tok/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# ------------------------------------------------------------------ running units
def _context() -> mp.context.BaseContext:
    from ..distributed.forkserver import ensure_server, forkserver_context

    ctx = forkserver_context([__name__])  # workers fork from one process that has it
    ensure_server(ctx)
    return ctx


def _execute(jobs: list[tuple[Unit, dict[str, Any] | None]], init: tuple[Any, ...],
             workers: int, on_done: Callable[[dict[str, Any]], None]) -> None:
    """Run ``_run_unit`` on every job, here (one worker or one job) or in a process pool."""
    if not jobs:
        return
    if workers <= 1 or len(jobs) == 1:
        _init_worker(*init, 0)
        for unit, override in jobs:
            on_done(_run_unit(unit, override))
        return
    n = min(workers, len(jobs))
    threads = max(1, (os.cpu_count() or 1) // n)
    with ProcessPoolExecutor(n, mp_context=_context(), initializer=_init_worker,
                             initargs=(*init, threads)) as pool:
        futures = [pool.submit(_run_unit, unit, override) for unit, override in jobs]
        try:
            for fut in as_completed(futures):
                on_done(fut.result())
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise


# ------------------------------------------------------------------ tokenizer
def _documents(sources: list[Source], units: list[Unit], settings: Settings,
               records: dict[int, dict[str, Any]]) -> Iterator[tuple[int, str, int, str]]:
    """(unit, key, score, text) of every document, read here in order."""
    for unit in units:
        stats = _Stats()
        for piece in unit.pieces:
            for key, text in read_piece(sources, piece, settings.text_field):
                score = split_score(key)
                stats.add(score, key, score < settings.threshold)
                yield unit.index, key, score, text
        records[unit.index] = {"stats": stats.to_json()}


def _train_tokenizer(sources: list[Source], units: list[Unit], settings: Settings,
                     vocab_size: int, what: str, log: Log) -> Tokenizer:
    """A byte-level BPE trained on the train documents (after any tiny-corpus override)."""

    def train_docs(override: dict[str, Any] | None, records: dict[int, dict[str, Any]]
                   ) -> Iterator[str]:
        for unit, key, score, text in _documents(sources, units, settings, records):
            ov = override if override and override["unit"] == unit else None
            for split, part in route(key, text, score < settings.threshold, ov,
                                     settings.val_fraction):
                if split == "train":
                    yield part

    t0 = time.perf_counter()
    records: dict[int, dict[str, Any]] = {}
    tok = train_bpe(train_docs(None, records), vocab_size)
    override = choose_override(records, what)
    if override is not None:  # a tiny corpus: train again on the train split as it will be
        tok = train_bpe(train_docs(override, {}), vocab_size)
    log(f"prepare: trained a byte-level BPE (vocab {tok.vocab_size}) on the train documents "
        f"in {time.perf_counter() - t0:.1f}s")
    return tok


def _tokenizer_file(out: Path, tokenizer: str | None, vocab_size: int, sources: list[Source],
                    units: list[Unit], settings: Settings, what: str, log: Log) -> str:
    """Put the tokenizer at ``out/tokenizer.json`` (copied or trained); its sha256."""
    path = out / "tokenizer.json"
    if tokenizer:
        data = Path(tokenizer).expanduser().read_bytes()
        if not path.is_file() or path.read_bytes() != data:
            write_atomic(path, data)
        return hashlib.sha256(data).hexdigest()
    if path.is_file():  # trained by an earlier, interrupted run of this plan
        try:
            Tokenizer.load(path)
            return sha256_file(path)
        except ConfigError:
            pass
    _train_tokenizer(sources, units, settings, vocab_size, what, log).save(path)
    return sha256_file(path)


# ------------------------------------------------------------------ manifest
def _manifest(plan: dict[str, Any], sources: list[Source], records: dict[int, dict[str, Any]],
              tok: Tokenizer, tok_sha: str, override: dict[str, Any] | None) -> dict[str, Any]:
    splits: dict[str, Any] = {}
    for split in SPLITS:
        shards = [r["shards"][split] for _, r in sorted(records.items()) if r["shards"][split]]
        splits[split] = {"tokens": sum(s["tokens"] for s in shards),
                         "documents": sum(s["documents"] for s in shards), "shards": shards}
    trained = plan["tokenizer"] if "bpe_vocab_size" in plan["tokenizer"] else None
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "meshlm_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tokenizer": {"file": "tokenizer.json", "sha256": tok_sha, "vocab_size": tok.vocab_size,
                      "eot_id": tok.eot_id, "trained": trained},
        "dtype": token_dtype(tok.vocab_size).name,
        "sources": [{"path": s.path, "bytes": s.n_bytes, "files": len(s.files)}
                    for s in sources],
        "inputs_sha256": inputs_digest(plan),
        "text_field": plan["text_field"], "val_fraction": plan["val_fraction"],
        "unit_bytes": plan["unit_bytes"], "units": len(records), "split_override": override,
        "splits": splits,
        "totals": {"tokens": sum(s["tokens"] for s in splits.values()),
                   "documents": sum(s["documents"] for s in splits.values()),
                   "input_bytes": sum(s.n_bytes for s in sources)},
    }


# ------------------------------------------------------------------ prepare
@dataclass
class Result:
    manifest: dict[str, Any]
    already: bool  # the folder was prepared before: nothing was done
    seconds: float = 0.0
    units_run: int = 0
    tokens_run: int = 0  # in the units run now (not those done by an earlier run)
    documents_run: int = 0


def resolve_inputs(inputs: list[str]) -> list[Source]:
    return [resolve_source(p) for p in inputs] if inputs else [default_source()]


def prepare(inputs: list[str], out: str | Path, *, tokenizer: str | None = None,
            vocab_size: int = 4096, workers: int = 1, text_field: str = "text",
            val_fraction: float = 0.05, unit_bytes: int = UNIT_BYTES, progress: bool = False,
            log: Log = print, sources: list[Source] | None = None, owned: bool = False
            ) -> Result:
    """Tokenize ``inputs`` (files / folders; [] = the default corpus) into the folder ``out``.

    Resumes an unfinished run of the same command; a folder already prepared from the same
    inputs and tokenizer is left as it is; anything else there: ConfigError, nothing changed.
    ``sources``: the inputs already resolved; ``owned``: see :func:`_claim`.
    """
    t0 = time.perf_counter()
    if not 0 < val_fraction < 1:
        raise ConfigError(f"--val-fraction={val_fraction} must lie in (0, 1)")
    if workers < 1:
        raise ConfigError(f"--workers={workers} must be >= 1")
    out = Path(out).expanduser()
    what = " ".join(inputs) if inputs else "the default corpus"
    sources = sources if sources is not None else resolve_inputs(inputs)
    settings = Settings(text_field, val_fraction, unit_bytes)
    plan = make_plan(sources, settings, tokenizer_spec(tokenizer, vocab_size))
    if tokenizer:
        Tokenizer.load(tokenizer)  # one clear line if it is not a tokenizer, before any write
    if (manifest := _check_finished(out, plan)) is not None:
        return Result(manifest, already=True)
    units = plan_units(sources, text_field, unit_bytes)  # (checks Parquet / arrow columns)
    _claim(out, plan, owned)
    for sub in ("shards", "units"):
        (out / sub).mkdir(exist_ok=True)
    sweep_temporaries(out)
    tok_sha = _tokenizer_file(out, tokenizer, vocab_size, sources, units, settings, what, log)
    tok = Tokenizer.load(out / "tokenizer.json")
    if tok.eot_id is None:
        log("prepare: warning: the tokenizer has no end-of-text token; documents are joined "
            "without a separator")
    init = (out, sources, settings, out / "tokenizer.json", tok_sha)

    records, override, ran = _tokenize_units(out, units, init, tok_sha, workers, progress,
                                             what)
    manifest = _manifest(plan, sources, records, tok, tok_sha, override)
    write_json(out / "manifest.json", manifest)
    shards = [sh for i in ran for sh in records[i]["shards"].values() if sh]
    return Result(manifest, already=False, seconds=time.perf_counter() - t0, units_run=len(ran),
                  tokens_run=sum(sh["tokens"] for sh in shards),
                  documents_run=sum(sh["documents"] for sh in shards))


def _tokenize_units(out: Path, units: list[Unit], init: tuple[Any, ...], tok_sha: str,
                    workers: int, progress: bool, what: str
                    ) -> tuple[dict[int, dict[str, Any]], dict[str, Any] | None, set[int]]:
    """Run every unit not done yet, then redo those a tiny-corpus override changes; (done
    records by unit, the override, the units run)."""
    records = {u.index: r for u in units if (r := _done_record(out, u, tok_sha)) is not None}
    bar = _Progress(progress, sum(u.n_bytes for u in units))
    try:
        for r in records.values():
            bar.done(r)
        jobs = [(u, None) for u in units if u.index not in records]

        def finished(record: dict[str, Any]) -> None:
            records[int(record["name"][1:])] = record
            bar.done(record)

        _execute(jobs, init, workers, finished)
        override = choose_override(records, what)
        wanted = {u.index: override if override and override["unit"] == u.index else None
                  for u in units}
        redo = [(u, wanted[u.index]) for u in units
                if records[u.index]["override"] != wanted[u.index]]
        _execute(redo, init, workers, finished)
    finally:
        bar.close()
    return records, override, {u.index for u, _ in jobs + redo}


def summary(result: Result, out: Path) -> str:
    """One line about a finished (or already finished) preparation."""
    m = result.manifest
    tr, va = m["splits"]["train"], m["splits"]["val"]
    if result.already:
        return (f"{out} is already prepared ({m['totals']['tokens']:,} tokens); nothing to do")
    dt = max(result.seconds, 1e-9)
    rate = (f"{result.tokens_run / dt / 1e6:.2f} M tok/s, "
            f"{result.documents_run / dt:,.0f} docs/s; " if result.units_run else "")
    return (f"prepared {out}: {m['totals']['documents']:,} documents, "
            f"{m['totals']['tokens']:,} {m['dtype']} tokens (train {tr['tokens']:,} in "
            f"{len(tr['shards'])} shard(s), val {va['tokens']:,}) in {result.seconds:.1f}s "
            f"({rate}{result.units_run} of {m['units']} units run)")
