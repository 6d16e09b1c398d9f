"""Every command README.md tells the user to run, run as written, in README order.

The commands are read from README.md itself: every line of its ```bash blocks (continuations
joined, comments dropped) and every inline `code` span that starts with a command (``meshlm``,
``make``, ``pip``, ``python``, ``torchrun``, ``srun``, ``.venv/bin/...``); the ```python blocks run
too. Each one is either run here or listed in ``NOT_RUN`` with the reason; a README command that
is neither fails :func:`test_every_readme_command_is_run_or_listed`.

They run in a scratch directory standing in for the checkout (``examples/``, ``src/`` and
``.venv`` linked, ``docs/img/`` empty), with the data cache in a temporary ``XDG_CACHE_HOME``
shared by the session. The only changes made to a line are sizes: ``meshlm train`` gets tiny
ones for the keys it does not set itself (``SIZES``), and the steps it sets itself divided by
``STEP_SCALE`` (a line that continues an earlier one's run still continues it), so a line's
own choices (layout, precision, sequence length, run dir, resuming, ...) are kept. Commands that
need an earlier one's run dir (generate, convert, report, resume) come after it in the README
and so run after it here.

The first line of each ``meshlm`` subcommand runs the console script in a new process, as the
user's shell would. Later lines of the same subcommand (most of the tour: ``meshlm train``)
run the same ``argv`` through the same ``main`` in this process, in the same folder and
environment (:func:`meshlm.testing.run_cli`; their local workers fork from this process's
forkserver): a new interpreter importing torch and its compiler front end adds 5-7 s of CPU
per line and shows nothing the first line did not (all lines as new processes: 213 CPU-s
alone, against 109).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshlm.testing import HANG_GUARD_S, run_cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"  # its make lines: test_make_targets_exist
MAKEFILE = ROOT / "Makefile"
VENV_BIN = Path(sys.executable).parent

# Appended to `meshlm train` lines that do not set the key (dry runs excepted: they are cheap).
SIZES = {"model.preset": "tiny", "train.steps": "2", "data.seq_len": "32",
         "run.sample_tokens": "0", "train.eval_every": "0"}
# A line's own train.steps, divided by this (at least 2): the README's lines are sized for a
# minute of `small` each, the test runs `tiny`.
STEP_SCALE = 10

_MULTINODE = "run by tests/test_multinode.py: two torchrun 'nodes' on loopback, the README's line"
_SRUN = ("run by tests/test_multinode.py without srun (not installed here): the SLURM variables "
         "are set by the test and each task runs what follows `srun`")
_PIP = ("installs into the current environment (package index, minutes); the virtual env this "
        "test runs in was installed from the same pyproject.toml and constraints.txt")

# README commands not run here, with the reason (the key is the command as the README shows it).
NOT_RUN: dict[str, str] = {
    "make train": "sets up .venv and trains `small` for 400 steps (~4 min on 2 cores): too slow "
                  "for a test; its target is checked in test_make_targets_exist and the "
                  "`meshlm train` it runs is run below",
    'make train ARGS="--train.steps=100"': "as `make train` (ARGS checked in "
                                           "test_make_targets_exist)",
    "make test": "runs the whole test suite, this file included",
    "make setup": "creates .venv as `make train` and `make test` do first (target checked in "
                  "test_make_targets_exist)",
    "pip install .": _PIP,
    "pip install -c constraints.txt torch==2.13.0": _PIP,
    'pip install "meshlm[fp8]"': _PIP,
    "pip install -c constraints.txt .": _PIP,
    "pip install tensorboard": "an optional package from the package index (network)",
    "meshlm convert CKPT --to-hf OUT": "placeholders; the tour's `meshlm convert runs/try "
                                       "--to-hf hf/try` runs",
    "meshlm train --parallel.dp=N": "placeholder; the tour's --parallel.dp=2 and =4 lines run",
    ("torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d "
     "--rdzv-endpoint=$HEAD_NODE:29500 --rdzv-id=mn2x2 -m meshlm.cli train --parallel.dp=2 "
     "--parallel.tp=2 --run.dir=runs/mn2x2"): _MULTINODE,
    ("srun .venv/bin/meshlm train --parallel.dp=2 --parallel.tp=2 "
     "--run.dir=runs/mn2x2-slurm"): _SRUN,
}

SUBCOMMANDS = ("train", "info", "generate", "convert", "schedule", "plan", "report", "prepare")
_CMD_START = re.compile(r"^(meshlm|make|pip|pip3|python|python3|torchrun|srun|\.venv/bin/\S+)\s")
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[^\n]*$", re.S | re.M)
TIMEOUT_S = HANG_GUARD_S  # per command: a hang guard


def key(cmd: str) -> tuple[str, ...]:
    """A command compared by its words (quoting and spacing do not matter)."""
    return tuple(shlex.split(cmd))


@dataclass(frozen=True)
class Item:
    offset: int
    kind: str  # "shell" or "python"
    text: str  # the command (shell words re-joined) or the python source


def readme_items(text: str) -> list[Item]:
    """The README's commands and python blocks, in README order, each command once."""
    items: list[Item] = []
    for m in _FENCE.finditer(text):
        lang, body = m.group(1).lower(), m.group(2)
        if lang == "python":
            items.append(Item(m.start(), "python", body))
        elif lang in ("bash", "sh", "shell", "console"):
            pos = m.start(2)
            for line in body.replace("\\\n", "  ").splitlines(keepends=True):
                words = shlex.split(line, comments=True)
                if words:
                    items.append(Item(pos, "shell", shlex.join(words)))
                pos += len(line)
    prose = _FENCE.sub(lambda m: " " * len(m.group(0)), text)  # same offsets, no blocks
    for m in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(m.group(1).split())
        if not _CMD_START.match(span):
            continue  # not a command: a key, a path, a message, a bare program name
        words = shlex.split(span)
        if len(words) == 2 and words[0] == "meshlm" and words[1] in SUBCOMMANDS:
            continue  # the name of a subcommand (`meshlm plan`), checked in the coverage test
        items.append(Item(m.start(), "shell", shlex.join(words)))
    seen: set[tuple[str, ...]] = set()
    out = []
    for item in sorted(items, key=lambda i: i.offset):
        k = key(item.text) if item.kind == "shell" else ("python", item.text)
        if k not in seen:
            seen.add(k)
            out.append(item)
    return out


