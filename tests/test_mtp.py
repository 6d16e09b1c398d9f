"""Multi-token prediction (``model.mtp_depth``, DeepSeek-V3 section 2.2) on CPU.

- its loss and gradients equal a hand-written implementation in this file (the tokens ahead
  read from the inputs, each depth run on the positions that have a target only -- causal
  attention keeps the others from them -- with and without document masking, where no
  prediction crosses a document boundary, the window's last token included); the weighted
  losses (torch's, the chunked one) agree; the main model's logits, evaluation and sampling
  do not see the MTP modules; a step reads the device no more often with MTP than without;
- in spawned worlds of 2, every layout equals the one-process run with MTP -- losses, MTP
  losses and final weights (fp32): depth 2 under dp, ZeRO-1/2/3, hybrid sharding, tp (with
  and without sp, with the chunked loss), cp ring / zigzag / Ulysses, pp 1F1B / zero-bubble /
  interleaved (the embedding's copy on the last stage, tied head or not), full and selective
  recomputation; depth 1 with document masking under dp, tp + sp, cp (ring, zigzag, Ulysses)
  and pp; depth 1 on a MoE model (bias balancing) under ep 2 over dp, ep 2 over cp, pp 2 and
  tp 2, where the MTP block is a MoE block (its routing statistics logged, its experts
  sharded over ep: half on each rank's checkpoint file). The MTP loss is logged and falls.

Bounds: the existing parity tests' (test_doc_mask, test_context_parallel): fp32 sums taken in
another order differ by a few 1e-7 relative per step; losses within 1e-6 (1e-5 where tp / cp
change the order of the attention and loss reductions), final weights within 1e-5 relative
per tensor (testing.py: AdamW's normalised update turns a rounding-level gradient difference
into up to ``lr x`` that on an element; eps 1e-5 as test_context_parallel).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshlm.config import load_config
from meshlm.generate import sample_tokens
from meshlm.models.llama import build_model
from meshlm.models.presets import get_preset
from meshlm.parallel.loss import chunked_cross_entropy, cross_entropy
from meshlm.parallel.multi_token import MultiTokenLoss
from meshlm.testing import (
    final_weights,
    max_relative_difference,
    relative_difference,
    run_world,
    train_runs,
)
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

STEPS = 4


# ---------------------------------------------------------------------- the loss, by hand
class _OneRank:
    """The communicator of one process, as ``MultiTokenLoss`` uses it."""

    def size(self, axis: str) -> int:
        return 1

    def all_reduce(self, t: torch.Tensor, axis: str, **kw: object) -> None:
        pass


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(model, x: torch.Tensor, y: torch.Tensor,  # noqa: ANN001
               docs: torch.Tensor | None) -> torch.Tensor:
    """DeepSeek-V3's MTP loss written out: depth k at position i reads t_{i+k} = x[i + k] and
    predicts t_{i+k+1} = y[i + k], for i < S - k only; the mean over depths of each depth's
    mean over its counted predictions (under document masking -- ``docs`` (B, S + 1): the
    window's t_0 ... t_S -- only those whose predicted token t_{i+k+1} is in i's document)."""
    eps = model.cfg.norm_eps
    b, s = x.shape
    with model.packed(None if docs is None else docs[:, :s]):
        h = model.run_layers(model.tok_embeddings(x), s)
    losses = []
    for k in range(1, model.cfg.mtp_depth + 1):
        d, n = model.mtp[k - 1], s - k
        h = h[:, :n]
        e = model.tok_embeddings.weight[x[:, k:k + n]]
        z = torch.cat([_rms(e, d.enorm.weight, eps), _rms(h, d.hnorm.weight, eps)], -1)
        z = z @ d.proj.weight.t()
        cut = None if docs is None else docs[:, :n]
        with model.packed(cut):
            cos, sin = model.rope(n)
            h = d.block(z, cos, sin, *(() if cut is None else (model.doc_ids,)))
        logits = _rms(h, d.norm.weight, eps) @ model.output.weight.t()
        ce = F.cross_entropy(logits.flatten(0, 1), y[:, k:k + n].flatten(),
                             reduction="none").view(b, n)
        keep = (torch.ones_like(ce) if docs is None
                else (docs[:, k + 1:k + 1 + n] == docs[:, :n]).float())
        losses.append((ce * keep).sum() / keep.sum())
    return torch.stack(losses).mean()


def _implemented(model, x: torch.Tensor, y: torch.Tensor,  # noqa: ANN001
                 docs: torch.Tensor | None) -> torch.Tensor:
    """The runners' way: one micro-batch per sequence, the mean over micro-batches (under
    document masking each carries the inputs' and the targets' document ids, as the sampler's
    micro-batches do)."""
    mtp = MultiTokenLoss(model, cross_entropy, _OneRank(), None, torch.device("cpu"))
    rows = range(x.shape[0])
    s = x.shape[1]
    micro = [(x[i:i + 1], y[i:i + 1],
              *(() if docs is None else (docs[i:i + 1, :s], docs[i:i + 1, 1:])))
             for i in rows]
    ahead = mtp.prepare(micro)
    total = torch.zeros(())
    for i in rows:
        with model.packed(None if docs is None else docs[i:i + 1, :s]):
            model(x[i:i + 1])
            total = total + mtp(ahead[i])
    return total / len(rows)


@pytest.mark.parametrize("masked", [False, True])
def test_loss_and_gradients_equal_a_hand_written_implementation(masked: bool) -> None:
    """Also the normalisation: micro-batches of different document layouts weigh each
    prediction alike (the token mean over the batch, not the mean of micro-batch means). The
    document layouts: row 0's window ends on a new document's first token (t_S: the sampler's
    targets' ids carry it), row 1 opens with a document of 2 tokens (no prediction of any
    depth), row 2 is one document."""
    torch.manual_seed(0)
    model = build_model(get_preset("tiny").with_(mtp_depth=3), seed=1).train()
    b, s = 3, 24
    tokens = torch.randint(0, model.cfg.vocab_size, (b, s + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    docs = (torch.tensor([[0] * 5 + [1] * 9 + [2] * 10 + [3], [0] * 2 + [1] * 3 + [2] * 20,
                          [0] * 25]) if masked else None)  # (b, S + 1): the windows' tokens'
    if masked:  # the rule at work: fewer counted than the tokens read in i's document
        assert ((docs[:, 2:] == docs[:, :-2]).sum() < (docs[:, 1:-1] == docs[:, :-2]).sum())
    grads = []
    values = []
    for fn in (_reference, _implemented):
        model.zero_grad()
        loss = fn(model, x, y, docs)
        loss.backward()
        values.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    ref, got = values
    assert abs(float(got) - float(ref)) / float(ref) < 1e-6, (got, ref)
    assert set(grads[0]) == set(grads[1])
    worst, name = max_relative_difference(grads[1], grads[0])
    assert worst < 1e-5, (name, worst)
    assert any(n.startswith("mtp.2.") for n in grads[0])  # every depth is trained
    assert model.mtp.input is None  # the kept trunk output is released


def test_no_prediction_crosses_a_document() -> None:
    """Depth k at position i counts only when its predicted token t_{i+k+1} is in i's
    document -- the window's last token t_S included -- and the count is the sum of
    ``max(n - k - 1, 0)`` over the window's documents of n tokens."""
    from meshlm.models.mtp import counted_predictions, depth_inputs

    targets = torch.arange(1, 6)[None]  # t_1 ... t_5 (S = 5)
    for window, want in (([0, 0, 0, 1, 1, 1], [1, 0, 0, 1, 0]),  # documents of 3 and 3
                         ([0, 0, 0, 0, 0, 1], [1, 1, 1, 0, 0])):  # t_S opens a document
        docs = torch.tensor([window])
        ids, predicted, counted = depth_inputs(targets, 1, doc_ids=docs)
        assert counted.int().tolist() == [want], window
        assert ids.tolist() == [[1, 2, 3, 4, 5]]  # reads t_{i+1}
        ahead = [2, 3, 4, 5, 0]  # t_{i+2} (none past the window)
        assert predicted.tolist() == [[t if c else 0 for t, c in zip(ahead, want, strict=True)]]
        assert int(counted_predictions(5, 1, docs, 1)) == sum(want)
    docs = torch.tensor([[0] * 4 + [1] * 7 + [2]])  # documents of 4, 7 and 1 tokens (S = 11)
    for k in (1, 2, 3):
        n = int(counted_predictions(11, k, docs, 1))
        assert n == sum(max(d - k - 1, 0) for d in (4, 7, 1))
        assert n == int(depth_inputs(torch.zeros(1, 11, dtype=torch.long), k,
                                     doc_ids=docs)[2].sum())
    with pytest.raises(ValueError, match="S \\+ 1"):  # the inputs' ids alone
        depth_inputs(targets, 1, doc_ids=torch.zeros(1, 5, dtype=torch.long))


