"""One GPU, measured: meshlm's trainer against a plain PyTorch loop, with the planner alongside.

Measures, on one GPU (an H100 or H200; no internet needed), training throughput (tokens/s,
median step time of the timed steps after warm-up), MFU against the datasheet peak, and peak
memory allocated by PyTorch (``torch.cuda.max_memory_allocated``; for meshlm rows the trainer's
own per-phase peaks, construction included), for:

- the "820M" shape of ``../shared/data/gpu_h200_2026-11.md`` (``small`` with 16 layers, dim
  2048, 16 heads, 8 KV heads, FFN 5632, seq 2048, vocab 32000, tied head; global batch 8 =
  micro-batch 8): meshlm eager and compiled (``train.compile=true``) in bf16, meshlm eager in
  fp32 and fp16, and a plain PyTorch loop written below (same Llama shapes and tied head,
  ``nn.Linear``, ``nn.RMSNorm``, rotate-half RoPE, causal SDPA with GQA, fp32 cross-entropy,
  ``torch.optim.AdamW(fused=True)``, ``clip_grad_norm_``, bf16 autocast), eager and with the
  whole model ``torch.compile``'d;
- ``llama3-8b`` at vocab 32000, seq 2048, global batch 2 of micro-batch 1,
  ``train.recompute=full train.loss=chunked``: on the GPU alone (run only where meshlm's
  planner says it fits; ``--force`` runs it anyway) and with ``parallel.offload=cpu``;
- not in the default run (``--rows``, below), FP8 against bf16, all compiled, at the Llama 3
  8B layer shapes (dim 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256, seq 2048) with 8
  layers and micro-batch 2 = global batch 2 (2.8 B parameters, 1.75 B of them in the blocks;
  about 46 GiB by the planner): ``precision.dtype=bf16``, and ``precision.dtype=fp8`` with
  ``precision.fp8_recipe=tensorwise`` and ``rowwise``. Each runs exactly 100 steps (5 warm-up,
  95 timed) from the same seed and batches on a learnable synthetic corpus (Zipf words, every
  other one the fixed successor of the word before), answering the FP8 goal in one run:
  tokens/s ratios ``fp8_tensorwise_vs_bf16_compiled`` and ``fp8_rowwise_vs_bf16_compiled``
  (goal >= 1.2), and the loss after step 100 of each fp8 row against bf16's (goal: relative
  difference < 1 %). Eight layers, not 32: the full model's fp32 weights, gradients and
  AdamW states (128 GB) exceed one GPU, while with 4 layers the bf16 LM head would carry 38 %
  of the linear FLOPs (8 layers: 23 %, the full 8B: 7 %); the speedup measured here
  understates the full 8B's.

Next to each row: the planner's predicted step time, tokens/s, MFU and memory for that config
(``meshlm plan`` through ``planner.cli.config_workload`` / ``hardware_here`` and
``planner.search.evaluate``; ``kernels="fused"`` for compiled rows; the plain rows get the
prediction of the meshlm config they mirror). "plan alloc" is the planner's total less its
``reserved`` entry (CUDA context and libraries), the figure to hold against measured allocation.

Each row runs in a process of its own with a time limit (an out-of-memory row is recorded with
its error line and the run goes on), driving meshlm's real ``Trainer`` (``train_step`` plus
its per-step metrics record, written to ``metrics.jsonl`` in a temporary run directory and
read back). The data is synthetic and offline: random words over a word-level tokenizer of
exactly the model's vocabulary, generated once under the meshlm cache folder and read through
meshlm's normal data path (``data.path`` + ``data.tokenizer``), so no BPE is trained.

    PYTHONPATH=src python benchmarks/gpu.py                 # one GPU, about 5-6 minutes
    PYTHONPATH=src python benchmarks/gpu.py --rows meshlm-eager,plain-eager
    PYTHONPATH=src python benchmarks/gpu.py --tiny          # the same code on CPU, ~1-2 min
    PYTHONPATH=src python benchmarks/gpu.py --rows 8b-layers-bf16,8b-layers-fp8-tensorwise,8b-layers-fp8-rowwise
                                                            # the FP8 goal, about 5-9 minutes

The fp8 rows need torchao (``pip install "meshlm[fp8]"``); where it is missing they are
recorded as skipped with the reason. A GPU machine without internet gets it as a wheel:
``pip download torchao==0.18.0 --no-deps`` where there is internet, then ``pip install
--no-deps torchao-0.18.0-*.whl`` there. torchao 0.18.0 suits torch 2.11: its wheel
(``cp310-abi3``, any Python >= 3.10) declares no torch requirement, its ``__init__`` loads its
C++ extensions only on torch >= 2.11.0, and float8 training needs none of them (Python casts
and ``torch._scaled_mm``; a failed extension load is a logged warning).

``--tiny`` runs every row on CPU with a tiny model (hidden 64, 2 layers, seq 32, vocab 320;
``llama3-8b`` replaced by the ``tiny`` preset with the same recompute / loss / offload keys,
the 8B layer shapes by ``tiny`` with 8 heads, 2 KV heads, FFN 224, batch 2, 6 steps), where
memory is the growth of peak resident memory over the process's resident memory before
the model was built. There the 8B-layer rows (fp8 and their bf16 baseline) run eager: compiling
three more models costs about 2 CPU-minutes, the rows' own machinery (measurement, plan, ratios,
loss check) is the same, and compiled float8 training is checked against eager in
``tests/test_fp8.py``; their ratios are named ``..._vs_bf16_eager``. GPU numbers come only
from a GPU run. Writes JSON to ``--json``
(default ``benchmarks/results/gpu.json``, or ``gpu_tiny.json`` with ``--tiny``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from _harness import peak_rss_bytes, rss_bytes
from torch import nn

from meshlm.config import Config, load_config, resolve_world
from meshlm.models.config import ModelConfig
from meshlm.train.oom import is_oom

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"


# ---------------------------------------------------------------------- rows
@dataclass(frozen=True)
class Row:
    """One measured configuration."""

    name: str
    impl: str  # "meshlm" (the trainer) | "plain" (the loop below)
    shape: str  # "820m" | "8b" | "8b-layers"
    dtype: str = "bf16"
    compiled: bool = False
    extra: tuple[str, ...] = ()  # further meshlm overrides
    needs_fit: bool = False  # run only where the planner says it fits (unless --force)
    note: str = ""
    corpus: str = "uniform"  # synthetic words: "uniform" | "zipf" (learnable, see below)
    default: bool = True  # in the run without --rows


# the Llama 3 8B decoder layer (dim 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256, seq
# 2048) with 8 layers: 1.75 B block parameters of 2.8 B (untied embedding and head, bf16 in
# every row), so the float8 linears carry 77 % of the linear FLOPs (the full 8B: 93 %) and
# weights, gradients and AdamW states (45 GB) leave room for micro-batch 2 on an 80 GB H100
FP8_NOTE = "8B layers x8, mb 2, compiled, "
FP8_ROWS: tuple[Row, ...] = (
    Row("8b-layers-bf16", "meshlm", "8b-layers", compiled=True, corpus="zipf", default=False,
        note=FP8_NOTE + "bf16 (the fp8 baseline)"),
    Row("8b-layers-fp8-tensorwise", "meshlm", "8b-layers", dtype="fp8", compiled=True,
        extra=("--precision.fp8_recipe=tensorwise",), corpus="zipf", default=False,
        note=FP8_NOTE + "fp8 tensorwise"),
    Row("8b-layers-fp8-rowwise", "meshlm", "8b-layers", dtype="fp8", compiled=True,
        extra=("--precision.fp8_recipe=rowwise",), corpus="zipf", default=False,
        note=FP8_NOTE + "fp8 rowwise"),
)
# in the order they run: when the time budget runs short, the last rows are skipped
ROWS: tuple[Row, ...] = (
    Row("plain-eager", "plain", "820m", note="plain PyTorch loop, bf16 autocast"),
    Row("meshlm-eager", "meshlm", "820m", note="meshlm bf16"),
    Row("plain-compiled", "plain", "820m", compiled=True, note="plain loop, torch.compile(model)"),
    Row("meshlm-compiled", "meshlm", "820m", compiled=True, note="meshlm bf16 train.compile=true"),
    Row("8b", "meshlm", "8b", needs_fit=True, note="llama3-8b, no offload"),
    Row("8b-offload", "meshlm", "8b", extra=("--parallel.offload=cpu",),
        note="llama3-8b, parallel.offload=cpu"),
    Row("meshlm-fp16", "meshlm", "820m", dtype="fp16", note="meshlm precision.dtype=fp16"),
    Row("meshlm-fp32", "meshlm", "820m", dtype="fp32", note="meshlm precision.dtype=fp32"),
    *FP8_ROWS,
)
ROW_NAMES = tuple(r.name for r in ROWS)
DEFAULT_ROWS = tuple(r.name for r in ROWS if r.default)
FP8_ROW_NAMES = tuple(r.name for r in FP8_ROWS)
# every step of the fp8 rows counts for the loss check: warm-up + timed = these many steps
LOSS_STEPS, TINY_LOSS_STEPS = 100, 6
LOSS_GOAL = 0.01  # |fp8 - bf16| / bf16 of the loss after LOSS_STEPS steps
TORCHAO_CARRY = ("torchao is not installed (GPU image, no internet): pip download "
                 "torchao==0.18.0 --no-deps where there is internet, carry the wheel, "
                 "pip install --no-deps torchao-0.18.0-*.whl here")


@dataclass(frozen=True)
class Budget:
    """Steps and wall-clock limit of one row."""

    warmup: int
    steps: int
    limit_s: float


def budget(row: Row, tiny: bool) -> Budget:
    """Warm-up steps, timed steps, and the row's time limit (process start to exit)."""
    if row.shape == "8b-layers":  # warm-up + timed = the loss check's steps
        if tiny:
            return Budget(2, TINY_LOSS_STEPS - 2, 240.0)
        return Budget(5, LOSS_STEPS - 5, 180.0)
    if tiny:
        limit = 240.0 if row.compiled else 90.0
        return Budget(2 if row.compiled else 1, 2 if row.name == "8b-offload" else 3, limit)
    if row.shape == "8b":  # offload: about 8 s per step (host AdamW over 7.24 B parameters)
        return Budget(1, 2, 90.0) if "offload" in row.name else Budget(2, 5, 80.0)
    if row.compiled:
        return Budget(3, 12, 110.0 if row.impl == "plain" else 80.0)
    if row.dtype == "fp32":
        return Budget(2, 6, 50.0)
    return Budget(3, 12, 45.0)