def not_run_reason(cmd: str) -> str | None:
    return {key(c): why for c, why in NOT_RUN.items()}.get(key(cmd))


def runnable(item: Item) -> bool:
    if item.kind == "python":
        return True
    words = key(item.text)
    return len(words) >= 2 and words[0] == "meshlm" and words[1] in SUBCOMMANDS


# --------------------------------------------------------------------------- running


def clean_env(cache: Path) -> dict[str, str]:
    """This environment without a parent's distributed world (the commands are a user's)."""
    world = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|"
                       r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|MESHLM_.*|SLURM_.*)$")
    env = {k: v for k, v in os.environ.items() if not world.match(k)}
    env.update(OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(cache), MPLBACKEND="Agg",
               PYTHONUNBUFFERED="1", PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def overrides(words: list[str]) -> dict[str, str]:
    """``--section.key=value`` words of a command line."""
    out = {}
    for w in words:
        if w.startswith("--") and "=" in w and "." in w.split("=", 1)[0]:
            k, v = w[2:].split("=", 1)
            out[k] = v
    return out


def sized(words: list[str]) -> list[str]:
    """A ``meshlm train`` line with tiny sizes appended for the keys it does not set and its own
    steps divided by ``STEP_SCALE``."""
    if words[:2] != ["meshlm", "train"] or "--dry-run" in words:
        return words
    own = overrides(words)
    if "train.steps" in own:
        steps = max(2, math.ceil(int(own["train.steps"]) / STEP_SCALE))
        words = [f"--train.steps={steps}" if w.startswith("--train.steps=") else w
                 for w in words]
    extra = []
    for k, v in SIZES.items():
        if k in own or (k == "model.preset" and "model.init_from" in own):
            continue  # the line's own choice (init_from: the checkpoint's config sets the shape)
        if k == "train.steps" and "profile.steps" in own:
            v = str(max(int(s) for s in re.findall(r"\d+", own["profile.steps"])))
        extra.append(f"--{k}={v}")
    return words + extra


@dataclass
class Tour:
    cwd: Path
    env: dict[str, str]
    pipeline_dir: str = ""  # a run dir with a measured pipeline timeline
    log: list[str] = field(default_factory=list)

    def run(self, argv: list[str], label: str) -> str:
        """``argv`` as a new process (its stdout and stderr, as one stream)."""
        t0 = time.monotonic()
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                rc = f"nothing (killed after {TIMEOUT_S}s)"
            with contextlib.suppress(ProcessLookupError):  # also workers a failure left behind
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.seek(0)
            text = out.read()
        return self._done(t0, label, rc, text, shlex.join(argv))

    def run_here(self, words: list[str], label: str) -> str:
        """``meshlm WORDS[1:]`` in this process (:func:`meshlm.testing.run_cli`), in the same
        folder and environment as a new process would have."""
        t0 = time.monotonic()
        done = run_cli(words[1:], environ=self.env, cwd=self.cwd, merge_stderr=True)
        return self._done(t0, f"{label}  (in this process)", done.returncode or 0, done.stdout,
                          shlex.join(words) + " (in this process)")

    def _done(self, t0: float, label: str, rc: object, text: str, how: str) -> str:
        self.log.append(f"{time.monotonic() - t0:6.1f}s  {label}")
        assert rc == 0, f"`{label}` exited {rc} (run as {how}):\n{text[-3000:]}"
        return text


def _run_dir_of(out: str) -> Path:
    m = re.search(r"^run dir (\S+?)(,|$)", out, re.M)
    assert m, f"no 'run dir' line in:\n{out[-2000:]}"
    return Path(m.group(1))


def check_train(tour: Tour, words: list[str], out: str) -> None:
    if "--dry-run" in words:
        assert "# memory estimate per rank" in out and "[model]" in out, out[-2000:]
        return
    own = overrides(words)
    layout = re.search(r"^layout: world (\d+) \((.*?)\)", out, re.M)
    assert layout, out[-2000:]
    for axis in ("dp", "tp", "pp", "cp"):  # the line's own layout keys (parallel.X)
        if f"parallel.{axis}" in own:
            assert f"{axis}={own[f'parallel.{axis}']}" in layout.group(2), layout.group(0)
    run_dir = tour.cwd / _run_dir_of(out)
    if own.get("run.resume") == "true":
        assert re.search(r"^run dir \S+, resuming at step [1-9]", out, re.M), out[-2000:]
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses), records
    assert records[-1]["step"] == int(own["train.steps"]), records[-1]
    assert re.search(r"loss \d+\.\d+", out), out[-2000:]
    assert (run_dir / "checkpoints" / f"step_{int(own['train.steps']):07d}").is_dir()
    if "profile.steps" in own:
        assert any((run_dir / "profile").iterdir()), "no profiler trace"
    if int(own.get("parallel.pp", 1)) > 1:
        tour.pipeline_dir = str(_run_dir_of(out))


