"""Run a function on N real gloo processes and collect what each returned (test helper)."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank))
    result: Any
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # report it to the test instead of losing it in a child process
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes; return the results by rank.

    A process that raised makes this raise with its traceback; a process still running after
    ``timeout`` seconds is killed and reported (never a hang).
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, out_dir, fn, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} were still running after {timeout} s")
        results = []
        for r in range(world_size):
            path = Path(out_dir, f"rank{r}.pkl")
            if not path.exists():
                raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            status, value = pickle.loads(path.read_bytes())
            results.append((status, value))
    return results


def values(results: list[Any]) -> list[Any]:
    """The values of ``run_distributed`` results, raising if any rank failed."""
    errors = [f"rank {r}: {v}" for r, (s, v) in enumerate(results) if s != "ok"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [v for _, v in results]
