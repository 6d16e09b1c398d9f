"""Tests of the data package: tokenizer, encoding, sampler, build_data and its cache.

The input formats, the document split and the prepared-dataset format are tested in
tests/test_prepare.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from meshlm.config import ConfigError, DataSection
from meshlm.data import DataBundle, StepSampler, Tokenizer, build_data, train_bpe, val_batches
from meshlm.data.prepare import encode_documents, token_dtype
from meshlm.data.sources import default_source, split_score

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SMALL_FILES = ["abc.py", "bisect.py", "colorsys.py", "fnmatch.py", "glob.py", "heapq.py",
               "keyword.py", "string.py", "textwrap.py", "this.py"]
VOCAB = 400

VARIED = [
    "",
    "hello world",
    "  leading spaces and trailing  ",
    "tabs\tand\nnewlines\r\nand\r carriage returns\n\n\n",
    "def f(x):\n    return {'a': [x ** 2, 3.14e-5]}  # comment\n",
    "unicode: héllo wörld ñ ß Ω 日本語のテキスト 한국어 🚀🔥 \u200b zero-width",
    "mixed <|endoftext|> special token text",
    "\x00\x01 control chars \x7f and emoji family 👨‍👩‍👧",
]


def copy_corpus(dst: Path, names: list[str] = SMALL_FILES) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(STDLIB / name, dst / name)
    return dst


def small_texts() -> list[str]:
    return [(STDLIB / name).read_text() for name in SMALL_FILES]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(small_texts(), VOCAB)


def build(tmp_path: Path, logs: list[str] | None = None, **kw: object) -> DataBundle:
    cfg = DataSection(vocab_size=VOCAB, seq_len=16, cache_dir=str(tmp_path / "cache"))
    for k, v in kw.items():
        setattr(cfg, k, v)
    sink = logs if logs is not None else []
    return build_data(cfg, log=sink.append)


# ------------------------------------------------------------------ tokenizer
@pytest.mark.parametrize("text", VARIED)
def test_round_trip_exact(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_batch_and_ids_in_range(tok: Tokenizer) -> None:
    batch = tok.encode_batch(VARIED)
    assert batch == [tok.encode(t) for t in VARIED]
    assert all(0 <= i < tok.vocab_size for ids in batch for i in ids)
    assert tok.vocab_size == VOCAB
    assert tok.eot_id is not None and tok.decode([tok.eot_id]) == "<|endoftext|>"


def test_training_is_deterministic(tok: Tokenizer) -> None:
    again = train_bpe(small_texts(), VOCAB)
    assert again.tk.to_str() == tok.tk.to_str()
    sample = small_texts()[0]
    assert again.encode(sample) == tok.encode(sample)
    # and it actually compresses: a trained BPE beats one id per byte on code.
    assert len(tok.encode(sample)) < 0.6 * len(sample.encode())


def test_save_load(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    loaded = Tokenizer.load(path)
    assert loaded.vocab_size == tok.vocab_size and loaded.eot_id == tok.eot_id
    assert loaded.encode(VARIED[5]) == tok.encode(VARIED[5])


def test_invalid_tokenizer_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid tokenizer.json"):
        Tokenizer.load(bad)
    corpus = copy_corpus(tmp_path / "c")
    with pytest.raises(ConfigError, match="tokenizer"):
        build(tmp_path, path=str(corpus), tokenizer=str(bad))


def test_eot_alternatives() -> None:
    vocab = {"<unk>": 0, "a": 1, "</s>": 2}
    tk = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    assert Tokenizer(tk).eot_id == 2
    tk = HFTokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    assert Tokenizer(tk).eot_id is None


def test_user_tokenizer_used(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "my_tok.json"
    tok.save(path)
    corpus = copy_corpus(tmp_path / "c")
    b = build(tmp_path, path=str(corpus), tokenizer=str(path), vocab_size=9999)
    assert b.tokenizer.tk.to_str() == tok.tk.to_str()
    # the dataset keeps the very file it was tokenized with (nothing trained)
    assert (b.cache_dir / "tokenizer.json").read_bytes() == path.read_bytes()
    assert b.sources[0][2].manifest["tokenizer"]["trained"] is None


# ------------------------------------------------------------------ encoding
def test_dtype_choice() -> None:
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32


def test_documents_separated_by_eot(tok: Tokenizer) -> None:
    docs = ["first doc", "second\ndoc", "third"]
    tokens, lengths = encode_documents(tok, docs, np.dtype(np.uint16))
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == sum((tok.encode(d) + [tok.eot_id] for d in docs), [])
    assert lengths.tolist() == [len(tok.encode(d)) + 1 for d in docs]


def test_long_document_cut_into_pieces(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    import meshlm.data.prepare as prepare

    monkeypatch.setattr(prepare, "MAX_PIECE_CHARS", 40)
    doc = "line of text\n" * 20
    tokens, lengths = encode_documents(tok, [doc, "x"], np.dtype(np.uint16))
    assert tok.decode(tokens.tolist()) == doc + "<|endoftext|>x<|endoftext|>"
    assert lengths.sum() == len(tokens)


# ------------------------------------------------------------------ corpus
def test_default_corpus_listing() -> None:
    rels = [f.rel for f in default_source().files]
    assert len(rels) > 100 and rels == sorted(rels)
    assert "os.py" in rels and "json/decoder.py" in rels
    banned = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    assert all(r.endswith(".py") for r in rels)
    assert not [r for r in rels if banned & set(r.split("/")[:-1])]
    assert not [r for r in rels if r.startswith("lib2to3/tests")]


@pytest.mark.parametrize("line, reason", [("{broken", "not valid JSON"),
                                          ('{"other": "x"}', "no string field")])
def test_jsonl_bad_line(tmp_path: Path, line: str, reason: str) -> None:
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.txt").write_text("plain text file " * 50)
    lines = [json.dumps({"text": "ok " * 30})] * 2 + [line]
    (folder / "b.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=rf"b\.jsonl:3: {reason}"):
        build(tmp_path, path=str(folder), val_fraction=0.5)


def test_missing_and_empty_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        build(tmp_path, path=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(ConfigError, match="no non-empty text files"):
        build(tmp_path, path=str(tmp_path / "empty"))


def test_corpus_too_small(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.txt").write_text("tiny")
    (folder / "b.txt").write_text("small")
    with pytest.raises(ConfigError, match=r"data\.path=.*data\.seq_len=16"):
        build(tmp_path, path=str(folder))


# ------------------------------------------------------------------ build_data + cache
def test_build_then_cached(tmp_path: Path) -> None:
    corpus = copy_corpus(tmp_path / "c")
    logs: list[str] = []
    b = build(tmp_path, logs, path=str(corpus))
    assert b.train_tokens.dtype == np.uint16 and len(b.val_tokens) > 0
    assert b.cache_dir.parent == tmp_path / "cache"
    assert b.sources == [(str(corpus), 1.0, b.sources[0][2])]
    # text files are whole documents, split by the crc32 of their path (at least one each)
    val = [n for n in SMALL_FILES if split_score(n) < 0.05 * 2**32] or \
        [min(SMALL_FILES, key=split_score)]
    train = [n for n in SMALL_FILES if n not in val]
    tokens = np.asarray(b.train_tokens)
    assert int((tokens == b.tokenizer.eot_id).sum()) == len(train)
    joined = "".join((corpus / n).read_text() + "<|endoftext|>" for n in train)
    assert b.tokenizer.decode(tokens.tolist()) == joined
    assert b.train_tokens.doc_starts.tolist()[0] == 0
    assert len(b.train_tokens.doc_starts) == len(train)
    files = ["tokenizer.json", "manifest.json"]
    mtimes = {f: (b.cache_dir / f).stat().st_mtime_ns for f in files}
    assert not any("already prepared" in line for line in logs)

    logs2: list[str] = []
    b2 = build(tmp_path, logs2, path=str(corpus))
    assert sum("already prepared" in line for line in logs2) == 1
    assert {f: (b2.cache_dir / f).stat().st_mtime_ns for f in files} == mtimes
    assert np.array_equal(b2.train_tokens, b.train_tokens)
    assert np.array_equal(b2.val_tokens, b.val_tokens)


def test_changed_corpus_changes_cache(tmp_path: Path) -> None:
    corpus = copy_corpus(tmp_path / "c")
    b = build(tmp_path, path=str(corpus))
    with open(corpus / "this.py", "a") as f:
        f.write("\n# edited\n")
    b2 = build(tmp_path, path=str(corpus))
    assert b2.cache_dir != b.cache_dir
    b3 = build(tmp_path, path=str(corpus), vocab_size=VOCAB + 20)
    assert b3.cache_dir != b2.cache_dir and b3.tokenizer.vocab_size == VOCAB + 20


def test_corrupt_cache_rebuilt(tmp_path: Path) -> None:
    corpus = copy_corpus(tmp_path / "c")
    b = build(tmp_path, path=str(corpus))
    good = np.array(b.train_tokens)
    shard = b.cache_dir / b.sources[0][2].manifest["splits"]["train"]["shards"][0]["name"]
    del b  # release the mapping before touching the file
    cache = next((tmp_path / "cache").iterdir())
    with open(shard, "r+b") as f:
        f.truncate(100)
    (cache / "tokenizer.json").write_text("garbage")
    logs: list[str] = []
    b2 = build(tmp_path, logs, path=str(corpus))
    assert any("is damaged" in line and "rebuilding" in line for line in logs), logs
    assert np.array_equal(np.asarray(b2.train_tokens), good)
    assert shard.stat().st_size == good.nbytes


# ------------------------------------------------------------------ sampler
def ramp(n: int = 10_000) -> np.ndarray:
    return np.arange(n, dtype=np.uint32) % 60_000  # value == position: windows are checkable


def test_sampler_deterministic_and_windows() -> None:
    tokens = ramp()
    s, s2 = StepSampler(tokens, 32, 8, seed=7), StepSampler(tokens, 32, 8, seed=7)
    a = s.global_batch_at(3)
    assert a.dtype == torch.long and a.shape == (8, 33)
    assert torch.equal(a, s2.global_batch_at(3))
    assert not torch.equal(a, s.global_batch_at(4))
    assert not torch.equal(a, StepSampler(tokens, 32, 8, seed=8).global_batch_at(3))
    # each row is a contiguous window starting at an in-range offset
    assert torch.equal(a - a[:, :1], torch.arange(33).expand(8, 33))
    offs = np.concatenate([s.offsets(k) for k in range(200)])
    assert offs.min() >= 0 and offs.max() <= len(tokens) - 33


def test_sampler_offsets_reach_both_ends() -> None:
    tokens = ramp(40)  # high = 40 - 8 - 1 = 31: few enough values to hit both ends
    s = StepSampler(tokens, 8, 16, seed=0)
    offs = np.concatenate([s.offsets(k) for k in range(50)])
    assert offs.min() == 0 and offs.max() == 31


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("micro", [1, 2])
def test_rank_slices_union_is_global_batch(dp: int, micro: int) -> None:
    s = StepSampler(ramp(), 16, 8, seed=1)
    for step in (0, 5):
        full = s.global_batch_at(step)
        inputs, targets = [], []
        per_rank = [s.rank_micro_batches(step, rank, dp, micro) for rank in range(dp)]
        for i in range(8 // (dp * micro)):  # global micro-batch i: micro-batch i of each rank
            for rank in range(dp):
                x, y = per_rank[rank][i]
                assert x.shape == y.shape == (micro, 16)
                assert torch.equal(y[:, :-1], x[:, 1:])  # targets = inputs shifted by one
                inputs.append(x)
                targets.append(y)
        assert torch.equal(torch.cat(inputs), full[:, :-1])
        assert torch.equal(torch.cat(targets), full[:, 1:])


def test_bad_layout_raises() -> None:
    s = StepSampler(ramp(), 16, 8, seed=1)
    with pytest.raises(ConfigError, match="divisible"):
        s.rank_micro_batches(0, 0, 3, 1)


def test_resume_exact() -> None:
    tokens = ramp()
    ref = StepSampler(tokens, 16, 4, seed=3)
    uninterrupted = [ref.rank_micro_batches(k, 0, 1, 2) for k in range(10)]

    first = StepSampler(tokens, 16, 4, seed=3)
    for k in range(6):
        first.rank_micro_batches(k, 0, 1, 2)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    assert state["next_step"] == 6

    resumed = StepSampler(tokens, 16, 4, seed=3)
    resumed.load_state_dict(state)
    got = [resumed.rank_micro_batches(k, 0, 1, 2) for k in range(resumed.next_step, 10)]
    for a, b in zip(got, uninterrupted[6:], strict=True):
        assert all(torch.equal(x, y) for pa, pb in zip(a, b, strict=True)
                   for x, y in zip(pa, pb, strict=True))


@pytest.mark.parametrize("key, value", [("seed", 4), ("seq_len", 8), ("global_batch", 8)])
def test_resume_mismatch_raises(key: str, value: int) -> None:
    state = StepSampler(ramp(), 16, 4, seed=3).state_dict()
    state[key] = value
    with pytest.raises(ConfigError, match=key):
        StepSampler(ramp(), 16, 4, seed=3).load_state_dict(state)


def test_sampler_rejects_short_tokens() -> None:
    with pytest.raises(ConfigError, match="seq_len=16"):
        StepSampler(ramp(17), 16, 4, seed=0)


def test_val_batches() -> None:
    tokens = ramp(1000)
    vb = val_batches(tokens, 16, 4, 3)
    assert len(vb) == 3 and all(b.shape == (4, 17) for b in vb)
    assert all(torch.equal(a, b) for a, b in zip(vb, val_batches(tokens, 16, 4, 3), strict=True))
    starts = torch.cat(vb)[:, 0]
    assert starts[0] == 0 and starts[-1] == 1000 - 17 and bool((starts.diff() >= 17).all())
    # clamped: only 1000 // 17 = 58 non-overlapping windows fit -> 14 full batches of 4
    assert len(val_batches(tokens, 16, 4, 100)) == 14
    small = val_batches(ramp(40), 16, 4, 3)
    assert len(small) == 1 and small[0].shape == (2, 17)


def test_bundle_feeds_sampler(tmp_path: Path) -> None:
    b = build(tmp_path, path=str(copy_corpus(tmp_path / "c")))
    s = StepSampler(b.train_tokens, 16, 4, seed=0)
    (x, y), = s.rank_micro_batches(0, 0, 1, 4)
    assert x.max() < b.tokenizer.vocab_size and x.min() >= 0
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert val_batches(b.val_tokens, 16, 2, 2)[0].shape == (2, 17)


def test_cache_root_from_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshlm.data import default_cache_root

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "meshlm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_root() == Path(os.path.expanduser("~")) / ".cache" / "meshlm"
