"""How a scenario program becomes N gloo ranks and how a rank ends (a helper of the scripts here).

:func:`launch` makes the program rank 0 of a group of ``n`` and starts ranks 1 .. n-1 as copies of it
(fresh processes, as Lightning's launcher does: a rank that kills itself ends that process alone, and
the test kills the session's leftovers). :func:`leave` ends a rank once every rank has written.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch.distributed as dist


def launch(n: int) -> int:
    """Start ranks 1 .. ``n``-1 (copies of this program) unless this is one, join the gloo group of
    ``n``; returns this process's rank."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), RANK="0", LOCAL_RANK="0")
        for rank in range(1, n):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank))
            subprocess.Popen([sys.executable, *sys.argv], env=env)
    dist.init_process_group("gloo")
    return dist.get_rank()


def leave() -> None:
    """Wait for every rank, then exit without the interpreter's teardown (a gloo rank of this torch
    sometimes aborts in its C++ teardown after all its work is done)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
