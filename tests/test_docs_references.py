"""Every name README.md, CONTRIBUTING.md and docs/*.md give the reader exists.

What is checked, in inline code spans and fenced blocks (and links in the prose):

- config keys: ``section.key`` and ``--section.key=value`` for the config's sections, against
  the declared keys (:func:`meshlm.config.key_reference`, what ``meshlm train --keys`` prints),
  and the keys of ```toml blocks;
- command lines ``meshlm SUBCOMMAND --flag ...`` (also ``python -m meshlm.cli``, ``torchrun ... -m
  meshlm.cli`` and ``.venv/bin/meshlm``): the subcommand and each flag against the argparse
  parser of :mod:`meshlm.cli`; ``python benchmarks/x.py --flag``: the script exists and names
  the flag;
- repository paths (``src/...``, ``benchmarks/...``, ``tests/...``, ``docs/...``,
  ``examples/...``, ``.ci/...``, and module paths below ``src/meshlm`` such as
  ``parallel/zero.py``): they exist; ``tests/x.py::test_name``: the test function is defined;
- Python names ``meshlm.x.y[.attr]``: the module's file exists under ``src/meshlm`` and defines
  the attribute (read with :mod:`ast`; nothing is imported, so no torch);
- markdown links to local files and anchors: the file exists inside the repository and the
  anchor is one of its headings (GitHub's anchor rule);
- docs/architecture.md's package layout lists every module of ``src/meshlm`` and nothing else;
- every ``examples/*.toml`` runs as the docs show it, with more local workers than one
  (``meshlm train examples/small.toml --parallel.dp=2`` as a dry run).

Fast (about two seconds): the files are read as text, nothing imports torch but the dry runs.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshlm.cli import build_parser, main
from meshlm.config import key_reference

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "meshlm"
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

SECTIONS = ("model", "data", "train", "parallel", "precision", "run", "distributed",
            "checkpoint", "diloco", "profile")
# ``section.key`` not preceded by a word, a dot, a slash or a hyphen (``cfg.model.x``,
# ``parts/model.py``, ``.meshlm.lock``), and not a call or a file name (``model.py``).
_KEY = re.compile(rf"(?<![\w./\-])(?:--)?({'|'.join(SECTIONS)})\.(\w+)(?![\w(])")
_FILE_SUFFIXES = {"py", "md", "toml", "json", "jsonl", "txt", "png", "yaml", "sh"}
# Keys the docs show on purpose as mistakes, with the doc that shows them.
INVALID_ON_PURPOSE = {"train.stepz": "docs/reliability.md: the unknown-key example"}
# Files the docs name that a run not yet made will write, with the reason.
NOT_YET_WRITTEN = {
    "benchmarks/results/gpu.json": "the first GPU run of benchmarks/gpu.py writes it (open)",
}
# Python names below the package (``meshlm.launch.free_port``).
_MODULE = re.compile(r"(?<![\w./\-])meshlm(?:\.\w+)+")
# torch.profiler range names meshlm's regions carry (docs/architecture.md), not modules.
PROFILER_REGIONS = {"meshlm.step", "meshlm.forward", "meshlm.backward", "meshlm.recompute",
                    "meshlm.OP", "meshlm.optimizer_step", "meshlm.checkpoint_save"}
# Top-level folders of the repository whose paths are checked, and the packages below
# src/meshlm a bare module path may start with (``data/`` only with a .py: data.md's
# ``data/web/`` is the reader's folder).
REPO_DIRS = ("src", "benchmarks", "tests", "docs", "examples", ".ci")
PACKAGES = ("models", "parallel", "train", "distributed", "checkpoint", "planner")
_PATH = re.compile(r"(?<![\w./\-~])((?:\.ci|[A-Za-z_][\w-]*)/[\w./\-<>|*{}]*)")
_PLACEHOLDER = re.compile(r"[<>*{}]|NNN|\bN\b|RUN_DIR")
_LINK = re.compile(r"(?<!\\)\[[^\]\n]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[^\n]*$", re.S | re.M)


@dataclass(frozen=True)
class Ref:
    doc: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


@functools.cache
def _read(doc: Path) -> str:
    return doc.read_text()


def code(doc: Path) -> Iterator[Ref]:
    """Inline code spans and the bodies of fenced blocks (``text`` keeps the block's lines)."""
    text = _read(doc)
    for m in _FENCE.finditer(text):
        yield Ref(doc, _line_of(text, m.start(2)), m.group(2))
    prose = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    for m in re.finditer(r"(`+)(.+?)\1", prose, re.S):
        yield Ref(doc, _line_of(text, m.start()), m.group(2))


def fences(doc: Path, lang: str) -> Iterator[Ref]:
    text = _read(doc)
    for m in _FENCE.finditer(text):
        if m.group(1).lower() == lang:
            yield Ref(doc, _line_of(text, m.start(2)), m.group(2))


def all_code() -> list[Ref]:
    return [ref for doc in DOCS if doc.exists() for ref in code(doc)]


# --------------------------------------------------------------------------- config keys


@functools.cache
def declared_keys() -> frozenset[str]:
    return frozenset(key for key, *_ in key_reference())


def test_config_keys_exist() -> None:
    keys = declared_keys()
    assert "train.steps" in keys and len(keys) > 50, sorted(keys)[:10]
    bad = []
    for ref in all_code():
        for m in _KEY.finditer(ref.text):
            key = f"{m.group(1)}.{m.group(2)}"
            if m.group(2) in _FILE_SUFFIXES or m.group(2) != m.group(2).lower():
                continue  # a file name (model.py) or a Python name (precision.PrecisionPlan)
            if key not in keys and key not in INVALID_ON_PURPOSE:
                bad.append(f"{ref.where()}: {key}")
    assert not bad, "config keys that meshlm does not declare:\n" + "\n".join(bad)


def test_toml_blocks_use_declared_keys() -> None:
    keys, bad, seen = declared_keys(), [], 0
    for doc in DOCS:
        if not doc.exists():
            continue
        for ref in fences(doc, "toml"):
            data = tomllib.loads(ref.text)
            seen += 1
            for section, body in data.items():
                for key in body if isinstance(body, dict) else [None]:
                    if f"{section}.{key}" not in keys:
                        bad.append(f"{ref.where()}: [{section}] {key}")
    assert not bad, "TOML blocks with keys meshlm does not declare:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- command lines


@functools.cache
def subcommands() -> dict[str, frozenset[str]]:
    """Each subcommand's option strings (``--out``, ``-h``, ...)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: frozenset(p._option_string_actions) for name, p in sub.choices.items()}


def _commands(text: str) -> Iterator[list[str]]:
    """The words of each shell command in ``text`` (continuations joined, comments dropped,
    ``|``, ``;``, ``&&`` and ``||`` splitting)."""
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # not shell (prose in a code span, an unbalanced quote in Python)
        cmd: list[str] = []
        for w in [*words, ";"]:
            if w in ("|", ";", "&&", "||") or w.endswith(";"):
                if w.endswith(";") and w != ";":
                    cmd.append(w[:-1])
                if cmd:
                    yield cmd
                cmd = []
            else:
                cmd.append(w)


def _meshlm_args(words: list[str]) -> list[str] | None:
    """The arguments after ``meshlm`` (or ``-m meshlm.cli``) in a command, or None."""
    for i, w in enumerate(words):
        if w == "meshlm" or w.endswith("/bin/meshlm"):
            return words[i + 1:] if i == 0 or words[0] in ("srun", "exec") or "=" in words[0] \
                else None
        if w == "-m" and i + 1 < len(words) and words[i + 1] == "meshlm.cli":
            return words[i + 2:]
    return None


def _check_meshlm(args: list[str], ref: Ref, bad: list[str]) -> None:
    subs = subcommands()
    if not args or args[0].startswith("-"):
        return  # `meshlm --version`, `meshlm -h`
    sub = args[0]
    if sub not in subs:
        if re.fullmatch(r"[a-z]+", sub):
            bad.append(f"{ref.where()}: `meshlm {sub}`: no such subcommand")
        return
    for w in args[1:]:
        if not w.startswith("--") or w.startswith("--[") or w == "--":
            continue
        flag = w.split("=", 1)[0]
        if "." in flag:
            continue  # a config override: test_config_keys_exist
        if flag not in subs[sub]:
            bad.append(f"{ref.where()}: `meshlm {sub} {flag}`: no such option")


def _check_script(words: list[str], ref: Ref, bad: list[str]) -> None:
    for i, w in enumerate(words):
        if re.fullmatch(r"benchmarks/\w+\.py", w):
            script = ROOT / w
            if not script.exists():
                bad.append(f"{ref.where()}: {w} does not exist")
                return
            source = script.read_text()
            for arg in words[i + 1:]:
                flag = arg.split("=", 1)[0]
                if flag.startswith("--") and len(flag) > 2 and "." not in flag \
                        and f'"{flag}"' not in source and f"'{flag}'" not in source:
                    bad.append(f"{ref.where()}: `{w} {flag}`: the script has no such option")
            return


def test_commands_name_real_subcommands_and_flags() -> None:
    bad: list[str] = []
    checked = 0
    for ref in all_code():
        for words in _commands(ref.text):
            if (args := _meshlm_args(words)) is not None:
                checked += 1
                _check_meshlm(args, ref, bad)
            if any(w.startswith("benchmarks/") for w in words):
                _check_script(words, ref, bad)
    assert checked > 50, checked  # the extraction found the docs' commands
    assert not bad, "commands the CLI or the scripts do not accept:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- paths


def _resolve(path: str) -> Path | None:
    """The file or folder a path in the docs means, or None when it is not the repository's
    (a run dir, the reader's data, a placeholder)."""
    path = path.rstrip(".,:;")
    if _PLACEHOLDER.search(path):
        return None
    first = path.split("/", 1)[0]
    if first in REPO_DIRS:
        return ROOT / path
    if first == "meshlm":
        return ROOT / "src" / path
    if first in PACKAGES or (first == "data" and path.endswith(".py")):
        return SRC / path
    return None


def test_repository_paths_exist() -> None:
    bad, checked = [], 0
    for ref in all_code():
        last_test_file = None
        for m in _PATH.finditer(ref.text):
            path = m.group(1).rstrip(".,:;")
            target = _resolve(path.split("::")[0])
            if target is None or path in NOT_YET_WRITTEN:
                continue
            checked += 1
            module, dot, attr = str(target).rpartition(".")
            if not target.exists() and dot and attr not in _FILE_SUFFIXES and "/" not in attr:
                # `models/attention.ATTENTION`: a module and a name it defines
                source = Path(module + ".py")
                if not source.exists() or attr not in _defined(source):
                    bad.append(f"{ref.where()}: {path}: no such module or name")
                continue
            if not target.exists():
                bad.append(f"{ref.where()}: {path} does not exist")
                continue
            if path.startswith("tests/") and path.endswith(".py"):
                last_test_file = target
        # `tests/x.py::test_name` and a following `::test_other` of the same file
        for m in re.finditer(r"(tests/\w+\.py)?::(\w+)", ref.text):
            test_file = ROOT / m.group(1) if m.group(1) else last_test_file
            if test_file is None or not test_file.exists():
                continue
            checked += 1
            if not re.search(rf"^\s*(async )?def {m.group(2)}\b", test_file.read_text(), re.M):
                bad.append(f"{ref.where()}: {test_file.relative_to(ROOT)} has no "
                           f"{m.group(2)}")
    assert checked > 100, checked
    assert not bad, "paths and tests the docs name that do not exist:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- Python names


def _module_file(dotted: list[str]) -> Path | None:
    base = SRC.parent.joinpath(*dotted)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


@functools.cache
def _defined(module: Path) -> frozenset[str]:
    """Top-level names a module binds (definitions, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def test_python_names_exist() -> None:
    bad, checked = [], 0
    for ref in all_code():
        for m in _MODULE.finditer(ref.text):
            parts = m.group(0).split(".")
            if ".".join(parts[:2]) in PROFILER_REGIONS:
                continue
            checked += 1
            # the longest prefix that is a module, then at most one attribute of it
            for n in range(len(parts), 0, -1):
                module = _module_file(parts[:n])
                if module is not None:
                    break
            rest = parts[n:]
            if len(rest) > 1 or (rest and rest[0] not in _defined(module)):
                bad.append(f"{ref.where()}: {m.group(0)}")
    assert checked > 10, checked
    assert not bad, "Python names the docs give that meshlm does not have:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- links


def github_anchor(heading: str) -> str:
    """GitHub's id of a heading: markdown and punctuation dropped, lower case, spaces to
    hyphens (letters, digits, ``-`` and ``_`` kept)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(doc: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    prose = _FENCE.sub("", _read(doc))
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M):
        base = github_anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(re.findall(r'<a (?:name|id)="([^"]+)"', prose))
    return frozenset(out)


def test_github_anchor_rule() -> None:
    assert github_anchor("Asynchronous checkpoints (`checkpoint.async`, "
                         "`benchmarks/checkpoint_async.py`)") == (
        "asynchronous-checkpoints-checkpointasync-benchmarkscheckpoint_asyncpy")
    assert github_anchor("One GPU: meshlm vs a plain loop") == "one-gpu-meshlm-vs-a-plain-loop"


def test_local_links_and_anchors_exist() -> None:
    bad, checked = [], 0
    for doc in DOCS:
        if not doc.exists():
            continue
        text = _read(doc)
        prose = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
        prose = re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), prose)
        for m in _LINK.finditer(prose):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            checked += 1
            where = f"{doc.relative_to(ROOT)}:{_line_of(text, m.start())}"
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if ROOT not in dest.parents and dest != ROOT:
                bad.append(f"{where}: {target} is outside the repository")
                continue
            if not dest.exists():
                bad.append(f"{where}: {target}: no such file")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where}: {target}: {dest.name} has no heading #{anchor}")
    assert checked > 10, checked
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_docs_cite_nothing_outside_the_repository() -> None:
    """A reader of the repository cannot open ``../shared/...``: data the docs cite is copied
    into the repository (``benchmarks/data/``) and cited there."""
    bad = [f"{doc.relative_to(ROOT)}:{_line_of(_read(doc), m.start())}: {m.group(0)}"
           for doc in DOCS if doc.exists()
           for m in re.finditer(r"\.\./shared/\S*", _read(doc))]
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------- the layout