# ---------------------------------------------------------------------- shapes and data
GPU_SHAPES: dict[str, list[str]] = {
    "820m": ["--model.preset=small", "--model.n_layers=16", "--model.dim=2048",
             "--model.n_heads=16", "--model.n_kv_heads=8", "--model.ffn_hidden=5632",
             "--model.max_seq_len=2048", "--data.seq_len=2048",
             "--train.global_batch=8", "--train.micro_batch=8"],
    "8b": ["--model.preset=llama3-8b", "--data.seq_len=2048", "--train.global_batch=2",
           "--train.micro_batch=1", "--train.recompute=full", "--train.loss=chunked"],
    "8b-layers": ["--model.preset=llama3-8b", "--model.n_layers=8", "--data.seq_len=2048",
                  "--train.global_batch=2", "--train.micro_batch=2"],
}
TINY_SHAPES: dict[str, list[str]] = {
    "820m": ["--model.preset=small", "--model.n_layers=2", "--model.dim=64",
             "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_hidden=176",
             "--model.max_seq_len=64", "--data.seq_len=32",
             "--train.global_batch=4", "--train.micro_batch=4"],
    "8b": ["--model.preset=tiny", "--model.max_seq_len=64", "--data.seq_len=32",
           "--train.global_batch=2", "--train.micro_batch=1", "--train.recompute=full",
           "--train.loss=chunked", "--train.loss_chunk=16"],
    # the 8B layer's ratios: 4:1 grouped-query attention, FFN 3.5 x dim
    "8b-layers": ["--model.preset=tiny", "--model.n_heads=8", "--model.n_kv_heads=2",
                  "--model.ffn_hidden=224", "--model.max_seq_len=64", "--data.seq_len=32",
                  "--train.global_batch=2", "--train.micro_batch=2"],
}
GPU_VOCAB, TINY_VOCAB = 32000, 320
SHAPE_VOCAB = {"8b-layers": 128256}  # on the GPU; every --tiny row has TINY_VOCAB
# synthetic corpus: files x words per file (random windows are drawn from it, so it need
# only hold a few windows; 5 % of the files are the validation split)
GPU_CORPUS, TINY_CORPUS = (24, 25_000), (24, 400)


