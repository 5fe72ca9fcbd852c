"""The walk of the first ``next()`` of a prepared loader, held: how many Python calls it makes into shardplug and
``torch.utils.data``, through how many files (shardplug modules among them), with how many switches between
files.  Traced with :func:`sys.setprofile` (calls counted, never timed), fresh and after ``load_state_dict``.

For the same loader, torch's ``DataLoader`` with a ``DistributedSampler`` makes 10 calls through 5 files, and
torchdata's ``StatefulDataLoader`` 15 through 5.  The targets for shardplug are at most 60 calls, 8 shardplug
modules and 25 switches; :data:`BOUNDS` holds what the code reaches now (a ratchet: lower them as the walk
gets shorter, never raise them).  Those figures count torch's own calls, measured with :data:`MEASURED_WITH`;
with another torch only shardplug's part (:data:`OWN_CALLS`) is held.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader

import shardplug
from shardplug import prepare_data_loader

PACKAGE = os.path.dirname(shardplug.__file__) + os.sep
TORCH_DATA = os.sep.join(("torch", "utils", "data"))


class Walk(NamedTuple):
    calls: int
    files: int
    modules: int  # shardplug's
    switches: int


MEASURED_WITH = "2.13."
"""The torch release :data:`BOUNDS` were measured with (its ``DataLoader`` makes part of the calls)."""

OWN_CALLS = {"fresh": 32, "resumed": 35}
"""The calls into shardplug's own modules alone, whatever torch: a ratchet too."""

BOUNDS = {
    # the targets: Walk(60, ..., 8, 25) for both (all reached)
    "fresh": Walk(calls=55, files=12, modules=8, switches=24),
    "resumed": Walk(calls=58, files=12, modules=8, switches=25),
}


def trace(step: Callable[[], Any]) -> tuple[Walk, list[str]]:
    """The walk of ``step()``: calls into shardplug and ``torch.utils.data`` (a generator resumed counts)."""
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(PACKAGE) or TORCH_DATA in name:
                calls.append(name)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    switches = sum(1 for a, b in zip(calls, calls[1:]) if a != b)
    modules = {name for name in calls if name.startswith(PACKAGE)}
    return Walk(len(calls), len(set(calls)), len(modules), switches), calls


def _loader() -> Any:
    return prepare_data_loader(
        DataLoader(range(20), batch_size=4, shuffle=True), num_processes=2, process_index=0, data_seed=0
    )


def _first_next(kind: str) -> Any:
    loader = _loader()
    if kind == "resumed":
        saved = _loader()
        batches = iter(saved)
        next(batches), next(batches)
        loader.load_state_dict(saved.state_dict())
    return iter(loader)


@pytest.mark.parametrize("kind", ["fresh", "resumed"])
def test_the_first_next_walks_a_short_way(kind: str) -> None:
    batches = _first_next(kind)
    walk, calls = trace(lambda: next(batches))
    bound = BOUNDS[kind]
    where = "\n".join(name.removeprefix(PACKAGE) for name in calls)
    own = sum(1 for name in calls if name.startswith(PACKAGE))
    assert own <= OWN_CALLS[kind], f"{own} calls into shardplug, over {OWN_CALLS[kind]}:\n{where}"
    assert walk.modules <= bound.modules, f"{walk} over {bound}:\n{where}"
    if not torch.__version__.startswith(MEASURED_WITH):
        pytest.skip(f"the walk's calls into torch were measured with torch {MEASURED_WITH}x, not {torch.__version__}")
    assert walk.calls <= bound.calls, f"{walk} over {bound}:\n{where}"
    assert walk.files <= bound.files, f"{walk} over {bound}:\n{where}"
    assert walk.switches <= bound.switches, f"{walk} over {bound}:\n{where}"


STEADY_OWN_CALLS = 3
"""shardplug's calls per batch once a pass runs (the pass's generator, the sampler's pass and its batches): a
ratchet, the count behind the per-batch overhead that ``benchmarks/`` times (6 before the cursor)."""


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_running_pass_adds_few_calls_per_batch(num_processes: int) -> None:
    loader = prepare_data_loader(DataLoader(range(40), batch_size=1), num_processes=num_processes, process_index=0)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    taken: list[Any] = []
    _, calls = trace(lambda: taken.append(next(batches)))
    own = [name.removeprefix(PACKAGE) for name in calls if name.startswith(PACKAGE)]
    assert taken[0].tolist() == [5 * num_processes]  # the sixth batch of this process came out of the traced call
    assert len(own) <= STEADY_OWN_CALLS, f"{len(own)} calls into shardplug per batch: {own}"


def test_the_trace_sees_every_call_of_the_first_next() -> None:
    """The trace is no empty count: the first batch comes out of it, and its walk runs from the pass through
    torch's ``DataLoader`` (which collates the batch)."""
    batches = _first_next("fresh")
    taken: list[Any] = []
    walk, calls = trace(lambda: taken.append(next(batches)))
    assert len(taken[0]) == 4 and walk.calls > 10
    assert calls[0].startswith(PACKAGE) and any(name.endswith("collate.py") for name in calls)
