"""Tests of ``meshlm prepare`` and of reading prepared datasets (open_prepared, build_data)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

import meshlm.data.prepare as prep
import meshlm.data.shards as shards_mod
from meshlm.cli import main
from meshlm.config import ConfigError, DataSection
from meshlm.data import PreparedDataset, Tokenizer, build_data, open_prepared, train_bpe
from meshlm.data.prepare import prepare
from meshlm.data.sources import split_score

DOCS = [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(5 + i % 9))
        + ("\nünïcödé 日本 🚀" if i % 5 == 0 else "") for i in range(40)]
VAL = 0.3


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(DOCS, 300).save(path)
    return path


def run(inputs: list[Path], out: Path, tok: Path | None = None, **kw: object) -> prep.Result:
    kw.setdefault("val_fraction", VAL)
    kw.setdefault("vocab_size", 300)
    return prepare([str(p) for p in inputs], out, tokenizer=str(tok) if tok else None,
                   log=lambda _m: None, **kw)  # type: ignore[arg-type]


def prepared(inputs: list[Path], out: Path, tok: Path | None = None, **kw: object
             ) -> PreparedDataset:
    run(inputs, out, tok, **kw)
    return open_prepared(out)


def expected_tokens(tok_path: Path, keyed: list[tuple[str, str]], split: str) -> list[int]:
    """The split's tokens computed directly: documents by the crc32 rule, each + eot."""
    tok = Tokenizer.load(tok_path)
    want_val = split == "val"
    texts = [t for k, t in keyed if (split_score(k) < VAL * 2**32) == want_val]
    return sum((tok.encode(t) + [tok.eot_id] for t in texts), [])


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> list[tuple[str, str]]:
    """Write one document per line; (key, text) of each (key: name and byte offset)."""
    lines = [(json.dumps({field: d, "id": i}) + "\n").encode() for i, d in enumerate(docs)]
    offsets = np.cumsum([0] + [len(x) for x in lines])[:-1]
    data = b"".join(lines)
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return [(f"{path.name}:{o}", d) for o, d in zip(offsets, docs, strict=True)]


def make_input(kind: str, tmp: Path) -> tuple[Path, list[tuple[str, str]]]:
    if kind == "text":
        root = tmp / "texts"
        (root / "sub").mkdir(parents=True)
        (root / ".hidden").mkdir()
        (root / ".hidden" / "x.txt").write_text("never read")
        (root / ".skip.txt").write_text("never read")
        (root / "image.png").write_bytes(b"\x89PNG")
        keyed = []
        for i, d in enumerate(DOCS[:12]):
            rel = f"sub/d{i:02d}.md" if i % 3 else f"d{i:02d}.txt"
            (root / rel).write_text(d)
            keyed.append((rel, d))
        return root, sorted(keyed)
    if kind.startswith("jsonl"):
        path = tmp / f"docs.{kind.replace('_', '.')}"
        return path, write_jsonl(path, DOCS)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp / "docs.parquet"
        table = pa.table({"id": list(range(len(DOCS))), "text": DOCS})
        pq.write_table(table, path, row_group_size=15)  # 3 row groups
        return path, [(f"docs.parquet:{i}", d) for i, d in enumerate(DOCS)]
    assert kind == "datasets"
    import datasets

    path = tmp / "hf"
    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(
        str(path), num_shards=2)
    names = [f["filename"] for f in json.loads((path / "state.json").read_text())["_data_files"]]
    half = (len(DOCS) + 1) // 2
    return path, [(f"{names[i // half]}:{i % half}", d) for i, d in enumerate(DOCS)]


# ------------------------------------------------------------------ inputs
@pytest.mark.parametrize("kind", ["text", "jsonl", "jsonl_gz", "jsonl_zst", "parquet",
                                  "datasets"])