def check_generate(tour: Tour, words: list[str], out: str) -> None:
    prompt = words[words.index("--prompt") + 1]
    assert out.startswith(prompt) and len(out.strip()) > len(prompt), out[-2000:]


def check_convert(tour: Tour, words: list[str], out: str) -> None:
    dest = tour.cwd / words[words.index("--to-hf") + 1]
    assert out.startswith(f"wrote {words[words.index('--to-hf') + 1]} "), out
    assert {"config.json", "tokenizer.json"} <= {p.name for p in dest.iterdir()}
    assert list(dest.glob("*.safetensors")), list(dest.iterdir())


def check_schedule(tour: Tour, words: list[str], out: str) -> None:
    assert "bubble" in out, out
    if "--plot" in words:
        png = tour.cwd / words[words.index("--plot") + 1]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def check_report(tour: Tour, words: list[str], out: str) -> None:
    page = re.search(r"^report: (\S+)", out, re.M)
    assert page and (tour.cwd / page.group(1)).is_file(), out
    assert "loss" in (tour.cwd / page.group(1)).read_text()


CHECKS: dict[str, Callable[[Tour, list[str], str], None]] = {
    "train": check_train, "generate": check_generate, "convert": check_convert,
    "schedule": check_schedule, "report": check_report,
    "info": lambda t, w, out: _expect(out, "tiny", "llama3-8b", "FLOPs/token"),
    "plan": lambda t, w, out: _expect(out, "tp=", "MFU"),
}

