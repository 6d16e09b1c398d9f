"""The package's layers point one way: models -> distributed -> parallel -> train -> cli.

Every import in the source -- top-level, inside functions, relative or absolute -- is resolved
to a ``meshlm`` module and checked against what its layer may not import. Also: the MoE layer
is never class-swapped (parallelism hands it a dispatcher), and no technique-specific
placement flag survives on parameters (their shard spec carries placement).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import meshlm

SRC = Path(meshlm.__file__).resolve().parent

# layer (a package folder or a top-level module) -> meshlm layers it must not import
FORBIDDEN: dict[str, set[str]] = {
    "models": {"config", "layout", "optim", "precision", "distributed", "parallel", "train",
               "checkpoint", "planner", "cli", "launch", "testing", "data"},
    "schema": {"models", "layout", "config", "optim", "precision", "distributed", "parallel",
               "train", "checkpoint", "planner", "cli", "launch", "testing", "data"},
    "dtypes": {"models", "schema", "layout", "config", "optim", "precision", "distributed",
               "parallel", "train", "checkpoint", "planner", "cli", "launch", "testing", "data"},
    "world": {"models", "optim", "precision", "distributed", "parallel", "train", "checkpoint",
              "planner", "cli", "launch", "testing", "data"},
    "layout": {"config", "distributed", "parallel", "train", "checkpoint", "planner", "cli",
               "launch", "testing"},
    "config": {"distributed", "parallel", "train", "checkpoint", "planner", "cli", "launch",
               "testing"},
    "optim": {"distributed", "parallel", "train", "checkpoint", "planner", "cli", "launch",
              "testing"},
    "precision": {"distributed", "parallel", "train", "checkpoint", "planner", "cli", "launch",
                  "testing"},
    "distributed": {"parallel", "train", "checkpoint", "planner", "cli", "launch", "testing"},
    "parallel": {"train", "checkpoint", "planner", "cli", "launch", "testing"},
    "checkpoint": {"train", "planner", "cli", "launch", "testing"},
    "train": {"cli", "testing"},
    "planner": {"cli", "testing"},
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path`` that names a meshlm module."""
    package = list(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    return _imports_of(path.read_text(), package)


def _imports_of(text: str, package: list[str]) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                if not node.module:  # "from . import x": x may be a module
                    out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
                    continue
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
    return [(line, m) for line, m in out if m == "meshlm" or m.startswith("meshlm.")]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_imports_point_one_way() -> None:
    bad = []
    checked = 0
    for path in sorted(SRC.rglob("*.py")):
        layer = _layer(".".join(path.relative_to(SRC.parent).with_suffix("").parts))
        for line, mod in _imports(path):
            checked += 1
            if _layer(mod) in FORBIDDEN.get(layer, set()):
                bad.append(f"{path.relative_to(SRC)}:{line} imports {mod}")
    assert checked > 100  # the walk really saw the package's imports
    assert not bad, "\n".join(bad)


def test_checker_sees_relative_and_lazy_imports() -> None:
    """The resolver itself: a lazy relative import from parallel/ into train/ is caught."""
    assert "meshlm.distributed.comm" in {m for _, m in _imports(SRC / "parallel" / "engine.py")}
    src = "import os\ndef f():\n    from ..train.trainer import Trainer\n    from . import zero\n"
    found = _imports_of(src, ["meshlm", "parallel"])
    assert found == [(3, "meshlm.train.trainer"), (4, "meshlm.parallel.zero")]
    assert _layer(found[0][1]) in FORBIDDEN["parallel"]


def test_no_placement_flags_or_class_swaps_in_source() -> None:
    text = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    for flag in ("_tp_sharded", "_tp_dim", "_tp_full", "_pp_tied", ".__class__ ="):
        assert flag not in text, flag


def test_moe_layer_uses_a_dispatcher() -> None:
    import torch

    from meshlm.models import build_model, get_preset
    from meshlm.models.moe import MoE

    model = build_model(get_preset("tiny-moe"), seed=0)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    x = torch.randn(2, 8, model.cfg.dim)
    calls = []
    local = moe.dispatcher

    def spy(layer: MoE, h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape)
        return local(layer, h)

    moe.dispatcher = spy
    y = moe(x)
    assert calls == [x.shape]
    flat = x.reshape(-1, x.shape[-1])
    weights, idx = moe.route(flat)
    assert torch.equal(y, moe.combine(flat, weights, idx).reshape(x.shape))


def test_mistakes_info_and_plans_answer_without_importing_torch() -> None:
    """A bad value, ``meshlm info`` and ``meshlm plan`` never import torch (seconds of start-up
    for a one-line answer): configuration, presets, world detection and the planner are
    torch-free; only what trains, converts or draws a schedule imports it."""
    probe = (
        "import contextlib, io, sys\n"
        "from meshlm.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    codes = [main(['train', '--train.steps=abc']), main(['info']),\n"
        "             main(['plan', '--model', 'llama3-8b', '--gpus', '8', '--gpu', 'h100-sxm',\n"
        "                   '--top', '1'])]\n"
        "print(codes, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[2, 0, 0] []", out
