"""Expert parallelism against the one-process run.

One MoE layer alone (ep = 2 and 4): outputs and every gradient equal one process's on all the
ranks' tokens together -- random routing, a router that gives one expert no tokens, one that
sends every token to the first ep rank, and capacity slots; the communication log shows two
all-to-alls forward and two backward per layer with bytes = routed copies x hidden x 4, the
host waits for the device once per layer forward when dropless (the split sizes, read
together), never with capacity slots and never in backward (the one-process layer never), and
expert weights per rank are 1/ep of the whole while the others are unchanged.

Training (fp32, 8 experts, top-2, with and without a shared expert, each balancing mode):
losses, gradient norms and final weights of ep = 2 and 4, and of ep = 2 with dp x zero 1/2/3,
with tp = 2 (+sp), with pp = 2 and with cp = 2 equal the one-process run, the auxiliary loss
on; also from an initialisation whose router sends every token to ep rank 0's experts and
one that gives an expert none. A checkpoint saved at ep = 4 resumes at ep = 2 and in one
process. The auxiliary-loss-free bias balances a router that starts with most tokens on one
expert; the planner's all-to-all volumes equal the log's.

The ``aux`` loss counts over the global micro-batch (micro-batch i of every data-parallel
rank), so a layout equals the one-process run whose micro-batch is dp x its own;
``seq_aux`` and ``bias`` equal any split. AdamW ``eps`` is 1e-5 (see test_context_parallel).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshlm.config import load_config
from meshlm.parallel.expert import router_summary
from meshlm.testing import final_weights, max_relative_difference, run_world
from meshlm.train.metrics import read_metrics
from meshlm.train.trainer import train

VOCAB, SEQ, GLOBAL_BATCH, STEPS, HALF = 509, 32, 8, 5, 3
E, K, H = 8, 2, 64


# ---------------------------------------------------------------------- one layer
def _layer(cfg_changes: dict):  # noqa: ANN202
    from meshlm.models.config import ModelConfig
    from meshlm.models.llama import build_model

    cfg = ModelConfig(name="t", vocab_size=64, dim=H, n_layers=1, n_heads=4, n_kv_heads=4,
                      ffn_hidden=64, moe_experts=E, moe_topk=K, moe_ffn_hidden=32,
                      **cfg_changes)
    return build_model(cfg, seed=3)


def _routing_case(model, case: str) -> None:  # noqa: ANN001
    """Router weights for a case (tokens carry a constant 4.0 in feature 0, see below)."""
    w = model.layers["0"].feed_forward.router.weight.data
    if case == "empty":  # expert 7 never chosen
        w[7, 0] = -20.0
    elif case == "one_rank":  # experts 0 and 1 (ep rank 0's) take every token
        w[0, 0] = w[1, 0] = 20.0


# Reading tensor values into Python: on a GPU each waits for the device to catch up.
READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class HostSyncs(TorchDispatchMode):
    """Counts what makes the host wait for the device inside its block: Python reads of
    tensor values (:data:`READS`, patched) and ops whose output size depends on the values
    (``nonzero``, boolean indexing, ``repeat_interleave`` without ``output_size``)."""

    def __enter__(self) -> HostSyncs:
        self.count, self.saved = 0, {m: getattr(torch.Tensor, m) for m in READS}
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, self._counted(method))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)

    def _counted(self, method):  # noqa: ANN001, ANN202
        def read(t, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.count += 1
            return method(t, *args, **kwargs)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in (torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default,
                    torch.ops.aten.masked_select.default):
            self.count += 1
        elif func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get(
                "output_size", args[1] if len(args) > 1 else None) is None:
            self.count += 1
        elif func is torch.ops.aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            self.count += 1
        return func(*args, **kwargs)


def layer_checks(ep: int) -> dict:
    """World body: the MoE layer on this rank's tokens under ep vs one process on all ranks'."""
    import torch.distributed as dist

    from meshlm.distributed.comm import Comm, CommLog
    from meshlm.distributed.mesh import Mesh
    from meshlm.distributed.spec import attach_specs
    from meshlm.layout import Layout
    from meshlm.parallel.expert import apply_expert_parallel

    rank = dist.get_rank()
    b, s = 2, 8
    out = {}
    for case, changes in (("random", {}), ("empty", {}), ("one_rank", {}),
                          ("capacity", {"moe_capacity": 1.0}),
                          ("shared", {"moe_shared_experts": 1})):
        g = torch.Generator().manual_seed(7)
        xs = torch.randn(ep, b, s, H, generator=g)
        xs[..., 0] = 4.0
        dys = torch.randn(ep, b, s, H, generator=g)
        ref_model = _layer(changes)
        _routing_case(ref_model, case)
        ref = ref_model.layers["0"].feed_forward
        ref.train()
        x_all = xs.clone().requires_grad_()
        # one process: each rank's batch is its own group of sequences (capacity per sequence)
        y_ref = torch.cat([ref(x_all[r]) for r in range(ep)])
        y_ref.backward(dys.reshape(ep * b, s, H))
        top = torch.cat([ref.route(xs[r].reshape(-1, H), b)[1] for r in range(ep)])
        alone = _layer(changes)  # the same layer without ep, on this rank's tokens
        _routing_case(alone, case)
        alone.train()
        with HostSyncs() as one_process:
            alone.layers["0"].feed_forward(xs[rank].clone().requires_grad_()).backward(dys[rank])

        model = _layer(changes)
        _routing_case(model, case)
        comm = Comm(Mesh(Layout(dp=ep, ep=ep)), CommLog())
        attach_specs(model, comm.mesh)
        apply_expert_parallel(model, comm)
        moe = model.layers["0"].feed_forward
        moe.train()
        x = xs[rank].clone().requires_grad_()
        comm.log.reset()
        with HostSyncs() as syncs_f:
            y = moe(x)
        forward = [(r.op, r.bytes) for r in comm.log.records]
        comm.log.reset()
        with HostSyncs() as syncs_b:
            y.backward(dys[rank])
        backward = [(r.op, r.bytes) for r in comm.log.records]
        errors = {"y": _rel(y, y_ref[rank * b:(rank + 1) * b]),
                  "dx": _rel(x.grad, x_all.grad[rank])}
        lo = rank * (E // ep)
        for name in ("w1", "w3", "w2"):
            errors[name] = _rel(getattr(moe.experts, name).grad,
                                getattr(ref.experts, name).grad[lo:lo + E // ep])
        for name, p in moe.named_parameters():
            if "experts." not in name:  # replicated: each rank's share of the gradient
                total = p.grad.clone()
                dist.all_reduce(total)
                errors[name] = _rel(total, dict(ref.named_parameters())[name].grad)
        mine = top.reshape(-1)
        received = int(((mine >= lo) & (mine < lo + E // ep)).sum())
        out[case] = {"errors": errors, "forward": forward, "backward": backward,
                     "syncs": (syncs_f.count, syncs_b.count, one_process.count),
                     "received": received, "sent": b * s * K,
                     "counts": torch.bincount(mine, minlength=E).tolist(),
                     "capacity_rows": E // ep * b * ep * 2}  # (E/ep experts x B x C) per peer
    # parameter bytes per rank: experts / ep, everything else whole
    whole, sharded = _layer({}), _layer({})
    comm = Comm(Mesh(Layout(dp=ep, ep=ep)))
    attach_specs(sharded, comm.mesh)
    apply_expert_parallel(sharded, comm)

    def nbytes(m, experts: bool) -> int:  # noqa: ANN001
        return sum(p.numel() * p.element_size() for n, p in m.named_parameters()
                   if ("experts." in n) == experts)

    out["bytes"] = {k: (nbytes(sharded, k == "expert"), nbytes(whole, k == "expert"))
                    for k in ("expert", "other")}
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    b64 = b.detach().double()
    return float((a.detach().double() - b64).norm() / max(b64.norm(), 1e-30))


@pytest.mark.parametrize("ep", [2, 4])
def test_moe_layer_matches_one_process(ep: int) -> None:
    itemsize = 4
    for rank, res in enumerate(run_world(ep, layer_checks, ep)):
        assert res["bytes"]["expert"][0] * ep == res["bytes"]["expert"][1]
        assert res["bytes"]["other"][0] == res["bytes"]["other"][1]
        for case in ("random", "empty", "one_rank", "capacity", "shared"):
            r = res[case]
            worst = max(r["errors"].values())
            assert worst < 1e-5, (ep, rank, case, r["errors"])
            # host synchronisations: the one-process layer makes none; expert parallelism
            # reads the dropless split sizes once per layer forward, capacity slots none;
            # backward none
            assert r["syncs"] == ((1 if case != "capacity" else 0), 0, 0), (ep, case, r["syncs"])
            a2a_f = [n for op, n in r["forward"] if op == "all_to_all"]
            a2a_b = [n for op, n in r["backward"] if op == "all_to_all"]
            if case == "capacity":  # fixed splits: no count exchange, equal slots each way
                assert [op for op, _ in r["forward"]] == ["all_to_all"] * 2, r["forward"]
                slots = r["capacity_rows"] * H * itemsize
                assert a2a_f == a2a_b == [slots, slots]
                continue
            # split sizes first (ep x E int64), then dispatch and combine
            assert r["forward"] == [("all_gather", ep * E * 8),
                                    ("all_to_all", r["sent"] * H * itemsize),
                                    ("all_to_all", r["received"] * H * itemsize)]
            # backward: the combine's gradient goes back first, then the dispatch's
            assert a2a_b == [r["sent"] * H * itemsize, r["received"] * H * itemsize]
            assert [op for op, _ in r["backward"]] == ["all_to_all"] * 2
        assert res["empty"]["counts"][7] == 0
        counts = res["one_rank"]["counts"]
        assert counts[0] == counts[1] == sum(counts) // 2  # every token on ep rank 0's experts
        if rank > 0:
            assert res["one_rank"]["received"] == 0


# ---------------------------------------------------------------------- training
def base_args(corpus: Path, cache: Path) -> list[str]:
    return [
        "--model.preset=tiny-moe", f"--model.moe_experts={E}", f"--model.moe_topk={K}",
        f"--data.path={corpus}", f"--data.cache_dir={cache}", f"--data.vocab_size={VOCAB}",
        f"--data.seq_len={SEQ}", f"--train.steps={STEPS}", f"--train.global_batch={GLOBAL_BATCH}",
        "--train.warmup_steps=2", f"--train.eval_every={STEPS}", "--train.eval_batches=2",
        "--run.sample_tokens=0", "--train.peak_flops=1e10", "--train.grad_clip=0.5",
        "--train.eps=1e-5", f"--train.checkpoint_every={HALF}",
    ]


def train_all(base: list[str], runs: list[list[str]]) -> list[dict[int, float]]:
    """World body: train ``base + run`` for each run; their losses."""
    return [train(load_config(None, base + r), log=lambda _m: None, progress=False).losses
            for r in runs]


def write_skewed_init(path: Path, base: list[str], case: str) -> None:
    """A one-process checkpoint of the seed's initial weights with every token embedding
    carrying +1 in feature 0 and the routers reading it: ``one_rank`` sends every token to
    experts 0 and 1 (ep rank 0's at ep = 2 and 4), ``empty`` gives expert 7 no token,
    ``skewed`` makes expert 0 most tokens' first choice."""
    from meshlm.checkpoint.sharded import save_checkpoint
    from meshlm.config import TrainSection, to_toml
    from meshlm.distributed.comm import Comm
    from meshlm.distributed.mesh import Mesh
    from meshlm.layout import Layout
    from meshlm.models.llama import build_model
    from meshlm.parallel.engine import LocalEngine

    full = load_config(None, base + ["--train.micro_batch=1"])
    cfg = full.model_config(vocab_size=VOCAB)
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        model.tok_embeddings.weight[:, 0] = 1.0 if case != "skewed" else 0.05
        for layer in model.layers.values():
            w = layer.feed_forward.router.weight
            if case == "one_rank":
                w[0, 0] = w[1, 0] = 20.0
            elif case == "empty":
                w[7, 0] = -20.0
            else:  # tokens stay distinguishable (router x 10), expert 0 favoured by ~2.4
                w *= 10.0
                w[0, 0] += 1.0
    comm = Comm(Mesh(Layout()))
    engine = LocalEngine(model, TrainSection(), comm)
    save_checkpoint(path, 0, engine, comm, {"model": asdict(cfg)}, {"config.toml": to_toml(full)})


MODES = ("aux", "seq_aux", "bias")


def _dir(args: list[str]) -> Path:
    return Path(next(a for a in args if a.startswith("--run.dir=")).split("=", 1)[1])


def _key(args: list[str]) -> tuple:
    """The reference a run compares with: (balance, shared experts, global micro-batch, init,
    capacity factor)."""
    opts = dict(a[2:].split("=", 1) for a in args)
    balance = opts.get("model.moe_balance", "aux")
    shared = opts.get("model.moe_shared_experts", "1")
    dp = int(opts.get("parallel.dp", 1))  # (cp ranks share sequences: no more of them)
    micro = int(opts.get("train.micro_batch", GLOBAL_BATCH)) * dp if balance == "aux" else 8
    return balance, shared, micro, opts.get("model.init_from", ""), opts.get("model.moe_capacity", "0")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ep")


def reference(base: list[str], key: tuple, root: Path) -> tuple:
    balance, shared, micro, init, capacity = key
    run_dir = root / f"ref-{balance}-{shared}-{micro}-{Path(init).name or 'seed'}-c{capacity}"
    if not run_dir.exists():
        args = [f"--model.moe_balance={balance}", f"--model.moe_shared_experts={shared}",
                f"--train.micro_batch={micro}", f"--run.dir={run_dir}"]
        if init:
            args.append(f"--model.init_from={init}")
        args.append(f"--model.moe_capacity={capacity}")
        train(load_config(None, base + args), log=lambda _m: None, progress=False)
    records = read_metrics(run_dir / "metrics.jsonl")
    return ({r["step"]: r["loss"] for r in records}, final_weights(run_dir),
            [r["grad_norm"] for r in records], records)


def check_parity(run_dir: Path, losses: dict, ref: tuple) -> None:
    ref_losses, ref_weights, ref_norms, ref_records = ref
    for step, loss in losses.items():
        assert abs(loss - ref_losses[step]) / ref_losses[step] < 1e-5, (run_dir.name, step)
    worst, name = max_relative_difference(final_weights(run_dir), ref_weights)
    assert worst < 1e-5, (run_dir.name, name, worst)
    records = read_metrics(run_dir / "metrics.jsonl")
    for rec in records:
        ref = ref_norms[rec["step"] - 1]
        assert abs(rec["grad_norm"] - ref) / ref < 1e-5, (run_dir.name, rec["step"])
        # the router statistics are the global batch's, whatever the layout
        ref_router = ref_records[rec["step"] - 1]["router"]
        for layer, st in rec["router"].items():
            assert st["tokens_per_expert"] == ref_router[layer]["tokens_per_expert"]
            assert st["aux_loss"] == pytest.approx(ref_router[layer]["aux_loss"], rel=1e-5)


def run_layouts(world: int, base: list[str], root: Path, runs: list[list[str]]) -> None:
    results = run_world(world, train_all, base, runs)[0]
    for args, losses in zip(runs, results, strict=True):
        check_parity(_dir(args), losses, reference(base, _key(args), root))


def test_ep_world_of_two(corpus_dir: Path, cache_dir: Path, root: Path) -> None:
    """ep = 2 over dp = 2 and over cp = 2, each balancing mode; extreme initial routers."""
    base = base_args(corpus_dir, cache_dir)
    for case in ("one_rank", "empty"):
        write_skewed_init(root / f"init-{case}", base, case)
    runs = []
    for i, balance in enumerate(MODES):
        shared = str(i % 2)
        runs.append(["--parallel.dp=2", "--parallel.ep=2", "--train.micro_batch=4",
                     f"--model.moe_balance={balance}", f"--model.moe_shared_experts={shared}",
                     f"--run.dir={root / f'ep2-dp2-{balance}'}"])
        runs.append(["--parallel.cp=2", "--parallel.ep=2", "--train.micro_batch=4",
                     f"--model.moe_balance={balance}", f"--model.moe_shared_experts={1 - i % 2}",
                     f"--run.dir={root / f'ep2-cp2-{balance}'}"])
    for case in ("one_rank", "empty"):
        runs.append(["--parallel.dp=2", "--parallel.ep=2", "--train.micro_batch=4",
                     f"--model.init_from={root / f'init-{case}'}",
                     f"--run.dir={root / f'ep2-init-{case}'}"])
    runs.append(["--parallel.dp=2", "--parallel.ep=2", "--train.micro_batch=4",
                 "--model.moe_capacity=1.0", f"--run.dir={root / 'ep2-capacity'}"])
    run_layouts(2, base, root, runs)
    capped = read_metrics(root / "ep2-capacity" / "metrics.jsonl")
    assert all(sum(st["dropped"] for st in r["router"].values()) > 0 for r in capped)
    summary = router_summary(capped)
    assert set(summary) == {"0", "1"} and all(0 < v["dropped_fraction"] < 0.5
                                              for v in summary.values())
    one_rank = read_metrics(root / "ep2-init-one_rank" / "metrics.jsonl")[0]["router"]
    for st in one_rank.values():  # step 1: every copy on experts 0 and 1
        assert sum(st["tokens_per_expert"][2:]) == 0
    empty = read_metrics(root / "ep2-init-empty" / "metrics.jsonl")[0]["router"]
    assert all(st["tokens_per_expert"][7] == 0 for st in empty.values())


def test_ep_world_of_four(corpus_dir: Path, cache_dir: Path, root: Path) -> None:
    """ep = 4; ep = 2 with dp = 4 and zero 1/2/3, with tp = 2 (+sp), with pp = 2 (1f1b, afab,
    zb)."""
    base = base_args(corpus_dir, cache_dir)
    runs = []
    for i, balance in enumerate(MODES):
        mode = [f"--model.moe_balance={balance}", f"--model.moe_shared_experts={i % 2}"]
        runs += [
            ["--parallel.dp=4", "--parallel.ep=4", "--train.micro_batch=2", *mode,
             f"--run.dir={root / f'ep4-{balance}'}"],
            ["--parallel.dp=4", "--parallel.ep=2", f"--parallel.zero={i + 1}",
             "--train.micro_batch=2", "--parallel.bucket_mb=0.05", *mode,
             f"--run.dir={root / f'ep2-dp4-zero{i + 1}-{balance}'}"],
            ["--parallel.dp=2", "--parallel.ep=2", "--parallel.tp=2", "--parallel.sp=true",
             "--train.micro_batch=4", *mode, f"--run.dir={root / f'ep2-tp2-{balance}'}"],
            ["--parallel.dp=2", "--parallel.ep=2", "--parallel.pp=2", "--train.micro_batch=2",
             *mode, f"--run.dir={root / f'ep2-pp2-{balance}'}"],
        ]
    for schedule in ("afab", "zb"):  # (1f1b above; interleaved needs more layers than 2)
        runs.append(["--parallel.dp=2", "--parallel.ep=2", "--parallel.pp=2",
                     f"--parallel.pp_schedule={schedule}", "--train.micro_batch=2",
                     f"--run.dir={root / f'ep2-pp2-{schedule}'}"])
    run_layouts(4, base, root, runs)
    # the expert weights at ep = 4 are a quarter of the whole per rank, the others whole
    rec = read_metrics(root / "ep4-aux" / "metrics.jsonl")[0]
    one = read_metrics(root / "ref-aux-0-8-seed-c0" / "metrics.jsonl")[0]
    cfg = load_config(None, base + ["--train.micro_batch=1"]).model_config(vocab_size=VOCAB)
    expert = cfg.n_moe_layers * E * 3 * H * cfg.expert_hidden * 4
    assert one["params_bytes"] - rec["params_bytes"] == expert * 3 // 4


def test_ep_checkpoint_reshards(corpus_dir: Path, cache_dir: Path, root: Path) -> None:
    """A run saved at ep = 4 (bias balancing: its biases too) resumes at ep = 2 and in one
    process, continuing the uninterrupted run."""
    base = base_args(corpus_dir, cache_dir)
    src = root / "ep4-bias"
    if not src.exists():
        pytest.skip("needs test_ep_world_of_four's runs")
    for name in ("to-ep2", "to-one"):
        shutil.copytree(src, root / name)
        for ckpt in (root / name / "checkpoints").iterdir():
            if int(ckpt.name.split("_")[1]) > HALF:
                shutil.rmtree(ckpt)
    resumed = ["--model.moe_balance=bias", "--model.moe_shared_experts=0", "--run.resume=true"]
    losses = run_world(2, train_all, base, [[
        "--parallel.dp=2", "--parallel.ep=2", "--train.micro_batch=4", *resumed,
        f"--run.dir={root / 'to-ep2'}"]])[0][0]
    assert sorted(losses) == [4, 5]
    check_parity(root / "to-ep2", losses, reference(base, ("bias", "0", 8, "", "0"), root))
    losses = train(load_config(None, base + ["--train.micro_batch=8", *resumed,
                                             f"--run.dir={root / 'to-one'}"]),
                   log=lambda _m: None, progress=False).losses
    check_parity(root / "to-one", losses, reference(base, ("bias", "0", 8, "", "0"), root))


def test_bias_balancing_evens_a_skewed_router(corpus_dir: Path, cache_dir: Path,
                                              tmp_path: Path) -> None:
    """Expert 0 starts as most tokens' first choice (max/mean load over 3; 4 is all of them):
    with bias balancing (rate 0.01) the largest layer max/mean load is below 1.9 on every
    step after the 45th (mean below 1.65; a balanced random router of this batch gives
    ~1.25); without balancing (no aux loss, same small learning rate) it stays above 2.5."""
    steps = 60
    base = base_args(corpus_dir, cache_dir) + [
        f"--train.steps={steps}", f"--train.eval_every={steps}", "--train.checkpoint_every=0",
        "--train.global_batch=8", "--train.micro_batch=8", "--model.moe_shared_experts=0",
        "--train.lr=1e-4", "--train.min_lr=1e-5"]
    write_skewed_init(tmp_path / "init", base, "skewed")
    loads = {}
    for name, extra in (("bias", ["--model.moe_balance=bias", "--model.moe_bias_rate=0.01"]),
                        ("none", ["--model.moe_balance=aux", "--model.moe_aux_loss_coef=0"])):
        train(load_config(None, base + extra + [f"--model.init_from={tmp_path / 'init'}",
                                                f"--run.dir={tmp_path / name}"]),
              log=lambda _m: None, progress=False)
        records = read_metrics(tmp_path / name / "metrics.jsonl")
        loads[name] = [max(st["max_over_mean"] for st in r["router"].values())
                       for r in records]
    assert min(loads["bias"][:3]) > 2.8 and min(loads["none"][:3]) > 2.8  # skewed at first
    settled = loads["bias"][45:]  # after 45 steps: every step below 1.9, mean below 1.65
    assert max(settled) < 1.9 and sum(settled) / len(settled) < 1.65, loads["bias"]
    assert min(loads["none"]) > 2.5, loads["none"]


def test_planner_all_to_all_volumes_equal_the_log(corpus_dir: Path, cache_dir: Path,
                                                  root: Path) -> None:
    """The planner's ep all-to-all and count bytes per step equal the comm log's (rank 0's:
    its dispatch bytes are exact; received copies average to the same over ranks)."""
    from meshlm.models.config import ModelConfig
    from meshlm.planner import Workload, comm_volumes
    from meshlm.planner.workload import ModelSpec

    base = base_args(corpus_dir, cache_dir)
    runs = [["--parallel.dp=2", "--parallel.ep=2", "--train.micro_batch=2",
             "--train.steps=1", f"--run.dir={root / 'plan-ep2'}"]]
    logs = run_world(2, comm_bodies, base, runs[0])
    cfg = load_config(None, base + runs[0])
    model = ModelConfig.from_dict(asdict(cfg.model_config(vocab_size=VOCAB)))
    work = Workload(ModelSpec(model), SEQ, GLOBAL_BATCH, dtype="fp32", states="fp32")
    predicted = comm_volumes(work, cfg.layout())
    mean_a2a = sum(log["all_to_all/ep"] for log in logs) / len(logs)
    assert mean_a2a == predicted["all_to_all/ep"]
    for log in logs:
        assert log["all_gather/ep"] == predicted["all_gather/ep"]
        # gradients of the non-expert weights, the aux loss's counts, the clipping norm
        assert log["all_reduce/dp"] == predicted["all_reduce/dp"]
        for key in set(log) | set(predicted):
            assert key in log and key in predicted, key


def comm_bodies(base: list[str], run: list[str]) -> dict[str, int]:
    """World body: one training step's comm-log bytes of this rank."""
    from meshlm.distributed.comm import CommLog
    from meshlm.train.trainer import Trainer

    log = CommLog()
    trainer = Trainer(load_config(None, base + run), log=lambda _m: None, progress=False,
                      comm_log=log)
    # expert and dense shards alike step with torch's fused AdamW (train.adamw_impl=auto)
    assert all(g["fused"] for g in trainer.model_part.engine.optimizer.param_groups), run
    log.reset()
    trainer.train_step(1)
    return log.bytes_by_op()