def test_architecture_layout_lists_every_module() -> None:
    """docs/architecture.md's "Layout of the package" block names every module of src/meshlm
    (a file, or a whole package folder ``name/``), and every name in it exists."""
    text = _read(ROOT / "docs" / "architecture.md")
    m = re.search(r"^## Layout of the package\n.*?^```\n(.*?)^```", text, re.S | re.M)
    assert m, "docs/architecture.md has no ``` block under '## Layout of the package'"
    listed: set[str] = set()
    for line in m.group(1).splitlines()[1:]:  # (the first: src/meshlm/)
        if not line.strip() or line.startswith(" " * 4):
            continue  # a role's continuation line
        names = re.match(r"[\w/.]+(?:, [\w/.]+)*", line.strip())
        assert names, line
        head = names.group(0)
        first = head.split(",")[0].strip()
        folder = first.rsplit("/", 1)[0] + "/" if "/" in first.rstrip("/") else ""
        for name in head.split(","):
            name = name.strip()
            if name:
                listed.add(name if "/" in name or not folder else folder + name)
    missing_files = sorted(n for n in listed if not (SRC / n).exists())
    assert not missing_files, f"listed in the layout but not in src/meshlm: {missing_files}"
    covered = {n.rstrip("/") for n in listed}

    def is_listed(rel: Path) -> bool:
        parts = rel.parts
        return any("/".join(parts[:k]) in covered for k in range(1, len(parts) + 1))

    modules = [p.relative_to(SRC) for p in SRC.rglob("*.py")
               if "__pycache__" not in p.parts and p.name != "__init__.py"]
    unlisted = sorted(str(p) for p in modules if not is_listed(p))
    assert not unlisted, ("modules of src/meshlm missing from docs/architecture.md's package "
                          f"layout (one line each, the role from the module's docstring): "
                          f"{unlisted}")


def test_readme_lists_every_doc() -> None:
    """The README's documentation list links every page of docs/ and CONTRIBUTING.md."""
    readme = _read(ROOT / "README.md")
    listed = readme[readme.index("\n## Documentation\n"):]
    pages = [*(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))), "CONTRIBUTING.md"]
    missing = [p for p in pages if f"]({p})" not in listed]
    assert not missing, f"README.md's documentation list leaves out {missing}"


# --------------------------------------------------------------------------- the examples


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.toml")))
def test_examples_take_more_workers(example: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An example that pinned ``train.micro_batch`` to the global batch failed with
    ``--parallel.dp=2`` (the batch no longer divides): each one validates with 1, 2 and 4
    data-parallel workers."""
    for dp in (1, 2, 4):
        rc = main(["train", str(ROOT / "examples" / example), f"--parallel.dp={dp}", "--dry-run"])
        out = capsys.readouterr()
        assert rc == 0 and "memory estimate" in out.out, (dp, out.err[-2000:])
