"""litdata and MosaicML ``streaming`` datasets written to a local directory (test helper).

``streaming``'s package ``__init__`` imports ``streaming.vision`` and so torchvision, which is not
installed where torch is a CPU build without a matching torchvision (PyPI's torchvision needs
torch's CUDA libraries, and a broken torchvision breaks ``import lightning``).  Its datasets live in
``streaming.base``, which needs no torchvision: :func:`streaming_base` imports that directly when
the package itself does not import.  DataLoader workers of such a process must not import
``streaming`` again: they come from a fork server that imported ``_streaming_base`` (see
:data:`WORKER_PRELOAD`).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from _dist import PRELOAD

WORKER_PRELOAD = [*PRELOAD, "_streaming_base", "litdata"]
"""What the fork server of DataLoader workers that read streaming datasets imports
(``worker_context(n, WORKER_PRELOAD)``; a module that is not installed is passed over): litdata too, which a worker
imported again for every pass (a pass of 16 batches on 2 workers took 1.2 s, 0.3 s with litdata preloaded)."""


def streaming_base() -> Any:
    """``streaming.base`` (skips the test when MosaicML streaming is not installed)."""
    base = import_streaming_base()
    if base is None:
        pytest.skip("mosaicml-streaming is not installed")
    return base


def import_streaming_base() -> Any:
    """``streaming.base``, or ``None`` when MosaicML streaming is not installed (see the module's description)."""
    spec = importlib.util.find_spec("streaming")
    if spec is None or spec.submodule_search_locations is None:
        return None
    try:
        importlib.import_module("streaming")
    except (ImportError, RuntimeError):  # streaming.vision without a working torchvision
        for name in [n for n in sys.modules if n == "streaming" or n.startswith("streaming.")]:
            del sys.modules[name]
        package = types.ModuleType("streaming")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = importlib.machinery.ModuleSpec("streaming", None, is_package=True)
        package.__spec__.submodule_search_locations = package.__path__
        sys.modules["streaming"] = package
    return importlib.import_module("streaming.base")


def litdata_module() -> Any:
    return pytest.importorskip("litdata")


def write_litdata(directory: str | Path, n: int, chunk_size: int = 4) -> str:
    """``n`` samples ``{"index": i}`` in litdata chunks of ``chunk_size`` under ``directory``."""
    from litdata.streaming.cache import Cache

    litdata_module()
    cache = Cache(input_dir=str(directory), chunk_size=chunk_size)
    for i in range(n):
        cache[i] = {"index": i}
    cache.done()
    cache.merge()
    return str(directory)


def write_mds(directory: str | Path, n: int, samples_per_shard: int = 4) -> str:
    """``n`` samples ``{"index": i}`` in MDS shards of about ``samples_per_shard`` under ``directory``."""
    base = streaming_base()
    with base.MDSWriter(out=str(directory), columns={"index": "int"}, size_limit=64 * samples_per_shard) as writer:
        for i in range(n):
            writer.write({"index": i})
    return str(directory)


def streaming_world(rank: int, world_size: int) -> None:
    """The environment streaming reads its ranks from (torchrun sets it; a spawned test process does not)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
