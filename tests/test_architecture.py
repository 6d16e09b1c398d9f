"""The package's import graph: layers point one way and no modules import each other in a circle.

Every module under ``src/meshlm`` is parsed (not imported) and each of its imports -- at module
level, inside functions, under ``TYPE_CHECKING``, relative or absolute, and a package's names
imported on first use (``_LAZY``, ``importlib.import_module``) -- becomes an edge to the
``meshlm`` module it names (``from pkg import name`` names ``pkg.name`` when that is a module,
else ``pkg``). Lazy imports count as edges, for the layers and for circles alike: a function
that imports a module cannot run without it, so it depends on it as much as a top-level import
does; an import is made lazy to keep start-up fast (``meshlm plan`` without torch), never to
hide a dependency. Implicit imports of parent packages are not edges (every module has them),
nor are module names in data (a forkserver's list of modules to preload).

Also: a bad value, ``meshlm info`` and ``meshlm plan`` never import torch; the MoE layer is
never class-swapped (parallelism hands it a dispatcher), and no technique-specific placement
flag survives on parameters (their shard spec carries placement).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import meshlm

SRC = Path(meshlm.__file__).resolve().parent

# Layer of each top-level package or module of meshlm ("" is the package's own __init__: the
# ``load_model`` facade). A module imports only modules of its own layer or below.
LAYERS: dict[str, int] = {
    # 0 -- leaves, importing nothing of meshlm: precision names (no torch), config-key
    # declarations, build-tool checks, the version, the CPU matmul-rate measurement
    "dtypes": 0, "schema": 0, "toolchain": 0, "version": 0, "matmul_rate": 0,
    "precision_cost": 0, "named": 0,
    # 1 -- plain single-device models; sampling from their logits
    "models": 1, "generate": 1,
    # 2 -- what a run is: layout and its rules, typed config, optimizer, autocast and loss
    # scaling, the world this process is in, output paths and the locks that claim them
    "layout": 2, "config": 2, "optim": 2, "precision": 2, "world": 2, "paths": 2,
    "run_lock": 2,
    # 3 -- mesh, collectives, shard specs, value sources, worker processes
    "distributed": 3,
    # 4 -- parallelism applied to a model; checkpoints beside it; the corpus and tokenizer
    # (tokenised in forked workers)
    "parallel": 4, "checkpoint": 4, "data": 4,
    # 5 -- the trainer, the planner beside it; figures of runs and schedules
    "train": 5, "planner": 5, "viz": 5,
    # 6 -- the command line, the launcher it starts workers with, the package facade
    "cli": 6, "launch": 6, "": 6,
    # 7 -- test helpers (they run the command line)
    "testing": 7,
}
# (importer, imported) pairs of one layer that must not import each other: the planner and the
# trainer stand beside each other (shared code goes below both); checkpoints read the
# parallel engine's state, parallelism never knows about checkpoints.
APART: set[tuple[str, str]] = {("planner", "train"), ("train", "planner"),
                               ("parallel", "checkpoint")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _imports_of(text: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, name) of every import in ``text`` (the source of ``module``) that names a meshlm
    module or a name in one; relative names made absolute."""
    package = module.split(".") if is_package else module.split(".")[:-1]

    def absolute(name: str, level: int) -> str:
        if not level:
            return name
        base = package[: len(package) - level + 1]
        return ".".join(base + ([name] if name else []))

    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = absolute(node.module or "", node.level)
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value.lstrip(".")
                out.append((node.lineno, absolute(name, len(arg.value) - len(name))))
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
              and any(getattr(t, "id", "") == "_LAZY" for t in node.targets)):
            for v in node.value.values:  # {name: ".submodule"}: imported on first use
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    name = v.value.lstrip(".")
                    out.append((node.lineno, absolute(name, len(v.value) - len(name))))
    return [(line, m) for line, m in out if m == "meshlm" or m.startswith("meshlm.")]


def _resolve(name: str) -> str:
    """The meshlm module an imported name lives in: the longest module prefix of ``name``."""
    modules = _modules()
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


@functools.cache
def _graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line that imports it}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in _modules().items():
        edges: dict[str, int] = {}
        for line, name in _imports_of(path.read_text(), module, path.name == "__init__.py"):
            target = _resolve(name)
            if target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _unit(module: str) -> str:
    """The top-level package or module ``module`` belongs to ("" for meshlm itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _where(module: str, line: int) -> str:
    return f"{_modules()[module].relative_to(SRC)}:{line}"


def test_every_module_has_a_layer() -> None:
    units = {_unit(m) for m in _modules()}
    assert units <= set(LAYERS), f"give these a layer in LAYERS: {sorted(units - set(LAYERS))}"
    assert len(units) > 20 and set(LAYERS) <= units, sorted(set(LAYERS) - units)


def test_imports_point_one_way() -> None:
    bad = []
    graph = _graph()
    for module, edges in graph.items():
        for target, line in edges.items():
            src, dst = _unit(module), _unit(target)
            if LAYERS[dst] > LAYERS[src] or (src, dst) in APART:
                bad.append(f"{_where(module, line)} imports {target} "
                           f"({src or 'meshlm'}: layer {LAYERS[src]}; "
                           f"{dst or 'meshlm'}: layer {LAYERS[dst]})")
    assert sum(len(e) for e in graph.values()) > 300  # the walk really saw the imports
    assert not bad, "\n".join(bad)


def test_planner_and_trainer_never_reach_each_other() -> None:
    """Not even through a third module."""
    graph = _graph()

    def reach(units: str) -> set[str]:
        seen, todo = set(), [m for m in graph if _unit(m) == units]
        while todo:
            for target in graph[todo.pop()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    assert not {m for m in reach("planner") if _unit(m) == "train"}
    assert not {m for m in reach("train") if _unit(m) == "planner"}


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _one_circle(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first)."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for target in graph[node]:
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1]
            if target in inside and target not in came_from:
                came_from[target] = node
                todo.append(target)
    raise AssertionError(component)  # (a strongly connected component has one)


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = _graph()
    circles = []
    for component in _circles(graph):
        path = _one_circle(component, graph)
        circles.append(" -> ".join(f"{_where(m, graph[m][n])} imports {n}" for m, n in
                                   zip(path, [*path[1:], path[0]], strict=True)))
    assert not circles, "\n".join(circles)


def test_checker_sees_relative_lazy_and_named_imports() -> None:
    """The resolver itself: a lazy relative import from parallel/ into train/, a module
    imported with ``from . import``, a package's ``_LAZY`` names, and a circle."""
    src = ("import os\ndef f():\n    from ..train.trainer import Trainer\n"
           "    from . import zero\n    from .. import viz\n")
    found = _imports_of(src, "meshlm.parallel.engine")
    assert found == [(3, "meshlm.train.trainer.Trainer"), (4, "meshlm.parallel.zero"),
                     (5, "meshlm.viz")]
    assert [_resolve(n) for _, n in found] == ["meshlm.train.trainer", "meshlm.parallel.zero",
                                               "meshlm.viz"]
    assert "meshlm.models.llama" in _graph()["meshlm.models"]  # (its _LAZY names)
    assert "meshlm.distributed.comm" in _graph()["meshlm.parallel.engine"]
    assert _circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c"]]
    assert _circles({"a": {"b": 1}, "b": {}}) == []
    assert _one_circle(["a", "b", "c"], {"a": {"b": 1, "c": 1}, "b": {"c": 1}, "c": {"a": 1}}
                       ) == ["a", "c"]


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