def test_input_kinds(kind: str, tmp_path: Path, tok_file: Path) -> None:
    path, keyed = make_input(kind, tmp_path)
    result = run([path], tmp_path / "out", tok_file, unit_bytes=600)
    ds = open_prepared(tmp_path / "out")
    for split in ("train", "val"):
        stream = getattr(ds, split)
        assert stream.dtype == np.uint16
        assert np.asarray(stream).tolist() == expected_tokens(tok_file, keyed, split), split
    assert result.manifest["totals"]["documents"] == len(keyed)
    assert len(ds.train.doc_starts) + len(ds.val.doc_starts) == len(keyed)
    assert ds.tokenizer_sha256 == prep.sha256_file(tok_file)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tok_file.read_bytes()


def test_uint32_for_a_large_vocabulary(tmp_path: Path) -> None:
    vocab = {f"w{i}": i for i in range(69_999)} | {"<|endoftext|>": 69_999}
    tk = HFTokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_path = tmp_path / "big.json"
    tk.save(str(tok_path))
    docs = [f"w{i * 1000} w{69_000 + i} w{i}" for i in range(30)]
    keyed = write_jsonl(tmp_path / "d.jsonl", docs)
    run([tmp_path / "d.jsonl"], tmp_path / "out", tok_path)
    ds = open_prepared(tmp_path / "out")
    assert ds.train.dtype == np.uint32 and ds.manifest["dtype"] == "uint32"
    assert ds.vocab_size == 70_000 and ds.eot_id == 69_999
    for split in ("train", "val"):
        assert np.asarray(getattr(ds, split)).tolist() == expected_tokens(tok_path, keyed, split)


# ------------------------------------------------------------------ determinism and resume
def folder_bytes(out: Path) -> dict[str, bytes]:
    files = {p.relative_to(out).as_posix(): p.read_bytes()
             for p in sorted(out.rglob("*")) if p.is_file() and not p.name.startswith(".")}
    manifest = json.loads(files.pop("manifest.json"))
    manifest.pop("created")
    files["manifest.json"] = json.dumps(manifest).encode()
    return files


def test_two_workers_give_identical_files(tmp_path: Path, tok_file: Path) -> None:
    path, _ = make_input("jsonl", tmp_path)
    one = run([path], tmp_path / "w1", tok_file, unit_bytes=500, workers=1)
    two = run([path], tmp_path / "w2", tok_file, unit_bytes=500, workers=2)
    assert one.manifest["units"] >= 4 and two.units_run == two.manifest["units"]
    assert folder_bytes(tmp_path / "w1") == folder_bytes(tmp_path / "w2")


def test_split_independent_of_units(tmp_path: Path, tok_file: Path) -> None:
    path, _ = make_input("jsonl", tmp_path)
    a = prepared([path], tmp_path / "a", tok_file, unit_bytes=300)
    b = prepared([path], tmp_path / "b", tok_file)
    assert len(a.train.shards) > 1 and len(b.train.shards) == 1
    for split in ("train", "val"):
        sa, sb = getattr(a, split), getattr(b, split)
        assert np.array_equal(sa, sb) and np.array_equal(sa.doc_starts, sb.doc_starts)


def test_resume_redoes_only_what_is_missing(tmp_path: Path, tok_file: Path) -> None:
    path, _ = make_input("jsonl", tmp_path)
    run([path], tmp_path / "ref", tok_file, unit_bytes=500)
    out = tmp_path / "out"
    run([path], out, tok_file, unit_bytes=500)
    (out / "manifest.json").unlink()  # as if stopped before the end
    (out / "units" / "u000002.json").unlink()
    next((out / "shards").glob("u000003.*.bin")).unlink()
    again = run([path], out, tok_file, unit_bytes=500)
    assert again.units_run == 2 and not again.already
    assert folder_bytes(out) == folder_bytes(tmp_path / "ref")


