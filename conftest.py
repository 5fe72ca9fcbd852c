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


LONG_FIRST = (
    "tests/resume/test_boundaries.py",
    "integrations/lightning/tests/test_lightning_strategy.py",
    "tests/docs/test_docs_examples.py",
    "tests/front_ends/test_ray_train.py",
    "tests/docs/test_benchmarks_quick.py",
    "tests/streams/test_presplit_streams.py",
    "integrations/lightning/tests/test_lightning_cli.py",
)
"""The modules whose shared runs take longest (a minute or more of ``make test``'s 2 workers), longest first."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules start first: pytest-xdist hands whole modules (``--dist loadscope``) to its workers in
    collection order, so a long one collected last (``integrations/`` comes after ``tests/``) would keep one worker
    busy while the other has nothing left. The order within a module is kept."""
    first = {path: rank for rank, path in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(LONG_FIRST)))
