"""Tokenizing a JSONL corpus: ``meshlm prepare`` vs Hugging Face ``datasets`` ``map``.

Both sides tokenize the same generated corpus (``--mb`` MB of JSONL, one document per line:
the standard library's ``.py`` files, cut into pieces of at most 8 KB, repeated in order until
the size is reached; deterministic) with the same tokenizer.json (a byte-level BPE of
``--vocab`` ids trained by meshlm on the first 2 MB), in the same number N of processes:

- meshlm: ``prepare([corpus], out, tokenizer=..., workers=N)`` (reading, splitting, encoding,
  writing uint16 shards with document indexes, hashing, the manifest);
- datasets: ``Dataset.from_json(corpus)`` then ``.map(tokenize, batched=True, num_proc=N)``
  with a ``PreTrainedTokenizerFast`` over the same file (attention masks off), caching disabled
  and every arrow file in a fresh temporary folder, so nothing is reused between runs. Its
  token count adds one end-of-text id per document, as meshlm writes.

Each configuration runs ``--rounds`` times, alternating; the fastest run counts. Times are
wall clock from the call to its return (for datasets: load + map).

    OMP_NUM_THREADS=1 python benchmarks/prepare.py [--mb 32] [--workers 1 2] [--rounds 2]
        [--json benchmarks/results/prepare.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from meshlm.data.prepare import prepare
from meshlm.data.sources import default_source
from meshlm.data.tokenizer import train_bpe

PIECE = 8192


def make_corpus(path: Path, mb: float) -> tuple[int, int]:
    """Write the JSONL corpus; (documents, bytes)."""
    target = int(mb * 1e6)
    files = default_source().files
    n_docs = size = 0
    with open(path, "w") as f:
        while size < target:
            for src in files:
                text = src.path.read_text(errors="replace")
                for start in range(0, len(text), PIECE):
                    line = json.dumps({"text": text[start:start + PIECE]}) + "\n"
                    f.write(line)
                    size += len(line.encode())
                    n_docs += 1
                if size >= target:
                    break
    return n_docs, size


def make_tokenizer(corpus: Path, path: Path, vocab: int) -> None:
    texts, size = [], 0
    with open(corpus) as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size > 2e6:
                break
    train_bpe(texts, vocab).save(path)


def run_meshlm(corpus: Path, tok: Path, workers: int, tmp: Path) -> dict:
    out = tmp / f"meshlm-{workers}"
    t0 = time.perf_counter()
    m = prepare([str(corpus)], out, tokenizer=str(tok), workers=workers,
                log=lambda _m: None).manifest
    dt = time.perf_counter() - t0
    shutil.rmtree(out)
    return {"seconds": dt, "tokens": m["totals"]["tokens"], "documents": m["totals"]["documents"]}


def run_datasets(corpus: Path, tok: Path, workers: int, tmp: Path) -> dict:
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_caching()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    cache = tmp / f"datasets-{workers}"
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok))

    def tokenize(batch: dict) -> dict:
        return {"input_ids": hf(batch["text"], return_attention_mask=False)["input_ids"]}

    t0 = time.perf_counter()
    ds = datasets.Dataset.from_json(str(corpus), cache_dir=str(cache))
    out = ds.map(tokenize, batched=True, num_proc=workers if workers > 1 else None,
                 remove_columns=["text"])
    dt = time.perf_counter() - t0
    lengths = out.map(lambda b: {"n": [len(x) for x in b["input_ids"]]}, batched=True,
                      remove_columns=["input_ids"])["n"]
    shutil.rmtree(cache, ignore_errors=True)
    return {"seconds": dt, "tokens": sum(lengths) + len(lengths), "documents": len(lengths)}


IMPLS = {"meshlm prepare": run_meshlm, "datasets map": run_datasets}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=32)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="meshlm-bench-prepare-"))
    try:
        corpus, tok = tmp / "corpus.jsonl", tmp / "tokenizer.json"
        n_docs, n_bytes = make_corpus(corpus, a.mb)
        make_tokenizer(corpus, tok, a.vocab)
        print(f"corpus: {n_docs:,} documents, {n_bytes / 1e6:.1f} MB of JSONL; tokenizer: "
              f"byte-level BPE, vocab {a.vocab}; {os.cpu_count()} CPUs")
        best: dict[tuple[str, int], dict] = {}
        for _ in range(a.rounds):
            for n in a.workers:
                for name, fn in IMPLS.items():
                    res = fn(corpus, tok, n, tmp)
                    if (name, n) not in best or res["seconds"] < best[name, n]["seconds"]:
                        best[name, n] = res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    rows = []
    for (name, n), r in best.items():
        ref = best["datasets map", n]["seconds"]
        rows.append({"impl": name, "workers": n, "seconds": r["seconds"], "tokens": r["tokens"],
                     "documents": r["documents"], "tokens_per_s": r["tokens"] / r["seconds"],
                     "documents_per_s": r["documents"] / r["seconds"],
                     "speedup_vs_datasets": ref / r["seconds"]})
    rows.sort(key=lambda r: (r["workers"], r["impl"] != "meshlm prepare"))
    print("| N | implementation | seconds | tokens | tokens/s | documents/s | vs datasets |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['impl']} | {r['seconds']:.2f} | {r['tokens']:,} | "
              f"{r['tokens_per_s'] / 1e6:.2f} M | {r['documents_per_s']:,.0f} | "
              f"{r['speedup_vs_datasets']:.2f}x |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "corpus_mb": n_bytes / 1e6, "documents": n_docs, "vocab": a.vocab,
            "rounds": a.rounds, "cpus": os.cpu_count(), "machine": platform.processor() or
            platform.machine(), "rows": rows}, indent=1) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
