"""Spawn real gloo process groups for the tests, with a hard timeout (test helper)."""

from __future__ import annotations

import faulthandler
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple, timeout: float = 60.0
) -> None:
    # a rank that hangs prints where (every thread) just before the parent kills it
    faulthandler.dump_traceback_later(max(timeout - 5.0, 1.0), exit=False)
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
    fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 60.0, allow_deaths: bool = False
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    Returns what each rank returned, by rank. Raises ``AssertionError`` with the traceback of any
    rank that failed, and ``TimeoutError`` (after killing them) when ranks outlive ``timeout``.
    With ``allow_deaths``, a rank that died without a result (killed) gives ``None`` instead.
    """
    import time

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, port, out_dir, fn, args, timeout))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} were still running after {timeout} s")
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