def corpus_ids(rng: np.random.Generator, vocab: int, words: int, corpus: str) -> np.ndarray:
    """``words`` word ids in ``[2, vocab)``. ``uniform``: independent uniform draws (nothing to
    learn: the loss stays near ln(vocab)). ``zipf``: a Zipf(1.1) unigram draw, but every other
    word on average is instead the fixed successor of the word before it (a random
    permutation), so a model lowers its loss by learning the unigram frequencies and, for the
    frequent words, their successors -- a loss curve to compare precisions on."""
    n = vocab - 2
    if corpus == "uniform":
        return rng.integers(2, vocab, size=words)
    p = 1.0 / np.arange(1, n + 1) ** 1.1
    draw = rng.choice(n, size=words, p=p / p.sum()) + 2
    follow = rng.random(words) < 0.5
    succ = (rng.permutation(n) + 2).tolist()
    out = draw.tolist()
    for i in range(1, words):
        if follow[i]:
            out[i] = succ[out[i - 1] - 2]
    return np.asarray(out)


def synthetic_data(cache: Path, vocab: int, files: int, words: int,
                   corpus: str = "uniform") -> tuple[Path, Path]:
    """(text folder, tokenizer.json): a word-level tokenizer of exactly ``vocab`` ids
    (end-of-text, unknown, ``w2`` ... ``w{vocab-1}``) and ``files`` files of ``words`` random
    words (:func:`corpus_ids`). Written once (atomically) under ``cache``; later runs reuse it
    unchanged, so meshlm's token cache, keyed by paths and modification times, is reused as
    well."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    kind = "" if corpus == "uniform" else f"-{corpus}"
    folder = cache / "gpu-benchmark-data" / f"v{vocab}-{files}x{words}{kind}"
    text, tok = folder / "text", folder / "tokenizer.json"
    if tok.is_file() and text.is_dir():
        return text, tok
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    ids = {EOT: 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tk = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([EOT])
    (tmp / "text").mkdir()
    rng = np.random.default_rng(0)
    for i in range(files):
        draw = corpus_ids(rng, vocab, words, corpus)
        (tmp / "text" / f"doc_{i:03d}.txt").write_text(" ".join(f"w{x}" for x in draw) + "\n")
    tk.save(str(tmp / "tokenizer.json"))
    try:
        os.rename(tmp, folder)
    except OSError:  # another process wrote it first: use theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return text, tok


def default_cache() -> Path:
    from meshlm.data import default_cache_root

    return default_cache_root()


def row_config(row: Row, tiny: bool, run_dir: Path, cache: Path,
               peak_flops: float = 0.0) -> Config:
    """The meshlm config of ``row`` (for plain rows: the meshlm config it mirrors)."""
    vocab = TINY_VOCAB if tiny else SHAPE_VOCAB.get(row.shape, GPU_VOCAB)
    files, words = TINY_CORPUS if tiny else GPU_CORPUS
    text, tok = synthetic_data(cache, vocab, files, words, row.corpus)
    shape = (TINY_SHAPES if tiny else GPU_SHAPES)[row.shape]
    args = [*shape, f"--data.path={text}", f"--data.tokenizer={tok}",
            f"--data.cache_dir={cache}", f"--data.vocab_size={vocab}",
            f"--precision.dtype={row.dtype}", f"--train.compile={str(row.compiled).lower()}",
            "--train.steps=1000000", "--train.eval_every=0", "--train.log_every=1000000",
            f"--run.dir={run_dir}", "--run.sample_tokens=0", *row.extra]
    if peak_flops > 0:
        args.append(f"--train.peak_flops={peak_flops}")
    return resolve_world(load_config(None, args), None)


# ---------------------------------------------------------------------- planner
def predict(cfg: Config, compiled: bool) -> dict[str, Any]:
    """The planner's step time, throughput and memory for ``cfg`` on this machine."""
    from meshlm.planner.cli import config_vocab, config_workload, hardware_here
    from meshlm.planner.search import evaluate

    work = config_workload(cfg, config_vocab(cfg))
    if compiled:
        work = replace(work, kernels="fused")
    hw = hardware_here("benchmarks/gpu.py")
    plan = evaluate(work, cfg.layout(), hw, 1)
    m = plan.memory
    out: dict[str, Any] = {
        "hardware": hw.name, "kernels": work.kernels, "layout": cfg.layout().describe(),
        "fits": plan.fits, "problems": plan.problems,
        "mem_total_bytes": m.total, "mem_alloc_bytes": m.total - m.items.get("reserved", 0.0),
        "mem_capacity_bytes": m.capacity, "mem_items": m.items,
        "mem_host_bytes": dict(m.host),
    }
    if plan.time is not None:
        out.update(step_time_s=plan.time.step, tokens_per_s=plan.time.tokens_per_s,
                   mfu=plan.time.mfu)
    return out


