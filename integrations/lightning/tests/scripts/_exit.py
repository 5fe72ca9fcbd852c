"""How a scenario process ends: once every rank has written its results, leave at once.

A gloo rank of this torch sometimes aborts in its C++ teardown ("terminate called without an
active exception", SIGABRT) after all its work is done, with and without shardplug; the scenarios'
exit code would then fail the test although every result was written. The barrier makes sure
every rank wrote before rank 0, whose exit the test waits for, leaves.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def leave() -> None:
    """Wait for every rank (when a process group is up), then exit without the interpreter's teardown."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