# Inline commands with a placeholder for something an earlier command made.
PLACEHOLDERS: dict[str, Callable[[Tour, list[str]], list[str]]] = {
    "meshlm schedule --timeline RUN_DIR --plot t.png":
        lambda tour, w: [tour.pipeline_dir if x == "RUN_DIR" else x for x in w],
}


def _expect(out: str, *parts: str) -> None:
    for part in parts:
        assert part in out, f"{part!r} not in:\n{out[-2000:]}"


# --------------------------------------------------------------------------- tests


def test_every_readme_command_is_run_or_listed() -> None:
    text = README.read_text()
    items = readme_items(text)
    commands = [i.text for i in items if i.kind == "shell"]
    assert len(commands) > 20, commands  # the extraction found the tour
    orphans = [c for c in commands if not runnable(Item(0, "shell", c)) and not not_run_reason(c)]
    assert not orphans, ("README commands neither run by tests/test_readme.py nor listed in its "
                         f"NOT_RUN with a reason: {orphans}")
    stale = [c for c in [*NOT_RUN, *PLACEHOLDERS] if key(c) not in {key(x) for x in commands}]
    assert not stale, f"listed in tests/test_readme.py but no longer in README.md: {stale}"
    # `meshlm <subcommand>` named in prose must be one the README shows how to run
    shown = {key(c)[1] for c in commands if key(c)[0] == "meshlm"}
    named = set(re.findall(r"`meshlm (\w+)`", text))
    assert named <= shown, named - shown
    assert any(i.kind == "python" for i in items)


def test_make_targets_exist() -> None:
    """Every ``make`` line of README.md (all listed in NOT_RUN) and CONTRIBUTING.md names a
    target the Makefile has, and a variable it reads."""
    targets = set(re.findall(r"^([\w-]+):", MAKEFILE.read_text(), re.M))
    contributing = [i.text for i in readme_items(CONTRIBUTING.read_text()) if i.kind == "shell"]
    assert "make test" in contributing, contributing
    for cmd in [*NOT_RUN, *contributing]:
        words = shlex.split(cmd)
        if words[0] != "make":
            continue
        for w in words[1:]:
            if "=" in w:
                var = w.split("=", 1)[0]
                assert f"$({var})" in MAKEFILE.read_text(), f"Makefile ignores {var} ({cmd})"
            else:
                assert w in targets, f"`{cmd}`: Makefile has no target {w!r}"


def test_readme_commands_run_as_written(tmp_path: Path, cache_dir: Path) -> None:
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    (cwd / "examples").symlink_to(ROOT / "examples")
    (cwd / "src").symlink_to(ROOT / "src")  # (the tour prepares it as a dataset)
    (cwd / ".venv").symlink_to(VENV_BIN.parent)
    (cwd / "docs" / "img").mkdir(parents=True)
    tour = Tour(cwd, clean_env(cache_dir))
    ran = 0
    seen: set[str] = set()  # subcommands run as a new process
    for item in readme_items(README.read_text()):
        if item.kind == "python":
            # the block as written, then the shape of whatever tensors it left behind
            src = item.text + ("\nimport torch as _t\nprint({k: tuple(v.shape) for k, v in "
                               "dict(globals()).items() if isinstance(v, _t.Tensor)})\n")
            out = tour.run([sys.executable, "-c", src], "```python block```")
            assert re.search(r"'\w+': \(", out), out  # it made tensors (e.g. logits)
            ran += 1
            continue
        if not runnable(item) or not_run_reason(item.text):
            continue
        words = shlex.split(item.text)
        for placeholder, fill in PLACEHOLDERS.items():
            if key(placeholder) == key(item.text):
                words = fill(tour, words)
        words = sized(words)
        if words[1] in seen:  # (this subcommand's console script has run: see the docstring)
            out = tour.run_here(words, item.text)
        else:
            out = tour.run([str(VENV_BIN / "meshlm"), *words[1:]], item.text)
            seen.add(words[1])
        check = CHECKS.get(words[1])
        if check:
            check(tour, words, out)
        ran += 1
    print("\n".join(tour.log))
    assert ran > 20, tour.log
