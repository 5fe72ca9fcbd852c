"""The one place where ``shardplug explain`` reaches into the core: every import of shardplug's
internals is here, so the rest of the package uses the public API and these few functions.

The answers come from the planner ``prepare_data_loader`` builds (its plans, the dispatcher's
step reader): nothing here restates a rule of which rows a process gets.

Example::

    >>> loader = prepared(LoaderSpec(samples=5, batch_size=2), num_processes=2, process_index=1)
    >>> shard_batches(loader, consumed=0)
    [([2, 3], 2), ([1, 2], 0)]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset

import shardplug
from shardplug.core._internal.arguments import is_int
from shardplug.core._internal.rows import slice_rows
from shardplug.core.dispatch.dispatch_plan import DispatchPlan
from shardplug.core.dispatch.sender import StepReader
from shardplug.core.dispatch.wire import Wire
from shardplug.core.sharding.map_style import BatchSamplerPlan
from shardplug.core.sharding.mixture import MixturePlan
from shardplug.core.sharding.shard_plan import PassRecord

__all__ = [
    "LoaderSpec",
    "is_int",
    "prepared",
    "shard_batches",
    "shard_length",
    "dispatched_batches",
    "dispatched_length",
    "Batches",
    "source_labels",
]

Batches = list[tuple[list[int], int]]
"""One process's batches: each batch's dataset indices and how many of its leading ones are real."""


@dataclass(frozen=True)
class LoaderSpec:
    """The ``DataLoader`` over ``range(samples)`` and the options of ``prepare_data_loader``."""

    samples: int
    batch_size: int
    split_batches: bool = False
    even_batches: bool = True
    drop_last: bool = False
    shuffle: bool = False
    seed: int | None = None
    mixture: tuple[tuple[str, int, float], ...] = ()
    """``(name, length, weight)`` of each source of a ``shardplug.Mixture`` (seeded by ``seed``, ``samples``
    positions an epoch) instead of ``range(samples)``; empty for none."""

    def dataloader(self) -> DataLoader[Any]:
        if self.mixture:
            sources = {name: range(length) for name, length, _ in self.mixture}
            weights = {name: weight for name, _, weight in self.mixture}
            mixture = shardplug.Mixture(sources, weights, seed=self.seed or 0, samples_per_epoch=self.samples)
            return DataLoader(mixture, batch_size=self.batch_size, drop_last=self.drop_last)
        data = cast("Dataset[int]", range(self.samples))  # a range is a map-style dataset of its integers
        return DataLoader(data, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=self.drop_last)


def prepared(spec: LoaderSpec, num_processes: int, process_index: int, epoch: int = 0) -> shardplug.PreparedDataLoader:
    """Process ``process_index``'s loader of ``num_processes``, as ``prepare_data_loader`` makes it
    (no process group: the shuffle's seed is ``data_seed=spec.seed``), at the start of ``epoch``."""
    loader = shardplug.prepare_data_loader(
        spec.dataloader(),
        num_processes=num_processes,
        process_index=process_index,
        split_batches=spec.split_batches,
        even_batches=spec.even_batches,
        data_seed=spec.seed if spec.shuffle and not spec.mixture else None,
        put_on_device=False,
    )
    loader.set_epoch(epoch)
    return loader


def _map_plan(loader: shardplug.PreparedDataLoader) -> BatchSamplerPlan:
    plan = loader.plan
    if not isinstance(plan, BatchSamplerPlan):  # DataLoader(range(n), batch_size=b): always map-style batches
        raise TypeError(f"expected the plan of map-style batches, got {type(plan).__name__}")
    return plan


def shard_batches(loader: shardplug.PreparedDataLoader, consumed: int) -> Batches:
    """The batches ``loader`` yields after ``consumed`` global batches of its epoch, with their
    real counts: its plan's answer (indices only, nothing is loaded; a mixture's as positions in the epoch)."""
    plan = _map_plan(loader)
    size = len(plan.mixture) if isinstance(plan, MixturePlan) else None
    return [([i % size for i in batch] if size else list(batch), int(real)) for batch, real in plan.batches(consumed)]


def source_labels(loader: shardplug.PreparedDataLoader, epoch: int, indices: list[int]) -> list[str]:
    """What a mixture's positions ``indices`` of ``epoch`` read, as ``<source><sample>`` (``[]``: not a mixture)."""
    plan = loader.plan
    if not isinstance(plan, MixturePlan):
        return []
    start = epoch * len(plan.mixture)
    return [f"{d.source}{d.sample}" for d in plan.mixture.locate_many([start + i for i in indices])]


def shard_length(loader: shardplug.PreparedDataLoader, consumed: int) -> int:
    """``len()`` of ``loader``'s pass after ``consumed`` global batches (its plan's answer)."""
    return _map_plan(loader).num_batches(consumed)


def dispatched_batches(
    reader: shardplug.PreparedDataLoader, loader: shardplug.PreparedDataLoader, consumed: int
) -> list[Batches]:
    """Every process's batches under ``dispatch_batches=True``, after ``consumed`` global batches.

    ``reader`` is process 0's reading loader (one process: the global batches), ``loader`` any
    process's loader of the job (its layout); the steps are made and cut by the dispatcher's own
    step reader and plan, as process 0 does without a process group.
    """
    source = _map_plan(reader)
    layout = loader.plan.layout
    plan = DispatchPlan(layout, source.num_batches(0), source)
    record = PassRecord(track=True)  # the source's batches come with their real counts

    def global_batches() -> Iterator[torch.Tensor]:
        for batch, _ in source.batches(consumed, record):
            yield torch.tensor(batch, dtype=torch.int64)

    def load(indices: list[int]) -> torch.Tensor:
        return torch.tensor(indices, dtype=torch.int64)

    steps = StepReader(
        plan,
        Wire(),
        global_batches,
        slice_rows,
        uncut=not layout.split_batches,
        collate=None,
        record=record,
        load=load,
    )
    out: list[Batches] = [[] for _ in range(layout.num_processes)]
    for step, _slot, padding in steps.steps():  # where each step's padding begins: the plan's answer
        for j, part in enumerate(plan.cut(step, slice_rows)):
            rows = [int(i) for i in part.tolist()]
            out[j].append((rows, padding.real_rows(j, len(rows))))
    return out


def dispatched_length(reader: shardplug.PreparedDataLoader, loader: shardplug.PreparedDataLoader, consumed: int) -> int:
    """``len()`` of every process's dispatcher after ``consumed`` global batches."""
    source = _map_plan(reader)
    length = DispatchPlan(loader.plan.layout, source.num_batches(0), source).num_batches(consumed)
    return int(length) if length is not None else 0
