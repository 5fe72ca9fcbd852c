"""The fast tier of the test suite: ``SHARDPLUG_TESTS=fast`` (``make test-fast``).

The whole suite (``make test``, what CI runs) starts real process groups: gloo ranks, ``torchrun``,
Lightning's and Ignite's launchers, example programs. The fast tier runs every test in this
process only: a test (or a fixture it uses) that starts another program or a spawned process is
skipped at that moment, with the reason. DataLoader workers still run (forked, or from the tests'
fork server: tests/_dist.py). Nothing has to be marked, so a new multi-process test joins the right
tier by itself.
"""

from __future__ import annotations

import multiprocessing.context
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

FAST = os.environ.get("SHARDPLUG_TESTS", "") == "fast"
_REASON = "starts processes: the fast tier (SHARDPLUG_TESTS=fast, make test-fast) skips it; make test runs it"


def _skip(*args: Any, **kwargs: Any) -> Any:
    pytest.skip(_REASON)


@pytest.fixture(scope="session", autouse=True)
def _fast_tier_starts_no_process() -> Iterator[None]:
    """In the fast tier, starting a program or a spawned process skips the test that does it."""
    if not FAST:
        yield
        return
    import _dist  # tests/, on the path by pytest's pythonpath
    import torch.multiprocessing as torch_mp

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", _skip)  # subprocess.run, torchrun, Lightning's launcher, ray.init
        patch.setattr(_dist, "_start", _skip)  # tests/_dist.run_gloo's ranks (forks of a fork server)
        patch.setattr(multiprocessing.context.SpawnProcess, "start", _skip)  # a spawned process of a test
        patch.setattr(torch_mp, "start_processes", _skip)  # torch.multiprocessing.spawn, ignite's Parallel
        patch.setattr(torch_mp, "spawn", _skip)
        yield
