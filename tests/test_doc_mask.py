"""Document masking (``data.doc_mask``) on CPU.

- the logits of each document of a packed sequence equal that document's logits alone (both
  kernels; attention cut at the boundaries and rotary positions restarting at each document),
  and differ from the unmasked packed logits; compiled blocks (``train.compile``) take the ids
  of each micro-batch as a graph input and give the eager outputs and gradients;
- the masked ring-attention block and the merge of partial results handle query rows with no
  allowed key (output 0, log-sum-exp -inf) and agree with the masked dense attention;
- in one spawned world of 2, every layout with document masking matches one process with it
  (losses at each of 5 steps and final weights): dp 2, ZeRO-3, tp 2 + sp, cp 2 in ring, zigzag
  and Ulysses, pp 2 with 1F1B (with full recomputation) and zero-bubble -- on a corpus of short
  documents, so that every sequence holds several;
- the sampler's document ids follow the dataset's document starts; a source without document
  boundaries is one line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshlm.config import ConfigError, load_config
from meshlm.data.sampler import Source, StepSampler, doc_ids
from meshlm.models.llama import build_model, doc_positions, document_mask
from meshlm.models.presets import get_preset
from meshlm.parallel.attention_blocks import block_backward, block_forward, merge
from meshlm.parallel.extensions import apply_choices
from meshlm.testing import final_weights, max_relative_difference, run_world, train_runs
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

STEPS = 5


# ---------------------------------------------------------------------- the model
@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_each_document_of_a_packed_sequence_is_computed_alone(kernel: str) -> None:
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("tiny"), vocab_size=300), seed=1)
    apply_choices(model, attention=kernel)
    lengths = [5, 17, 1, 9, 32]
    docs = [torch.randint(0, 300, (n,)) for n in lengths]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    packed = torch.cat(docs)[None]
    with torch.no_grad():
        with model.packed(ids):
            out = model(packed)
        plain = model(packed)
        start = 0
        for doc in docs:
            alone = model(doc[None])[0]
            torch.testing.assert_close(out[0, start : start + len(doc)], alone,
                                       rtol=1e-5, atol=1e-5)
            start += len(doc)
    assert model.doc_ids is None  # (the block restores it)
    # the first document is unaffected either way; every later one differs without the mask
    assert (out[0, lengths[0]:] - plain[0, lengths[0]:]).abs().max() > 1e-2


def test_compiled_blocks_take_the_document_ids_of_their_micro_batch() -> None:
    """``train.compile``: the ids are a graph input -- compiled forward and gradients equal
    eager ones, and a second micro-batch with other documents uses its own ids."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("tiny"), vocab_size=300), seed=1)
    ids = [torch.tensor([[0] * 10 + [1] * 22, [0] * 3 + [1] * 29]),
           torch.tensor([[0] * 20 + [1] * 12, [0] * 30 + [1] * 2])]
    x = torch.randint(0, 300, (2, 32))
    runs = []
    for compiled in (False, True):
        apply_choices(model, compiled=compiled)
        got = []
        for packed_ids in ids:
            model.zero_grad()
            with model.packed(packed_ids):
                out = model(x)
            out.float().square().mean().backward()
            got.append((out.detach(), model.layers["0"].attention.wq.weight.grad.clone()))
        runs.append(got)
    apply_choices(model, compiled=False)
    for (eager_out, eager_grad), (out, grad) in zip(*runs, strict=True):
        torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(runs[1][0][0], runs[1][1][0])  # (the two micro-batches differ)


def test_document_positions_restart_at_each_document() -> None:
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3, 3, 3]])
    assert doc_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]]


