"""Spawn real gloo process groups for the tests, with a hard timeout (test helper)."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "_hf_datasets", "webdataset", "shardplug"]  # _hf_datasets: datasets, quick


def fork_server(preload: list[str] | None = None) -> Any:
    """The multiprocessing context of a fork server with torch, datasets, webdataset and shardplug
    imported (or the modules ``preload`` names: the server of a process preloads what its first
    call asks for): every process it starts is a fresh fork of that server, without the seconds of
    importing them again (the gloo ranks of :func:`run_gloo`, DataLoader workers in a rank)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD if preload is None else preload)
    from multiprocessing import forkserver

    # the server imports the tests' own modules (_hf_datasets) by PYTHONPATH: Python 3.11's fork server
    # does not take the caller's sys.path; only the server's start sees the variable
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), *([before] if before else [])])
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def worker_context(workers: int, preload: list[str] | None = None) -> Any:
    """The multiprocessing context for ``workers`` DataLoader workers in a gloo rank (None for none):
    the :func:`fork_server`.  Forking the rank itself can deadlock a worker: on CPython without the
    fix of python/cpython#112275 (3.11.7 here; seen with gdb, the child waits in
    ``_PyThreadState_DeleteExcept``) a forked child waits forever for the thread-state lock when
    another thread held it at the fork, and gloo's and pyarrow's threads run there.  Spawned workers
    would re-import torch and datasets for every pass.  ``preload``: see :func:`fork_server`."""
    return fork_server(preload) if workers else None


def free_port() -> int:
    """A TCP port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STACK_FILES: list[Any] = []  # the open files a stack dump on SIGUSR1 writes to (faulthandler needs them open)


def _dump_stacks_on_signal(path: Path) -> None:
    """On SIGUSR1, write every thread's stack to ``path`` (run_gloo asks a hung process where it waits).
    A signal, not ``faulthandler.dump_traceback_later``: its watchdog thread does not survive a fork,
    and re-arming it in a forked DataLoader worker waits for that thread forever."""
    stream = open(path, "w")  # noqa: SIM115 - faulthandler writes to it later
    _STACK_FILES.append(stream)
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)


def _entry(
    rank: int, world_size: int, port: int, out_dir: str, env: dict[str, str], fn: Callable[..., Any], args: tuple
) -> None:
    # a process group of its own: run_gloo ends whatever the rank started when the run is over, also
    # after the rank was killed (see _end_groups)
    os.setpgid(0, 0)
    # the environment of the test that started the rank, as a spawned process would inherit it (the
    # fork server's is the one of the moment it started)
    os.environ.clear()
    os.environ.update(env)
    # a rank and every DataLoader worker it forks write where they are when run_gloo finds them hung
    _dump_stacks_on_signal(Path(out_dir, f"rank{rank}.stacks"))
    os.register_at_fork(
        after_in_child=lambda: _dump_stacks_on_signal(Path(out_dir, f"rank{rank}-worker{os.getpid()}.stacks"))
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=30),
        )
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # hand it to the test instead of losing it in the child
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_gloo(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 60.0,
    allow_deaths: bool = False,
    start: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new gloo processes: fresh forks of
    the :func:`fork_server`, each with the environment, ``sys.path`` and working directory of the
    caller as a spawned process would have them.

    Returns what each rank returned, by rank. Raises ``AssertionError`` with the traceback of any
    rank that failed, and ``TimeoutError`` (after killing them) when ranks outlive ``timeout``.
    With ``allow_deaths``, a rank that died without a result (killed) gives ``None`` instead.

    ``start="spawn"`` spawns the ranks instead, as ``torchrun`` and ``mp.spawn`` start them. (Ranks
    that may die were spawned for a while: under the fork server a survivor was seen blocked in a
    gloo broadcast after its peer's SIGKILL, about 1 run in 6 under load. That was dispatch's hang of
    issue 40, which spawned ranks only made rarer; tests/dispatch/test_faults_under_load.py runs it
    under the fork server, beside a busy loop per core.)
    """
    ctx = mp.get_context("spawn") if start == "spawn" else fork_server()
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        env = dict(os.environ)
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, port, out_dir, env, fn, args)) for r in range(world_size)
        ]
        try:
            _start(procs)
            deadline = time.monotonic() + timeout
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            where = _stop_hung([p.pid for p in procs if p.is_alive() and p.pid is not None], Path(out_dir))
            for p in procs:
                p.join()
        finally:
            _end_groups([p.pid for p in procs if p.pid is not None])
        if hung:
            raise TimeoutError(f"ranks {hung} were still running after {timeout} s: {where}")
        results, errors = [], []
        for r, p in enumerate(procs):
            path = Path(out_dir, f"rank{r}.pkl")
            if not path.exists():
                if allow_deaths:
                    results.append(None)
                else:
                    errors.append(f"rank {r} died without a result (exit code {p.exitcode})")
                continue
            status, value = pickle.loads(path.read_bytes())
            if status != "ok":
                errors.append(f"rank {r}: {value}")
            results.append(value)
        if errors:
            raise AssertionError("\n".join(errors))
    return results


