"""Every ```python block of the docs pages and the three READMEs runs, and prints what it shows.

The convention (written down in docs/internals.md, "The examples in these pages"):

* every block is a complete program, run in one process with plain ``python`` in an empty
  temporary directory, and must exit with status 0;
* a first line ``# needs: X`` skips the block when X (a distribution name: ``lightning``,
  ``pytorch-ignite``, ``datasets``, ``torchdata``, ...) cannot be imported;
* a first line ``# launch: torchrun ...`` runs the block with plain ``python`` all the same;
* the comment lines that end a block (after its last line of code) are the output of that one
  process run: the block's stdout, line by line, must be exactly those lines without their
  leading ``# ``.

The blocks run in parallel: children forked from one interpreter that imported torch, Lightning and
Ignite once (``tests/_docs_runner.py``), or, with ``SHARDPLUG_DOCS_FRESH=1``, fresh ``python`` processes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [
    ROOT / "README.md",
    ROOT / "integrations" / "lightning" / "README.md",
    ROOT / "integrations" / "ignite" / "README.md",
]
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
# `# needs: X` names a distribution; the module it brings when the two differ
MODULE_OF = {"pytorch-ignite": "ignite", "lightning": "lightning", "pytorch-lightning": "pytorch_lightning"}
TIMEOUT_S = 240
# the launcher's variables would make a block join a process group it cannot reach
LAUNCHER_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)


@dataclass(frozen=True)
class Example:
    page: Path
    line: int  # the line of the opening fence
    code: str
    needs: tuple[str, ...]  # distributions named by `# needs:`
    expected: tuple[str, ...] | None  # the output shown by the block's last comment lines, if any

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def parse(page: Path, line: int, code: str) -> Example:
    lines = code.rstrip("\n").splitlines()
    needs: tuple[str, ...] = ()
    if lines and lines[0].startswith("# needs:"):
        needs = tuple(n.strip() for n in lines[0][len("# needs:") :].replace(",", " ").split() if n.strip())
    tail: list[str] = []
    for text in reversed(lines):
        if text.startswith("#"):
            tail.append(text[2:] if text.startswith("# ") else text[1:])
        else:
            break
    code_lines = len(lines) - len(tail)
    expected = tuple(reversed(tail)) if tail and code_lines > 0 else None
    return Example(page, line, code, needs, expected)


def collect() -> list[Example]:
    examples = []
    for page in PAGES:
        if not page.exists():
            continue
        text = page.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            examples.append(parse(page, text.count("\n", 0, match.start()) + 1, match.group(1)))
    return examples


EXAMPLES = collect()


def missing(example: Example) -> list[str]:
    return [n for n in example.needs if importlib.util.find_spec(MODULE_OF.get(n, n.replace("-", "_"))) is None]


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    paths = [str(ROOT), str(ROOT / "integrations" / "lightning"), str(ROOT / "integrations" / "ignite")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore::DeprecationWarning"
    return env


def run(example: Example) -> subprocess.CompletedProcess:
    """One block as a fresh ``python example.py`` in an empty directory."""
    with tempfile.TemporaryDirectory(prefix="shardplug-docs-") as cwd:
        script = Path(cwd) / "example.py"
        script.write_text(example.code, encoding="utf-8")
        return subprocess.run(
            [sys.executable, str(script)], cwd=cwd, env=environment(), capture_output=True, text=True, timeout=TIMEOUT_S
        )


def run_forked(examples: list[Example], workers: int) -> dict[str, subprocess.CompletedProcess]:
    """Every block through ``tests/_docs_runner.py``: one interpreter imports torch (and Lightning, Ignite
    where a block needs them) once and forks a child per block, in an empty directory of its own."""
    preload = ["torch", "shardplug"]
    needed = {n for e in examples for n in e.needs}
    if needed & {"lightning", "pytorch-lightning"}:
        preload += ["lightning.pytorch", "shardplug_lightning"]
    if "pytorch-ignite" in needed:
        preload += ["ignite.engine", "ignite.distributed", "shardplug_ignite"]
    with tempfile.TemporaryDirectory(prefix="shardplug-docs-") as root:
        jobs = []
        for i, example in enumerate(examples):
            cwd = Path(root) / f"block{i}"
            cwd.mkdir()
            (cwd / "example.py").write_text(example.code, encoding="utf-8")
            jobs.append(
                {
                    "name": example.name,
                    "script": str(cwd / "example.py"),
                    "cwd": str(cwd),
                    "stdout": str(Path(root) / f"{i}.out"),
                    "stderr": str(Path(root) / f"{i}.err"),
                }
            )
        spec = Path(root) / "jobs.json"
        spec.write_text(json.dumps({"workers": workers, "timeout": TIMEOUT_S, "preload": preload, "jobs": jobs}))
        done = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("_docs_runner.py")),
                str(spec),
                str(Path(root) / "results.json"),
            ],
            env=environment(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S * (1 + len(jobs) // workers),
        )
        assert done.returncode == 0, f"tests/_docs_runner.py failed:\n{done.stderr[-4000:]}"
        codes = json.loads((Path(root) / "results.json").read_text())
        return {
            job["name"]: subprocess.CompletedProcess(
                job["script"],
                codes[job["name"]],
                Path(job["stdout"]).read_text(errors="replace"),
                Path(job["stderr"]).read_text(errors="replace"),
            )
            for job in jobs
        }


class Done:
    """A finished run, answering like a ``Future``."""

    def __init__(self, value: subprocess.CompletedProcess) -> None:
        self.value = value

    def result(self) -> subprocess.CompletedProcess:
        return self.value


@pytest.fixture(scope="module")
def results(request):
    """Runs every selected, runnable block (a few at a time, the slowest kinds first): forked from one
    interpreter that imported the heavy modules once, or, with ``SHARDPLUG_DOCS_FRESH=1`` or where
    there is no ``fork``, each as a fresh ``python`` process."""
    selected = {
        item.callspec.params["example"].name
        for item in request.session.items
        if getattr(item, "callspec", None) and "example" in item.callspec.params
    }
    chosen = sorted((e for e in EXAMPLES if e.name in selected and not missing(e)), key=lambda e: not e.needs)
    workers = max(2, min(8, (os.cpu_count() or 2) * 2))
    if hasattr(os, "fork") and not os.environ.get("SHARDPLUG_DOCS_FRESH"):
        yield {name: Done(value) for name, value in run_forked(chosen, workers).items()} if chosen else {}
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures: dict[str, Future] = {e.name: pool.submit(run, e) for e in chosen}
        yield futures
        for f in futures.values():
            f.cancel()


def test_the_pages_have_examples():
    assert len(EXAMPLES) >= 20, [e.name for e in EXAMPLES]
    assert any(e.page.name == "README.md" and e.page.parent == ROOT for e in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_runs_and_prints_what_it_shows(example, results):
    absent = missing(example)
    if absent:
        pytest.skip(f"needs {', '.join(absent)}")
    done = results[example.name].result()
    assert done.returncode == 0, f"{example.name} exited with {done.returncode}:\n{done.stderr[-4000:]}"
    if example.expected is not None:
        assert done.stdout.splitlines() == list(example.expected), (
            f"{example.name}: the block's closing comments are not what it printed:\n{done.stdout}"
        )
