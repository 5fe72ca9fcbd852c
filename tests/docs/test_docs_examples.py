"""Every ```python block of the docs pages and the three READMEs runs, and prints what it shows.

The convention (written down in docs/internals.md, "The examples in these pages"):

* every block is a complete program, run in one process with plain ``python`` in an empty
  temporary directory, and must exit with status 0;
* a first line ``# needs: X`` skips the block when X (a distribution name: ``lightning``,
  ``pytorch-ignite``, ``datasets``, ``torchdata``, ...) cannot be imported; a line ``# slow: WHY``
  among its first two skips it unless ``SHARDPLUG_DOCS_SLOW=1`` (a block that starts a Ray cluster);
* the comment lines that end a block (after its last line of code) are the output of that one
  process run: the block's stdout, line by line, must be exactly those lines without their
  leading ``# ``;
* a block written for several processes names that form and runs in it too
  (:func:`several_processes`): a first line ``# launch: torchrun --nproc_per_node N NAME.py``
  (run under torchrun), a line ``...devices=1...  # devices=N: ...`` (Lightning, run with
  ``devices=N``) or ``...backend=None...  # ... backend="gloo", nproc_per_node=N`` (Ignite, run
  so); its closing comments then go on with a line ``# N processes print (in any order):`` and the
  lines all N processes print together, compared as a multiset (the processes' lines interleave).

The blocks run in parallel: children forked from one interpreter that imported torch, Lightning and
Ignite once (``tests/_docs_runner.py``; a block's torchrun form: one child per process, with the
variables torchrun sets), or, with ``SHARDPLUG_DOCS_FRESH=1``, fresh ``python`` processes (its torchrun
form under ``torchrun``).
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
from _dist import free_port

ROOT = Path(__file__).resolve().parents[2]
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


# the three ways a block names its multi-process form (see the module docstring)
TORCHRUN = re.compile(r"^# launch: torchrun --nproc_per_node (\d+) \S+\.py$", re.M)
DEVICES = re.compile(r"^(?P<before>.*)devices=1(?P<after>.*# devices=(?P<n>\d+): .*)$", re.M)
IGNITE = re.compile(r'^(?P<before>.*)backend=None(?P<after>.*backend="gloo", nproc_per_node=(?P<n>\d+).*)$', re.M)
SEVERAL_HEADER = re.compile(r"^(\d+) processes print \(in any order\):$")


@dataclass(frozen=True)
class SeveralProcesses:
    """A block's multi-process form: how it is launched, and what its processes print together."""

    how: str  # the form, as the block names it
    processes: int
    code: str  # the block's code in that form
    torchrun: bool  # launched by torchrun (else the program starts its processes itself)
    expected: tuple[str, ...] | None  # every line the processes print, in any order

    @property
    def forked_ranks(self) -> bool:
        """Run by the forking runner as ranks with torchrun's variables: a torchrun form, and a Lightning one (its
        launcher takes processes that have those variables as started for it, so no rank imports Lightning again;
        ``SHARDPLUG_DOCS_FRESH=1`` runs it as ``python example.py``, Lightning's launcher starting the others)."""
        return self.torchrun or self.how.startswith("devices=")


