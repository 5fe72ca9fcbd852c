"""How a scenario program becomes N gloo ranks and how a rank ends (a helper of the scripts here).

:func:`start_ranks` makes the program rank 0 of a group of ``n`` and forks ranks 1 .. n-1 from it (a rank
that kills itself ends that process alone, and the test kills the session's leftovers); :func:`launch` also joins
their gloo group. :func:`leave` ends a rank once every rank has written.
"""

from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist


def start_ranks(n: int) -> int:
    """Make this program rank 0 of ``n`` and fork ranks 1 .. ``n``-1 from it (unless the environment already
    names this process's rank), with the variables a rank of ``torchrun`` has (so Lightning and Fabric take
    the processes as started for them); returns this process's rank. A fork, not a fresh interpreter: a rank
    starts with what the program has imported (torch, its front end), which a fresh one took seconds to import
    again; no thread runs yet (the group is joined after), so the fork is safe."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), RANK="0", LOCAL_RANK="0")
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(1, n):
        if os.fork() == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
            return rank
    return 0


def launch(n: int) -> int:
    """:func:`start_ranks`, then join the gloo group of ``n``; returns this process's rank."""
    start_ranks(n)
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