def test_weighted_losses_agree() -> None:
    """The chunked fused loss with per-row weights equals torch's weighted cross-entropy, value
    and gradients (a row of weight 0 does not count)."""
    torch.manual_seed(0)
    n, h, v = 37, 16, 50
    x = torch.randn(n, h, requires_grad=True)
    w = torch.randn(v, h, requires_grad=True)
    t = torch.randint(0, v, (n,))
    rows = torch.rand(n) * (torch.rand(n) > 0.3)
    got = chunked_cross_entropy(x, w, t, chunk=8, rows=rows)
    gx, gw = torch.autograd.grad(got, (x, w))
    ref = cross_entropy((x @ w.t())[None], t[None], rows[None])
    rx, rw = torch.autograd.grad(ref, (x, w))
    assert relative_difference(got, ref) < 1e-6
    assert relative_difference(gx, rx) < 1e-6
    assert relative_difference(gw, rw) < 1e-6


def test_the_main_model_ignores_the_mtp_modules() -> None:
    """Same seed, with and without MTP: the same main weights, logits and samples; evaluation
    and sampling keep nothing for MTP."""
    cfg = get_preset("tiny")
    plain, with_mtp = build_model(cfg, seed=2), build_model(cfg.with_(mtp_depth=2), seed=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(plain(ids), with_mtp(ids))
    assert with_mtp.mtp.input is None
    assert sample_tokens(plain, [1, 2, 3], 8, seed=0) == sample_tokens(with_mtp, [1, 2, 3], 8,
                                                                        seed=0)
    assert with_mtp.mtp.input is None
    names = {n for n, _ in with_mtp.named_parameters()}
    assert names - {n for n, _ in plain.named_parameters()} == {
        n for n in names if n.startswith("mtp.")}
    assert with_mtp.num_params() == cfg.num_params() + cfg.with_(mtp_depth=2).mtp_params()


def test_mtp_adds_no_host_synchronisation(short_docs: Path, cache_dir: Path,
                                          tmp_path: Path) -> None:
    """A training step reads the device as often with MTP as without it (document masking
    on: its counts stay on the device)."""
    from meshlm.distributed.host_sync import count_host_syncs
    from meshlm.train.trainer import Trainer

    base = [*_args(short_docs, cache_dir), "--data.doc_mask=true", "--train.micro_batch=2"]
    totals = {}
    for name, extra in (("plain", []), ("mtp", ["--model.mtp_depth=2"])):
        trainer = Trainer(load_config(None, [*base, *extra, f"--run.dir={tmp_path / name}"]),
                          log=lambda _m: None, progress=False)
        try:
            trainer.train_step(1)
            with count_host_syncs() as syncs:
                trainer.train_step(2)
        finally:
            trainer.watch.close()
        totals[name] = syncs.total
    print("host syncs per step:", totals)
    assert totals["mtp"] <= totals["plain"], totals


# ---------------------------------------------------------------------- layouts
def _args(corpus: Path, cache: Path) -> list[str]:
    return ["--model.preset=tiny", f"--data.path={corpus}", f"--data.cache_dir={cache}",
            "--data.vocab_size=512", "--data.seq_len=32", f"--train.steps={STEPS}",
            "--train.global_batch=8", "--train.micro_batch=2", "--train.warmup_steps=2",
            "--train.eval_every=4", "--train.eval_batches=1", "--run.sample_tokens=0",
            "--train.peak_flops=1e10", "--train.eps=1e-5"]


PP = ["--parallel.pp=2"]
TP = ["--parallel.tp=2"]
SP = [*TP, "--parallel.sp=true"]
CP = ["--parallel.cp=2"]
# (name, reference, arguments, loss bound): dense, depth 2
DENSE = [
    ("dp2", "ref", ["--parallel.dp=2"], 1e-6),
    ("zero1", "ref", ["--parallel.dp=2", "--parallel.zero=1"], 1e-6),
    ("zero2", "ref", ["--parallel.dp=2", "--parallel.zero=2", "--train.micro_batch=1"], 1e-6),
    ("zero3", "ref", ["--parallel.dp=2", "--parallel.zero=3"], 1e-6),
    ("hsdp-zero3", "ref", ["--parallel.dp=2", "--parallel.dp_shard=1", "--parallel.zero=3"],
     1e-6),
    ("tp2", "ref", TP, 1e-5),
    ("tp2-sp", "ref", SP, 1e-5),
    ("tp2-sp-chunked", "ref", [*SP, "--train.loss=chunked", "--train.loss_chunk=24"], 1e-5),
    ("dp2-chunked", "ref", ["--parallel.dp=2", "--train.loss=chunked"], 1e-6),
    ("cp2-ring", "ref", [*CP, "--parallel.cp_attention=ring"], 1e-5),
    ("cp2-zigzag", "ref", [*CP, "--parallel.cp_attention=zigzag"], 1e-5),
    ("cp2-ulysses", "ref", [*CP, "--parallel.cp_attention=ulysses"], 1e-5),
    ("pp2-1f1b-full", "ref", [*PP, "--parallel.pp_schedule=1f1b", "--train.recompute=full"],
     1e-6),
    ("pp2-zb", "ref", [*PP, "--parallel.pp_schedule=zb"], 1e-6),
    ("pp2-tied", "tied", [*PP, "--model.tie_embeddings=true"], 1e-6),
    ("pp2-interleaved", "deep", [*PP, "--parallel.pp_schedule=interleaved",
                                 "--parallel.pp_virtual=2", "--model.n_layers=4"], 1e-6),
    ("dp2-selective", "ref", ["--parallel.dp=2", "--train.recompute=selective"], 1e-6),
]
DENSE_REFS = {"ref": [], "tied": ["--model.tie_embeddings=true"], "deep": ["--model.n_layers=4"]}
# depth 1 with document masking (short documents: several per sequence)
MASKED = [
    ("dp2", "ref", ["--parallel.dp=2"], 1e-6),
    ("tp2-sp", "ref", SP, 1e-5),
    ("cp2-ring", "ref", [*CP, "--parallel.cp_attention=ring"], 1e-5),
    ("cp2-zigzag", "ref", [*CP, "--parallel.cp_attention=zigzag"], 1e-5),
    ("cp2-ulysses", "ref", [*CP, "--parallel.cp_attention=ulysses"], 1e-5),
    ("pp2-zb", "ref", [*PP, "--parallel.pp_schedule=zb"], 1e-6),
]
# depth 1 on a MoE model (auxiliary-loss-free balancing: the same in any split)
MOE = [
    ("ep2", "ref", ["--parallel.dp=2", "--parallel.ep=2"], 1e-6),
    ("ep2-cp2", "ref", [*CP, "--parallel.ep=2"], 1e-5),
    ("pp2", "ref", PP, 1e-6),
    ("tp2", "ref", TP, 1e-5),
]
WORLDS = {"dense": (DENSE, DENSE_REFS, ["--model.mtp_depth=2"]),
          "masked": (MASKED, {"ref": []}, ["--model.mtp_depth=1", "--data.doc_mask=true"]),
          "moe": (MOE, {"ref": []}, ["--model.mtp_depth=1", "--model.preset=tiny-moe",
                                     "--model.moe_balance=bias", "--model.moe_bias_rate=0.01"])}


def _records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "metrics.jsonl")}


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request: pytest.FixtureRequest, corpus_dir: Path, short_docs: Path, cache_dir: Path,
          tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    layouts, refs, extra = WORLDS[name]
    root = tmp_path_factory.mktemp(f"mtp-{name}")
    base = [*_args(short_docs if name == "masked" else corpus_dir, cache_dir), *extra]
    for ref, args in refs.items():
        train(load_config(None, [*base, *args, f"--run.dir={root / ref}"]),
              log=lambda _m: None, progress=False)
    run_world(2, train_runs, base,
              [[*args, f"--run.dir={root / n}"] for n, _, args, _ in layouts])
    return name, root