@dataclass(frozen=True)
class Example:
    page: Path
    line: int  # the line of the opening fence
    code: str
    needs: tuple[str, ...]  # distributions named by `# needs:`
    expected: tuple[str, ...] | None  # the output shown by the block's last comment lines, if any
    several: SeveralProcesses | None = None  # the multi-process form the block names, if any

    @property
    def slow(self) -> bool:
        """The block says ``# slow: WHY`` in its first two lines: run only with ``SHARDPLUG_DOCS_SLOW=1``."""
        return any(line.startswith("# slow:") for line in self.code.splitlines()[:2])

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def several_processes(code: str, expected: tuple[str, ...] | None) -> SeveralProcesses | None:
    """The multi-process form a block names (``None``: one process only), with its expected output."""
    launch = TORCHRUN.search(code)
    if launch:
        n = int(launch.group(1))
        return SeveralProcesses(f"torchrun --nproc_per_node {n}", n, code, True, expected)
    for pattern, replacement in ((DEVICES, "devices={n}"), (IGNITE, 'backend="gloo", nproc_per_node={n}')):
        match = pattern.search(code)
        if match:  # the line that names the form, rewritten into it
            n = int(match.group("n"))
            how = replacement.format(n=n)
            code = code[: match.start()] + match.group("before") + how + match.group("after") + code[match.end() :]
            return SeveralProcesses(how, n, code, False, expected)
    return None


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
    output = list(reversed(tail)) if tail and code_lines > 0 else None
    several_output: tuple[str, ...] | None = None
    if output is not None:
        header = next((k for k, text in enumerate(output) if SEVERAL_HEADER.match(text)), None)
        if header is not None:
            several_output = tuple(output[header + 1 :])
            output = output[:header]
    expected = tuple(output) if output else None
    return Example(page, line, code, needs, expected, several_processes(code, several_output))


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
    absent = [n for n in example.needs if importlib.util.find_spec(MODULE_OF.get(n, n.replace("-", "_"))) is None]
    if example.slow and os.environ.get("SHARDPLUG_DOCS_SLOW") != "1":
        absent.append("SHARDPLUG_DOCS_SLOW=1 (a slow block)")
    return absent


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    paths = [str(ROOT), str(ROOT / "integrations" / "lightning"), str(ROOT / "integrations" / "ignite")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTHONUNBUFFERED", None)  # unbuffered, the prints of several processes would interleave within a line
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


# torch 2.13's gloo aborts a DistributedDataParallel program at its exit now and then (about 1 run in 7,
# with no shardplug code at all: a Linear under DDP, four steps, destroy_process_group()); torchrun
# then reports the process's SIGABRT. Such a run, and only such a run, is started once more.
TORCH_EXIT_ABORT = "terminate called without an active exception"


def run_several(example: Example, done: subprocess.CompletedProcess | None = None) -> subprocess.CompletedProcess:
    """A block's multi-process form (:func:`launch_several`, unless ``done`` is its run already), started
    once more when the only failure was torch's abort at exit (:data:`TORCH_EXIT_ABORT`)."""
    done = launch_several(example) if done is None else done
    if done.returncode != 0 and TORCH_EXIT_ABORT in done.stderr + done.stdout:
        done = launch_several(example)
    return done


def launch_several(example: Example) -> subprocess.CompletedProcess:
    """A block's multi-process form, in an empty directory: under ``torchrun --standalone`` when the
    block names torchrun, else as ``python example.py`` (the block starts its own processes).
    torchrun starts its processes unbuffered (``python -u``), so their prints would interleave within
    a line: each process's standard output goes to a file of its own, and the result holds them one
    after the other, process 0 first."""
    several = example.several
    assert several is not None
    with tempfile.TemporaryDirectory(prefix="shardplug-docs-") as cwd:
        script = Path(cwd) / "example.py"
        script.write_text(several.code, encoding="utf-8")
        logs = Path(cwd) / "logs"
        launcher = [
            *("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={several.processes}"),
            *("--redirects", "1", "--log-dir", str(logs)),
        ]
        # a block that starts its own processes gets a free port (Ignite's Parallel takes 2222 without one)
        port = {} if several.torchrun else {"MASTER_PORT": str(free_port())}
        done = subprocess.run(
            [sys.executable, *(launcher if several.torchrun else []), str(script)],
            cwd=cwd,
            env={**environment(), **port},
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        if several.torchrun:
            outputs = sorted(logs.glob("*/attempt_*/*/stdout.log"), key=lambda path: int(path.parent.name))
            done.stdout = "".join(path.read_text(errors="replace") for path in outputs) + done.stdout
        return done


def run_forked(examples: list[Example], workers: int, several: bool = False) -> dict[str, subprocess.CompletedProcess]:
    """Every block through ``tests/_docs_runner.py``: one interpreter imports torch (and Lightning, Ignite
    where a block needs them) once and forks a child per block, in an empty directory of its own.
    ``several``: each block's multi-process form, a torchrun form as one child per process (its output
    process 0 first, as :func:`launch_several` gives it), ``workers`` processes at a time."""
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
            form = example.several if several else None
            (cwd / "example.py").write_text(example.code if form is None else form.code, encoding="utf-8")
            job = {
                "name": example.name,
                "script": str(cwd / "example.py"),
                "cwd": str(cwd),
                "stdout": str(Path(root) / f"{i}.out"),
                "stderr": str(Path(root) / f"{i}.err"),
            }
            if form is not None:  # the processes it runs: started by the runner, or by the block (Ignite's Parallel)
                job["ranks" if form.forked_ranks else "processes"] = form.processes
            jobs.append(job)
        spec = Path(root) / "jobs.json"
        spec.write_text(json.dumps({"workers": workers, "timeout": TIMEOUT_S, "preload": preload, "jobs": jobs}))
        done = subprocess.run(
            [
                sys.executable,
                str(ROOT / "tests" / "_docs_runner.py"),
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

        def output(path: str, job: dict) -> str:
            files = [f"{path}.{rank}" for rank in range(job["ranks"])] if "ranks" in job else [path]
            return "".join(Path(f).read_text(errors="replace") for f in files if Path(f).exists())

        return {
            job["name"]: subprocess.CompletedProcess(
                job["script"], codes[job["name"]], output(job["stdout"], job), output(job["stderr"], job)
            )
            for job in jobs
        }


class _Done:
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
        yield {name: _Done(value) for name, value in run_forked(chosen, workers).items()} if chosen else {}
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures: dict[str, Future] = {e.name: pool.submit(run, e) for e in chosen}
        yield futures
        for f in futures.values():
            f.cancel()


@pytest.fixture(scope="module")
def several_results(request):
    """Runs the multi-process form of every selected, runnable block that has one, two at a time: forked
    as :func:`results` does, or, with ``SHARDPLUG_DOCS_FRESH=1`` or where there is no ``fork``, launched
    fresh (:func:`launch_several`)."""
    selected = {
        item.callspec.params["example"].name
        for item in request.session.items
        if getattr(item, "callspec", None)
        and "example" in item.callspec.params
        and item.originalname == "test_example_runs_on_several_processes_and_prints_what_it_shows"
    }
    chosen = [e for e in EXAMPLES if e.name in selected and e.several is not None and not missing(e)]
    if hasattr(os, "fork") and not os.environ.get("SHARDPLUG_DOCS_FRESH"):
        chosen.sort(key=lambda e: not e.needs)  # the slowest kinds first
        done = run_forked(chosen, workers=4, several=True) if chosen else {}
        yield {e.name: _Done(run_several(e, done[e.name])) for e in chosen}
        return
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures: dict[str, Future] = {e.name: pool.submit(run_several, e) for e in chosen}
        yield futures
        for f in futures.values():
            f.cancel()


SEVERAL = [e for e in EXAMPLES if e.several is not None]


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


def test_every_multi_process_form_shows_what_its_processes_print():
    """A block that names a multi-process form states that form's output, for the right number of processes."""
    assert len(SEVERAL) >= 10, [e.name for e in SEVERAL]
    for example in SEVERAL:
        assert example.several is not None and example.several.expected, (
            f"{example.name} names the form {example.several.how!r} but not what it prints: end the block with "
            f"'# {example.several.processes} processes print (in any order):' and those lines"
        )
        header = next(line for line in example.code.splitlines() if SEVERAL_HEADER.match(line.lstrip("# ")))
        assert header.startswith(f"# {example.several.processes} processes"), (example.name, header)


@pytest.mark.parametrize("example", SEVERAL, ids=[e.name for e in SEVERAL])
def test_example_runs_on_several_processes_and_prints_what_it_shows(example, several_results):
    absent = missing(example)
    if absent:
        pytest.skip(f"needs {', '.join(absent)}")
    several = example.several
    done = several_results[example.name].result()
    assert done.returncode == 0, (
        f"{example.name} as {several.how} exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    if several.expected is not None:
        assert sorted(done.stdout.splitlines()) == sorted(several.expected), (
            f"{example.name} as {several.how}: its closing comments are not what the processes printed:\n{done.stdout}"
        )