# ---------------------------------------------------------------------- the plain loop
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(head_dim: int, seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class PlainBlock(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = c.n_heads, c.n_kv_heads, c.hd
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.wq = nn.Linear(c.dim, c.n_heads * c.hd, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.hd, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.hd, bias=False)
        self.wo = nn.Linear(c.n_heads * c.hd, c.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.w1 = nn.Linear(c.dim, c.ffn_hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_hidden, bias=False)
        self.w2 = nn.Linear(c.ffn_hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, s, self.nh, self.hd).transpose(1, 2)
        k = self.wk(h).view(b, s, self.nkv, self.hd).transpose(1, 2)
        v = self.wv(h).view(b, s, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if SDPA_GQA:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            rep = self.nh // self.nkv
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                               v.repeat_interleave(rep, 1), is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class PlainLlama(nn.Module):
    """The Llama decoder as a user would write it, shapes and tied head as meshlm's."""

    def __init__(self, c: ModelConfig, seq: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(PlainBlock(c) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(c.hd, seq, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=c.init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x, self.cos[:s], self.sin[:s])
        return self.output(self.norm(x))


class PlainLoop:
    """Synthetic random tokens -> forward (autocast) -> fp32 cross-entropy -> backward ->
    clip -> fused AdamW; the loss read back every step."""

    def __init__(self, cfg: Config, model_cfg: ModelConfig, device: torch.device) -> None:
        from meshlm.precision import DTYPES

        self.cfg, self.device = cfg, device
        self.seq, t = cfg.data.seq_len, cfg.train
        self.micro, self.n_micro = t.micro_batch, t.global_batch // t.micro_batch
        self.vocab, self.dtype = model_cfg.vocab_size, DTYPES[cfg.precision.dtype]
        torch.manual_seed(t.seed)
        with torch.device(device):  # built and initialised where it trains
            self.model = PlainLlama(model_cfg, self.seq)
        params = list(self.model.parameters())  # (the tied weight once)
        self.opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
        if t.compile:  # inductor's caches where meshlm's compiled rows keep theirs
            from meshlm.data import cache_root
            from meshlm.parallel.compile import configure_cache

            configure_cache(cache_root(cfg.data))
        self.forward = torch.compile(self.model) if t.compile else self.model
        self.gen = torch.Generator(device=device).manual_seed(t.seed)
        self.clip = t.grad_clip

    def step(self) -> float:
        total = torch.zeros((), device=self.device)
        for _ in range(self.n_micro):
            x = torch.randint(0, self.vocab, (self.micro, self.seq + 1), device=self.device,
                              generator=self.gen)
            with torch.autocast(self.device.type, dtype=self.dtype,
                                enabled=self.dtype != torch.float32):
                logits = self.forward(x[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            (loss / self.n_micro).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(total) / self.n_micro


# ---------------------------------------------------------------------- one row (child)
def error_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


CPU_PEAK_SOURCE = "CPU fp32 matmul rate (256 x 256), every dtype (--tiny)"


def fp8_unavailable(row: Row) -> str | None:
    """Why ``row`` cannot run here (an fp8 row without torchao), or None."""
    if row.dtype != "fp8":
        return None
    from meshlm.parallel.float8 import torchao_available

    return None if torchao_available() else TORCHAO_CARRY


def cpu_peak() -> float:
    """The MFU denominator of a ``--tiny`` row: this CPU's fp32 matmul rate, for every dtype
    (where bf16 / fp16 matmuls run through a slow fallback, their own rate would put a tiny
    model above 100 %)."""
    from meshlm.matmul_rate import measure_matmul_flops

    return measure_matmul_flops(torch.float32, n=256, seconds=0.05)


class RowRun:
    """Runs one row in this process, writing its result to ``out`` after every step."""

    def __init__(self, row: Row, tiny: bool, out: Path, work: Path, cache: Path,
                 deadline: float, force: bool) -> None:
        self.row, self.tiny, self.out, self.deadline, self.force = row, tiny, out, deadline, force
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else (
            torch.device("cpu"))
        self.bud = budget(row, tiny)
        self.run_dir = work / f"run-{row.name}"
        self.cache = cache
        self.times: list[float] = []  # timed steps only
        self.res: dict[str, Any] = {"row": row.name, "impl": row.impl, "shape": row.shape,
                                    "dtype": row.dtype, "compiled": row.compiled,
                                    "note": row.note, "status": "running",
                                    "device": self.device_name(), "warmup_steps": self.bud.warmup}

    def device_name(self) -> str:
        return torch.cuda.get_device_name() if self.cuda else "cpu"

    def write(self) -> None:
        if self.times:
            med = statistics.median(self.times)
            tps = self.res["tokens_per_step"] / med
            self.res.update(steps=len(self.times), step_time_s=med, step_times_s=self.times,
                            tokens_per_s=tps,
                            mfu=tps * self.res["flops_per_token"] / self.res["peak_flops"])
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.res, indent=1))
        os.replace(tmp, self.out)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, step_fn: Any) -> None:
        """Warm-up steps, then timed steps until the budget or the deadline."""
        for _ in range(self.bud.warmup):
            step_fn()
            self.sync()
        self.res["warmup_done_s"] = round(time.time() - self.start, 2)
        for _ in range(self.bud.steps):
            last = self.times[-1] if self.times else 0.0
            if self.times and time.time() + 1.5 * last + 2.0 > self.deadline:
                self.res["stopped_early"] = "time limit"
                break
            t0 = time.perf_counter()
            step_fn()
            self.sync()
            self.times.append(time.perf_counter() - t0)
            self.write()

    def run(self) -> int:
        self.start = time.time()
        missing = fp8_unavailable(self.row)
        if missing:
            self.res.update(status="skipped", error=missing, wall_s=0.0)
            self.write()
            return 0
        peak = cpu_peak() if not self.cuda else 0.0
        cfg = row_config(self.row, self.tiny, self.run_dir, self.cache, peak)
        self.res["config"] = [f"{k}" for k in self.config_args(cfg)]
        try:
            self.res["plan"] = predict(cfg, self.row.compiled)
        except Exception as e:  # the measurement still runs; the report says why
            self.res["plan"] = {"error": error_line(e)}
        self.write()
        plan = self.res["plan"]
        if self.row.needs_fit and not self.force and plan.get("fits") is False:
            self.res["status"] = "skipped"
            self.res["error"] = (f"planner: needs {plan['mem_total_bytes'] / GIB:.1f} GiB of "
                                 f"{plan['mem_capacity_bytes'] / GIB:.1f} (--force runs it)")
            self.write()
            return 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.base_rss = rss_bytes()
        try:
            if self.row.impl == "plain":
                self.run_plain(cfg)
            else:
                self.run_meshlm(cfg)
            self.res["status"] = "ok"
        except BaseException as e:  # noqa: BLE001 -- every failure is a row outcome
            if isinstance(e, KeyboardInterrupt):
                raise
            self.res["status"] = "oom" if is_oom(e) else "error"
            self.res["error"] = error_line(e)
            self.res["traceback_tail"] = traceback.format_exc().splitlines()[-6:]
        self.res["wall_s"] = round(time.time() - self.start, 2)
        self.write()
        return 0

    @staticmethod
    def config_args(cfg: Config) -> list[str]:
        m, t = cfg.model, cfg.train
        return [f"model.preset={m.preset}", f"seq_len={cfg.data.seq_len}",
                f"global_batch={t.global_batch}", f"micro_batch={t.micro_batch}",
                f"recompute={t.recompute}", f"loss={t.loss}", f"compile={t.compile}",
                f"precision={cfg.precision.dtype}", f"offload={cfg.parallel.offload}",
                *([f"fp8_recipe={cfg.precision.fp8_recipe}"] * (cfg.precision.dtype == "fp8"))]

    def run_meshlm(self, cfg: Config) -> None:
        from meshlm.parallel.compile import compile_stats
        from meshlm.train.metrics import MetricsWriter, read_metrics
        from meshlm.train.trainer import Trainer

        trainer = Trainer(cfg, log=lambda m: print(m, flush=True), progress=False)
        model_cfg, recorder = trainer.model_part.model_cfg, trainer.recorder
        self.res.update(params=model_cfg.num_params(), vocab=model_cfg.vocab_size,
                        tokens_per_step=trainer.batches.tokens_per_step,
                        flops_per_token=recorder.flops_per_token, peak_flops=recorder.peak,
                        peak_flops_source=recorder.peak_source if self.cuda else CPU_PEAK_SOURCE)
        writer = MetricsWriter(trainer.run_dir)
        step = 0

        def one() -> None:
            nonlocal step
            step += 1
            t0 = time.perf_counter()
            loss, grad_norm = trainer.train_step(step)
            self.sync()
            writer.write(trainer.record(step, loss, grad_norm, time.perf_counter() - t0))

        try:
            self.timed(one)
        finally:
            writer.close()
            self.res["mem_phases_bytes"] = dict(trainer.memory.phases)
            if cfg.train.compile:
                self.res["compile"] = compile_stats()
        records = read_metrics(trainer.run_dir / "metrics.jsonl")
        timed = records[self.bud.warmup:]
        self.res["final_loss"] = records[-1]["loss"]
        self.res["losses"] = [r["loss"] for r in records]  # every step, warm-up included
        self.res["trainer_mfu"] = statistics.median(r["mfu"] for r in timed)
        self.res["trainer_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in timed)
        if "skipped_steps" in records[-1]:
            self.res["fp16_skipped_steps"] = records[-1]["skipped_steps"]
        phases = dict(trainer.memory.phases)
        if self.cuda:
            self.res["peak_mem_bytes"] = max(phases.values())
            self.res["peak_mem_source"] = ("trainer per-phase peaks "
                                           "(torch.cuda.max_memory_allocated)")
        else:  # the trainer's phase peaks are peak RSS; growth over the pre-build RSS
            self.res["peak_mem_bytes"] = max(max(phases.values()), peak_rss_bytes()) - (
                self.base_rss)
            self.res["peak_mem_source"] = "peak RSS growth (trainer phase peaks, getrusage)"

    def run_plain(self, cfg: Config) -> None:
        from meshlm.parallel.compile import compile_stats
        from meshlm.planner.cli import config_vocab
        from meshlm.train.peak import peak_flops

        model_cfg = cfg.model_config(config_vocab(cfg))
        loop = PlainLoop(cfg, model_cfg, self.device)
        peak, source = peak_flops(self.device, cfg.precision.dtype, cfg.train.peak_flops)
        n_params = sum(p.numel() for p in loop.model.parameters())
        self.res.update(params=n_params, vocab=model_cfg.vocab_size,
                        tokens_per_step=cfg.train.global_batch * cfg.data.seq_len,
                        flops_per_token=model_cfg.flops_per_token(cfg.data.seq_len),
                        peak_flops=peak,
                        peak_flops_source=source if self.cuda else CPU_PEAK_SOURCE)
        losses: list[float] = []
        try:
            self.timed(lambda: losses.append(loop.step()))
        finally:
            if cfg.train.compile:
                self.res["compile"] = compile_stats()
        self.res["final_loss"] = losses[-1]
        if self.cuda:
            self.res["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            self.res["peak_mem_source"] = "torch.cuda.max_memory_allocated"
        else:
            self.res["peak_mem_bytes"] = peak_rss_bytes() - self.base_rss
            self.res["peak_mem_source"] = "peak RSS growth (getrusage)"


# ---------------------------------------------------------------------- the driver (parent)
# What a row's process finds imported: it forks from a forkserver that imported these once (a
# fresh interpreter imports torch and meshlm anew, seconds per row). The server never touches
# CUDA, so each row still initialises its own device and context.
_ROW_PRELOAD = ["numpy", "torch", "torch._dynamo", "meshlm.train.trainer"]


def run_row(row: Row, args: argparse.Namespace, work: Path, cache: Path,
            deadline: float) -> dict[str, Any]:
    """``row`` in a process of its own (forked from the forkserver) until ``deadline``; its
    result (status ok, oom, error, skipped or timeout)."""
    from meshlm.distributed.forkserver import ensure_server, forkserver_context, run_script

    out, log = work / f"{row.name}.json", work / f"{row.name}.log"
    argv = ["--child", row.name, "--child-out", str(out), "--child-work", str(work),
            "--cache-dir", str(cache), "--child-deadline", str(deadline)]
    argv += ["--tiny"] * args.tiny + ["--force"] * args.force
    env = dict(os.environ)
    if args.tiny:  # the CPU version, even on a machine with a GPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    ctx = forkserver_context(_ROW_PRELOAD)
    ensure_server(ctx)
    t0 = time.time()
    proc = ctx.Process(target=run_script, args=(str(Path(__file__).resolve()), argv, str(log),
                                                env))
    proc.start()
    proc.join(timeout=max(0.0, deadline - time.time()))
    timed_out = proc.exitcode is None
    if timed_out:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            proc.kill()
        proc.join()
    rc = proc.exitcode
    res: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {
        "row": row.name, "impl": row.impl, "shape": row.shape, "dtype": row.dtype,
        "compiled": row.compiled, "note": row.note, "status": "running"}
    res["wall_s"] = round(time.time() - t0, 2)
    if timed_out:
        res["status"] = "timeout"
        res["error"] = f"killed at its time limit ({res['wall_s']:.0f} s)"
    elif res["status"] == "running":  # died without a word: its last log line says why
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        res["status"] = "oom" if any("out of memory" in ln.lower() for ln in tail[-20:]) else (
            "error")
        res["error"] = (tail[-1][:400] if tail else f"exit code {rc}")
    res["log"] = str(log)
    return res


def fmt(x: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else (
        format(x / scale, spec))


def table_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    cols = ["row", "status", "step s", "tokens/s", "MFU", "peak GiB",
            "plan step s", "plan tokens/s", "plan alloc GiB", "plan fits", "note"]
    body = []
    for r in rows:
        p = r.get("plan", {})
        note = r.get("error") if r["status"] != "ok" else r.get("note", "")
        body.append([
            r["row"], r["status"], fmt(r.get("step_time_s"), ".4f"),
            fmt(r.get("tokens_per_s"), ",.0f"), fmt(r.get("mfu"), ".1%"),
            fmt(r.get("peak_mem_bytes"), ".3f" if r.get("device") == "cpu" else ".2f", GIB),
            fmt(p.get("step_time_s"), ".4f"), fmt(p.get("tokens_per_s"), ",.0f"),
            fmt(p.get("mem_alloc_bytes"), ".3f" if r.get("device") == "cpu" else ".2f", GIB),
            {True: "yes", False: "NO"}.get(p.get("fits"), "-"), str(note or ""),
        ])
    return cols, body


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    cols, body = table_rows(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
        print("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)) + " |")
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for b in body:
            print("| " + " | ".join(x.ljust(w) for x, w in zip(b, widths, strict=True)) + " |")
        return
    table = Table(title=title)
    for c in cols:
        table.add_column(c, justify="left" if c in ("row", "status", "note") else "right")
    for b in body:
        table.add_row(*b)
    Console(width=None if sys.stdout.isatty() else 200).print(table)


RATIOS: dict[str, tuple[str, str]] = {
    "meshlm_eager_vs_plain_eager": ("meshlm-eager", "plain-eager"),
    "meshlm_compiled_vs_plain_compiled": ("meshlm-compiled", "plain-compiled"),
    "meshlm_compiled_vs_meshlm_eager": ("meshlm-compiled", "meshlm-eager"),
    "fp8_tensorwise_vs_bf16_compiled": ("8b-layers-fp8-tensorwise", "8b-layers-bf16"),
    "fp8_rowwise_vs_bf16_compiled": ("8b-layers-fp8-rowwise", "8b-layers-bf16"),
}
SPEEDUP_GOAL = 1.2  # fp8 / bf16 compiled tokens/s at the 8B layer shapes


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """:data:`RATIOS` of the rows that ran; a ``..._compiled`` ratio of rows that ran eager
    (``--tiny``'s 8B-layer rows) is named ``..._eager``."""
    ok = {r["row"]: r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")}
    out = {}
    for name, (a, b) in RATIOS.items():
        if a in ok and b in ok:
            if name.endswith("_compiled") and not ok[a].get("compiled", True):
                name = name.removesuffix("compiled") + "eager"
            out[name] = ok[a]["tokens_per_s"] / ok[b]["tokens_per_s"]
    return out


def fp8_loss_check(rows: list[dict[str, Any]], tiny: bool) -> dict[str, Any]:
    """The fp8 rows' loss after the same steps from the same seed and batches as the bf16
    row: each final loss, its relative difference from bf16's and the verdict against
    :data:`LOSS_GOAL` (a row that did not run every step has no verdict)."""
    want = TINY_LOSS_STEPS if tiny else LOSS_STEPS
    got = {r["row"]: r for r in rows if r["row"] in FP8_ROW_NAMES}
    out: dict[str, Any] = {"steps": want, "goal_rel_diff": LOSS_GOAL}
    for name, r in got.items():
        losses = r.get("losses") or []
        out[name] = ({"final_loss": losses[-1], "mean_last10": statistics.fmean(losses[-10:])}
                     if r["status"] == "ok" and len(losses) == want else
                     {"incomplete": f"{r['status']}, {len(losses)} of {want} steps"})
    base = out.get("8b-layers-bf16", {}).get("final_loss")
    for name in FP8_ROW_NAMES[1:]:
        loss = out.get(name, {}).get("final_loss")
        if base and loss is not None:
            rel = abs(loss - base) / base
            out[name].update(rel_diff_vs_bf16=rel, within_goal=rel < LOSS_GOAL)
    return out


def tiny_row(row: Row) -> Row:
    """``row`` as ``--tiny`` runs it: the 8B-layer rows eager (see the module docstring)."""
    return replace(row, compiled=False) if row.shape == "8b-layers" else row


def parse_rows(text: str) -> list[Row]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ROW_NAMES]
    if bad or not names:
        raise SystemExit(f"gpu.py: error: --rows {text!r}: unknown row(s) {', '.join(bad)} "
                         f"(rows: {', '.join(ROW_NAMES)})")
    return [r for r in ROWS if r.name in names]


def print_loss_check(check: dict[str, Any]) -> None:
    for name in FP8_ROW_NAMES:
        r = check.get(name)
        if r is None:
            continue
        if "incomplete" in r:
            print(f"loss after {check['steps']} steps, {name}: - ({r['incomplete']})")
            continue
        rel = (f", {r['rel_diff_vs_bf16']:.2%} from bf16 (goal < {LOSS_GOAL:.0%}: "
               f"{'met' if r['within_goal'] else 'NOT met'})" if "rel_diff_vs_bf16" in r else "")
        print(f"loss after {check['steps']} steps, {name}: {r['final_loss']:.4f}{rel}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true",
                    help="the same rows on CPU with a tiny model (a minute or two)")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                    help=f"comma-separated subset of: {', '.join(ROW_NAMES)} (default: all "
                         f"but the fp8 ones, {', '.join(FP8_ROW_NAMES)})")
    ap.add_argument("--json", default=None, help="output JSON (default "
                    "benchmarks/results/gpu.json, or gpu_tiny.json with --tiny)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget of the whole run (default 350 s, 560 s with an "
                         "fp8 row; --tiny 600 s): rows left when it is spent are recorded "
                         "as skipped")
    ap.add_argument("--force", action="store_true",
                    help="run the 8b row even where the planner says it does not fit")
    ap.add_argument("--cache-dir", default=None,
                    help="meshlm cache folder (synthetic data, token and compile caches; "
                         "default: meshlm's, ~/.cache/meshlm)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--child-work", help=argparse.SUPPRESS)
    ap.add_argument("--child-deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache()

    if args.child:
        row = next(r for r in ROWS if r.name == args.child)
        row = tiny_row(row) if args.tiny else row
        return RowRun(row, args.tiny, Path(args.child_out), Path(args.child_work), cache,
                      args.child_deadline, args.force).run()

    rows = [tiny_row(r) if args.tiny else r for r in parse_rows(args.rows)]
    if not args.tiny and not torch.cuda.is_available():
        print("gpu.py: no CUDA device here; run --tiny for the CPU version of these rows",
              file=sys.stderr)
        return 2
    start = time.time()
    with_fp8 = any(r.name in FP8_ROW_NAMES for r in rows)
    end = start + (args.budget_s or (600.0 if args.tiny else 560.0 if with_fp8 else 350.0))
    out = Path(args.json) if args.json else (
        ROOT / "benchmarks" / "results" / f"gpu{'_tiny' if args.tiny else ''}.json")
    work = Path(tempfile.mkdtemp(prefix="meshlm-gpu-bench-"))
    # each synthetic corpus and its token files once, here, before any row (rows only read
    # them); built through a bf16 config, which needs no torchao
    from meshlm.data import build_data

    for row in {(r.shape, r.corpus): r for r in rows}.values():
        build_data(row_config(replace(row, dtype="bf16", extra=()), args.tiny,
                              work / "data-check", cache).data, log=lambda _m: None)
    results: list[dict[str, Any]] = []
    for row in rows:
        left = end - time.time()
        if left < (10.0 if args.tiny else 20.0):
            results.append({"row": row.name, "impl": row.impl, "shape": row.shape,
                            "dtype": row.dtype, "compiled": row.compiled, "note": row.note,
                            "status": "skipped", "error": "the run's time budget is spent"})
            continue
        deadline = time.time() + min(budget(row, args.tiny).limit_s, left)
        res = run_row(row, args, work, cache, deadline)
        results.append(res)
        print(f"{row.name}: {res['status']}, {res['wall_s']:.1f} s"
              + (f", {res['tokens_per_s']:,.0f} tokens/s" if res.get("tokens_per_s") else "")
              + (f" ({res['error']})" if res.get("error") else ""), flush=True)
    total = time.time() - start
    device = next((r["device"] for r in results if r.get("device")), "?")
    title = (f"meshlm vs a plain loop on {device}{' (--tiny)' if args.tiny else ''}, "
             f"torch {torch.__version__}, {total:.0f} s")
    print_table(title, results)
    rat = ratios(results)
    for k, v in rat.items():
        goal = f" (goal >= {SPEEDUP_GOAL}x)" if k.startswith("fp8_") else ""
        print(f"{k.replace('_', ' ')}: {v:.3f}x{goal}")
    loss_check = fp8_loss_check(results, args.tiny) if with_fp8 else {}
    print_loss_check(loss_check)
    failed = [r["row"] for r in results if r["status"] not in ("ok", "skipped")]
    if failed:  # the logs of the rows that failed stay for reading
        print(f"logs of {', '.join(failed)}: {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        for r in results:
            r.pop("log", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "tiny": args.tiny, "device": device, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "total_s": total, "rows": results,
        "ratios": rat, **({"fp8_loss": loss_check} if loss_check else {}),
        **({"work_dir": str(work)} if failed else {})}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