def _end_groups(pids: list[int]) -> None:
    """Kill what is left of the process groups of the ranks ``pids`` (each rank leads its own).

    A rank that died leaves its DataLoader workers behind when they came from a fork server: each
    child of a fork server holds the pipe whose end tells the server that its client is gone, so
    the server stays, and torch's workers watch their parent (the server), not the rank."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _start(procs: list[Any]) -> None:
    """Start the ranks of :func:`run_gloo` (the fast tier of the suite skips the test here: conftest.py)."""
    for p in procs:
        p.start()


def run_torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under a real ``torchrun --standalone --nproc_per_node nproc`` (the project on
    ``PYTHONPATH``), its output captured; the caller reads the exit code and the output."""
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return subprocess.run(
        [*command, str(script), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=root
    )


def _descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process they started, their DataLoader workers among them (Linux's /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # it ended meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _stop_hung(pids: list[int], out_dir: Path) -> str:
    """Ask the hung processes and their workers where they wait, kill them all (a worker left
    behind would outlive the test), and say where they waited."""
    if not pids:
        return ""
    processes = _descendants(pids)
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(2.0)  # the dumps are written by the processes' signal handlers
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return _where_hung(out_dir)


_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)', re.MULTILINE)


def _where_hung(out_dir: Path) -> str:
    """Where each hung process waited, on one line (its main thread's innermost frame and the
    innermost one in the project or its tests), then every dump in full."""
    summaries, dumps = [], []
    for path in sorted(out_dir.glob("*.stacks")):
        text = path.read_text(errors="replace").strip()
        if not text:
            continue  # it ended before it was asked
        dumps.append(f"--- {path.stem}\n{text}")
        main = re.split(r"^(?:Current thread|Thread) 0x[0-9a-f]+ .*$", text, flags=re.MULTILINE)[-1]
        frames = [(Path(m["path"]), m["line"], m["name"]) for m in _FRAME.finditer(main)]
        if not frames:
            continue
        ours = next((f for f in frames if _ours(f[0])), None)
        where = _frame(frames[0])
        if ours is not None and ours != frames[0]:
            where += f" (from {_frame(ours)})"
        summaries.append(f"{path.stem} in {where}")
    return ("; ".join(summaries) or "no Python stack was dumped") + "\n" + "\n".join(dumps)


def _frame(frame: tuple[Path, str, str]) -> str:
    return f"{frame[0].name}:{frame[1]} {frame[2]}"


def _ours(path: Path) -> bool:
    """A frame in the package or its tests (this helper's own frames aside)."""
    return ("shardplug" in path.parts or "tests" in path.parts) and path.name != "_dist.py"