# ---------------------------------------------------------------------- ring blocks
def test_masked_blocks_merge_to_the_dense_masked_attention() -> None:
    """Two key blocks (as two ring steps), with query rows whose document has no key in the
    first block: the merged result and its gradients are the dense masked attention's."""
    torch.manual_seed(0)
    b, nh, nkv, s, d = 2, 4, 2, 12, 8
    q = torch.randn(b, nh, s, d, requires_grad=True)
    k = torch.randn(b, nkv, s, d, requires_grad=True)
    v = torch.randn(b, nkv, s, d, requires_grad=True)
    ids = torch.tensor([[0] * 3 + [1] * 9, [0] * 7 + [1] * 2 + [2] * 3])
    mask = document_mask(ids, ids, True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout, retain_graph=True)
    # queries are rows 6..11; keys come in two blocks: rows 0..5 (earlier: no causal cut),
    # then rows 6..11 (the diagonal block: causal)
    qs, blocks = slice(6, 12), [(slice(0, 6), False), (slice(6, 12), True)]
    out = torch.zeros(b, nh, 6, d)
    lse = torch.full((b, nh, 6), float("-inf"))
    allowed = [document_mask(ids[:, qs], ids[:, ks], causal) for ks, causal in blocks]
    assert not allowed[0][1].any(1).all()  # batch 1: rows of documents 1, 2 see no key there
    for (ks, causal), a in zip(blocks, allowed, strict=True):
        o, lb = block_forward(q[:, :, qs].detach(), k[:, :, ks].detach(), v[:, :, ks].detach(),
                              causal, "math", a)
        merge(out, lse, o, lb)
    torch.testing.assert_close(out, ref[:, :, qs].detach(), rtol=1e-5, atol=1e-6)
    dq = torch.zeros(b, nh, 6, d)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for (ks, causal), a in zip(blocks, allowed, strict=True):
        gq, gk, gv = block_backward(dout[:, :, qs], q[:, :, qs].detach(), k[:, :, ks].detach(),
                                    v[:, :, ks].detach(), out, lse, causal, "flash", a)
        dq += gq
        dk[:, :, ks] += gk
        dv[:, :, ks] += gv
    torch.testing.assert_close(dq, ref_grads[0][:, :, qs], rtol=1e-5, atol=1e-5)
    # (keys' gradients here are those of query rows 6..11 only: compare against that)
    part = torch.autograd.grad(ref[:, :, qs], (k, v), dout[:, :, qs])
    torch.testing.assert_close(dk, part[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dv, part[1], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- the sampler
def test_sampler_document_ids_follow_the_document_starts() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    starts = np.array([0, 10, 15, 200, 203, 600], dtype=np.int64)
    offsets = np.array([8, 190, 598])
    ids = doc_ids(starts, offsets, 16)
    assert ids[0].tolist() == [0, 0] + [1] * 5 + [2] * 9
    assert ids[1].tolist() == [0] * 10 + [1] * 3 + [2] * 3
    assert ids[2].tolist() == [0, 0] + [1] * 14
    s = StepSampler([Source(tokens, 1.0, starts)], 16, 4, seed=0, doc_mask=True)
    inputs, targets, got = s.rank_micro_batches(0, 0, 1, 4)[0]
    assert got.shape == inputs.shape == (4, 16)
    assert torch.equal(got, doc_ids(starts, s.offsets(0), 16))
    with pytest.raises(ConfigError, match="document boundaries"):
        StepSampler([Source(tokens, 1.0, None)], 16, 4, seed=0, doc_mask=True)


# ---------------------------------------------------------------------- layouts
PP2 = ["--parallel.pp=2", "--train.micro_batch=2"]
LAYOUTS = [
    ("dp2", ["--parallel.dp=2"], 1e-6),
    ("zero3", ["--parallel.dp=2", "--parallel.zero=3"], 1e-6),
    ("tp2-sp", ["--parallel.tp=2", "--parallel.sp=true"], 1e-5),
    ("cp2-ring", ["--parallel.cp=2", "--parallel.cp_attention=ring"], 1e-5),
    ("cp2-zigzag", ["--parallel.cp=2", "--parallel.cp_attention=zigzag"], 1e-5),
    ("cp2-ulysses", ["--parallel.cp=2", "--parallel.cp_attention=ulysses"], 1e-5),
    ("pp2-1f1b-full", [*PP2, "--parallel.pp_schedule=1f1b", "--train.recompute=full"], 1e-6),
    ("pp2-zb", [*PP2, "--parallel.pp_schedule=zb"], 1e-6),
]


def _args(short_docs: Path, cache: Path) -> list[str]:
    return ["--model.preset=tiny", f"--data.path={short_docs}", f"--data.cache_dir={cache}",
            "--data.vocab_size=512", "--data.seq_len=64", "--data.doc_mask=true",
            f"--train.steps={STEPS}", "--train.global_batch=8", "--train.micro_batch=4",
            "--train.warmup_steps=2", "--train.eval_every=5", "--train.eval_batches=1",
            "--run.sample_tokens=0", "--train.peak_flops=1e10", "--train.eps=1e-5"]


@pytest.fixture(scope="module")
def world(short_docs: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("doc-mask")
    base = _args(short_docs, cache_dir)
    for name, extra in (("ref", []), ("unmasked", ["--data.doc_mask=false"])):
        train(load_config(None, [*base, *extra, f"--run.dir={root / name}"]),
              log=lambda _m: None, progress=False)
    runs = [[*args, f"--run.dir={root / name}"] for name, args, _ in LAYOUTS]
    results = run_world(2, train_runs, base, runs)[0]
    return root, dict(zip([name for name, *_ in LAYOUTS], results, strict=True))


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}


def test_masking_changes_the_run(world) -> None:  # noqa: ANN001
    """The corpus packs several documents per sequence: masking is not a no-op here."""
    root, _ = world
    ref, plain = _losses(root / "ref"), _losses(root / "unmasked")
    assert abs(ref[STEPS] - plain[STEPS]) / ref[STEPS] > 1e-3, (ref, plain)


@pytest.mark.parametrize("name", [name for name, *_ in LAYOUTS])
def test_layout_matches_one_process_with_document_masking(name: str, world) -> None:  # noqa: ANN001
    root, losses = world
    bound = next(b for n, _, b in LAYOUTS if n == name)
    ref = _losses(root / "ref")
    got = losses[name]
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), name
    worst = max(abs(got[s] - ref[s]) / ref[s] for s in ref)
    weights, tensor = max_relative_difference(final_weights(root / name),
                                              final_weights(root / "ref"))
    print(f"{name}: loss {worst:.1e}, weights {weights:.1e} ({tensor})")
    assert worst < bound, (name, worst)
    assert weights < 1e-5, (name, tensor, weights)