def test_layouts_equal_one_process(world) -> None:  # noqa: ANN001
    name, root = world
    layouts, _, _ = WORLDS[name]
    failures = []
    for layout, ref, _, bound in layouts:
        want, got = _records(root / ref), _records(root / layout)
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), layout
        loss = max(abs(got[s]["loss"] - want[s]["loss"]) / want[s]["loss"] for s in want)
        mtp = max(abs(got[s]["mtp_loss"] - want[s]["mtp_loss"]) / want[s]["mtp_loss"]
                  for s in want)
        weights, tensor = max_relative_difference(final_weights(root / layout),
                                                  final_weights(root / ref))
        print(f"{name} {layout}: loss {loss:.1e}, mtp loss {mtp:.1e}, weights {weights:.1e} "
              f"({tensor})")
        if not (loss < bound and mtp < bound and weights < 1e-5):
            failures.append((layout, loss, mtp, weights, tensor))
    assert not failures, failures


def test_mtp_is_trained_and_logged(world) -> None:  # noqa: ANN001
    """The MTP loss is logged beside the main loss and falls; the MTP modules move; a MoE
    model's MTP block has its routing statistics (the row after the main layers)."""
    name, root = world
    recs = _records(root / "ref")
    assert recs[STEPS]["mtp_loss"] < recs[1]["mtp_loss"]
    assert recs[STEPS]["loss"] != recs[STEPS]["mtp_loss"]
    cfg = load_config(root / "ref" / "config.toml", []).model_config(512)
    start = build_model(cfg, seed=0)
    end = final_weights(root / "ref")
    for n, p in start.named_parameters():
        if n.startswith("mtp.") and not n.endswith("norm.weight"):
            assert not torch.equal(p.detach(), end[n]), n
    if name == "moe":
        assert str(cfg.n_layers) in recs[STEPS]["router"]
        # under ep 2 each rank holds (and saves) half of the MTP block's experts
        index = json.loads(next((root / "ep2" / "checkpoints").glob("step_*/index.json"))
                           .read_text())
        boxes = {f: piece["box"][0] for f, entry in index["files"].items()
                 for piece in entry["pieces"] if piece["kind"] == "weight"
                 and piece["name"] == "mtp.0.block.feed_forward.experts.w1"}
        half = cfg.moe_experts // 2
        assert sorted(boxes.values()) == [[0, half], [half, 2 * half]], boxes