def test_resume_after_an_interruption_mid_unit(tmp_path: Path, tok_file: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = make_input("jsonl", tmp_path)
    run([path], tmp_path / "ref", tok_file, unit_bytes=500)
    real, calls = prep.encode_documents, []

    def stop_on_fifth(*a: object) -> object:
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(prep, "encode_documents", stop_on_fifth)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run([path], out, tok_file, unit_bytes=500)
    assert not (out / "manifest.json").exists()
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]  # nothing half-written
    done = len(list((out / "units").iterdir()))
    # a worker killed outright leaves its temporary file: swept on the next run
    stale = out / "shards" / ".u000001.train.bin.999999999.tmp"
    stale.write_bytes(b"partial")
    monkeypatch.setattr(prep, "encode_documents", real)
    again = run([path], out, tok_file, unit_bytes=500)
    assert again.units_run == again.manifest["units"] - done and not stale.exists()
    assert folder_bytes(out) == folder_bytes(tmp_path / "ref")


def test_rerun_finished_folder(tmp_path: Path, tok_file: Path, capsys: pytest.CaptureFixture[str]
                               ) -> None:
    path, _ = make_input("jsonl", tmp_path)
    out = tmp_path / "out"
    args = ["prepare", str(path), "--out", str(out), "--quiet", "--val-fraction", "0.3"]
    assert main(args + ["--vocab-size", "300"]) == 0
    assert "prepared" in capsys.readouterr().out
    before = folder_bytes(out)
    assert main(args + ["--vocab-size", "300"]) == 0
    assert "already prepared" in capsys.readouterr().out
    # another tokenizer, other inputs: one line, nothing touched
    assert main(args + ["--tokenizer", str(tok_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already prepared from another tokenizer" in err[0]
    (tmp_path / "more.jsonl").write_text(json.dumps({"text": "more"}) + "\n")
    assert main(args + ["--vocab-size", "300", str(tmp_path / "more.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other inputs or settings" in err[0]
    assert folder_bytes(out) == before
    # a second source with the same tokenizer: --tokenizer DIR/tokenizer.json
    assert main(["prepare", str(tmp_path / "more.jsonl"), "--out", str(tmp_path / "o2"),
                 "--quiet", "--tokenizer", str(out / "tokenizer.json")]) == 0
    assert (open_prepared(tmp_path / "o2").tokenizer_sha256
            == open_prepared(out).tokenizer_sha256)


def test_foreign_out_folder_refused(tmp_path: Path, tok_file: Path) -> None:
    path, _ = make_input("jsonl", tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not a dataset folder"):
        run([path], tmp_path / "out", tok_file)
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


# ------------------------------------------------------------------ the split of tiny corpora
def test_split_rule_and_tiny_corpora(tmp_path: Path, tok_file: Path) -> None:
    def splits(docs: list[str], frac: float, name: str) -> tuple[list[int], list[int]]:
        folder = tmp_path / name
        folder.mkdir()
        for i, d in enumerate(docs):
            (folder / f"{i}.txt").write_text(d)
        ds = prepared([folder], tmp_path / f"{name}-out", tok_file, val_fraction=frac)
        return np.asarray(ds.train).tolist(), np.asarray(ds.val).tolist()

    tok = Tokenizer.load(tok_file)
    enc = {d: tok.encode(d) + [tok.eot_id] for d in DOCS[:3]}
    # two files, a tiny fraction: the lower-scoring file is still held out
    train, val = splits(DOCS[:2], 1e-9, "two")
    low = min(range(2), key=lambda i: split_score(f"{i}.txt"))
    assert val == enc[DOCS[low]] and train == enc[DOCS[1 - low]]
    # nearly everything held out: the highest-scoring file is kept for training
    train, val = splits(DOCS[:3], 0.999999, "three")
    high = max(range(3), key=lambda i: split_score(f"{i}.txt"))
    assert train == enc[DOCS[high]] and len(val) == sum(len(enc[d]) for d in DOCS[:3]) - len(
        train)
    # one document: its characters are split, the last val_fraction for validation
    text = "line of text\n" * 100
    train, val = splits([text], 0.1, "one")
    cut = len(text) - len(text) // 10
    assert train == tok.encode(text[:cut]) + [tok.eot_id]
    assert val == tok.encode(text[cut:]) + [tok.eot_id]


def test_held_out_documents_stay_held_out(tmp_path: Path, tok_file: Path) -> None:
    (tmp_path / "c").mkdir()
    keyed = write_jsonl(tmp_path / "c" / "a.jsonl", DOCS)
    run([tmp_path / "c"], tmp_path / "o1", tok_file)
    write_jsonl(tmp_path / "c" / "b.jsonl", DOCS[:10])  # more data: old documents keep sides
    run([tmp_path / "c"], tmp_path / "o2", tok_file)
    v1 = np.asarray(open_prepared(tmp_path / "o1").val)
    v2 = np.asarray(open_prepared(tmp_path / "o2").val)
    assert v1.tolist() == expected_tokens(tok_file, keyed, "val")
    assert v2[: len(v1)].tolist() == v1.tolist() and len(v2) > len(v1)


# ------------------------------------------------------------------ the read side
def test_windows_across_shard_boundaries(tmp_path: Path, tok_file: Path) -> None:
    path, _ = make_input("jsonl", tmp_path)
    run([path], tmp_path / "out", tok_file, unit_bytes=200)
    train = open_prepared(tmp_path / "out").train
    whole = np.asarray(train)
    assert len(train.shards) > 5 and len(train) == len(whole) == train.ends[-1]
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(train) - 33, size=(16, 1))[:, :] + np.arange(33)
    assert np.array_equal(train[idx], whole[idx]) and train[idx].shape == (16, 33)
    edges = np.concatenate([train.ends[:-1] - 1, train.ends[:-1]]).astype(np.int64)
    assert np.array_equal(train[edges], whole[edges])
    assert train[5] == whole[5] and np.array_equal(train[3:40:2], whole[3:40:2])
    starts = train.doc_starts
    assert starts[0] == 0 and np.all(np.diff(starts) > 0)
    assert set(train.starts.tolist()) <= set(starts.tolist())
    assert np.all(whole[starts[1:] - 1] == Tokenizer.load(tok_file).eot_id)
    with pytest.raises(IndexError, match="out of bounds"):
        train[np.array([len(train)])]


def test_damaged_datasets_refused(tmp_path: Path, tok_file: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = make_input("jsonl", tmp_path)
    out = tmp_path / "out"
    manifest = run([path], out, tok_file, unit_bytes=500).manifest
    hashed: list[str] = []

    def counting(p: Path) -> str:
        hashed.append(p.name)
        return prep.sha256_file(p)

    monkeypatch.setattr(shards_mod, "sha256_file", counting)
    open_prepared(out)  # verifies and remembers the hashes
    assert len(hashed) == 2 * sum(len(s["shards"]) for s in manifest["splits"].values()) + 1
    hashed.clear()
    open_prepared(out)  # a second open of an unchanged dataset hashes the tokenizer only
    assert hashed == ["tokenizer.json"]
    shard = out / manifest["splits"]["train"]["shards"][1]["name"]
    good = shard.read_bytes()

    shard.write_bytes(good[:-2])
    with pytest.raises(ConfigError, match=rf"{shard.name} is truncated or altered: expected "
                       rf"{len(good)} bytes, found {len(good) - 2}"):
        open_prepared(out)
    shard.write_bytes(good[:10] + bytes([good[10] ^ 1]) + good[11:])
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # an edit made later
    with pytest.raises(ConfigError, match=rf"{shard.name} was altered"):
        open_prepared(out)
    shard.unlink()
    with pytest.raises(ConfigError, match=rf"{shard.name} is missing"):
        open_prepared(out)
    (out / "manifest.json").write_text("{oops")
    with pytest.raises(ConfigError, match="manifest .* is unreadable or corrupt"):
        open_prepared(out)
    (out / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="unfinished meshlm prepare"):
        open_prepared(out)
    with pytest.raises(ConfigError, match="is not a prepared dataset"):
        open_prepared(tmp_path)


# ------------------------------------------------------------------ build_data
def data_cfg(tmp_path: Path, **kw: object) -> DataSection:
    cfg = DataSection(vocab_size=300, seq_len=8, cache_dir=str(tmp_path / "cache"),
                      val_fraction=VAL)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_build_data_raw_and_prepared(tmp_path: Path, tok_file: Path) -> None:
    path, _ = make_input("jsonl", tmp_path)
    raw = build_data(data_cfg(tmp_path, path=str(path)), log=lambda _m: None)
    assert raw.cache_dir.parent == tmp_path / "cache"
    assert (raw.cache_dir / "manifest.json").is_file()
    out = tmp_path / "prepared"
    run([path], out, tok_file)
    b = build_data(data_cfg(tmp_path, path=str(out)), log=lambda _m: None)
    assert b.cache_dir == out and b.sources[0][:2] == (str(out), 1.0)
    assert np.array_equal(b.train_tokens, open_prepared(out).train)
    assert b.tokenizer.vocab_size == b.vocab_size == Tokenizer.load(tok_file).vocab_size
    # a raw corpus with data.tokenizer gives the same tokens as meshlm prepare --tokenizer
    c = build_data(data_cfg(tmp_path, path=str(path), tokenizer=str(tok_file)),
                   log=lambda _m: None)
    assert np.array_equal(c.train_tokens, b.train_tokens)


def test_mix(tmp_path: Path, tok_file: Path) -> None:
    a, _ = make_input("jsonl", tmp_path)
    b = tmp_path / "b.jsonl"
    write_jsonl(b, DOCS[::-1])
    run([a], tmp_path / "A", tok_file)
    run([b], tmp_path / "B", tok_file)
    run([b], tmp_path / "C", vocab_size=280)  # a trained BPE: another tokenizer
    bundle = build_data(data_cfg(tmp_path, mix=f"{tmp_path / 'A'}:3,{tmp_path / 'B'}:1"),
                        log=lambda _m: None)
    assert [(n, w) for n, w, _ in bundle.sources] == [(str(tmp_path / "A"), 0.75),
                                                      (str(tmp_path / "B"), 0.25)]
    assert np.array_equal(bundle.train_tokens, bundle.sources[0][2].train)
    with pytest.raises(ConfigError, match=r"data\.mix: .*'.*A' and '.*C' were prepared with "
                       "different tokenizers"):
        build_data(data_cfg(tmp_path, mix=f"{tmp_path / 'A'}:1,{tmp_path / 'C'}:1"),
                   log=lambda _m: None)
    with pytest.raises(ConfigError, match=r"dataset .*C was prepared with another tokenizer "
                       r"than data\.tokenizer=.*: fingerprints"):
        build_data(data_cfg(tmp_path, path=str(tmp_path / "C"), tokenizer=str(tok_file)),
                   log=lambda _m: None)


# ------------------------------------------------------------------ bad input: one line each
def cli_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["prepare", *args, "--quiet", "--vocab-size", "300"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out0")
    lines = [json.dumps({"text": d}) for d in DOCS[:30]]
    lines[25] = '{"text": "broken'
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    # in a later work unit than the first: the line number still counts from the file's start
    assert main(["prepare", str(tmp_path / "bad.jsonl"), "--out", out, "--quiet",
                 "--unit-mb", "0.0005", "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:26: not valid JSON" in err[0]

    # a compressed file is read as a stream; its line numbers count too
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    assert "bad.jsonl.gz:26: not valid JSON" in cli_line(
        [str(tmp_path / "bad.jsonl.gz"), "--out", str(tmp_path / "out5")], capsys)

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"], "id": [1]}), tmp_path / "t.parquet")
    assert "t.parquet: no column 'text' (columns: body, id" in cli_line(
        [str(tmp_path / "t.parquet"), "--out", str(tmp_path / "out1")], capsys)
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n\n')
    assert "holds no documents" in cli_line(
        [str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "out2")], capsys)
    assert "does not exist" in cli_line(
        [str(tmp_path / "nope"), "--out", str(tmp_path / "out3")], capsys)
    (tmp_path / "a.tar.bz2").write_bytes(b"BZh9")
    assert "unknown input type" in cli_line(
        [str(tmp_path / "a.tar.bz2"), "--out", str(tmp_path / "out4")], capsys)
    assert not list(tmp_path.glob("out*/manifest.json"))
