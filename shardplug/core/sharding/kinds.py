"""The kinds of sharding: what the planner recognised (:class:`ShardingKind`), and what a kind's module
hands back (:class:`Shard`).

:func:`~shardplug.core.planner.prepare_data_loader` recognises the kind once
(:func:`~shardplug.core.planner.kind_of`; for a stream in one look,
:func:`~shardplug.core.sharding.stream_traits.stream_kind`) and calls that kind's module once, whose
``shard()`` returns a :class:`Shard`: all the planner needs to build the loader.

Example::

    >>> ShardingKind(NATIVE, splits_by_worker=True)
    ShardingKind(name='native', split=None, splits_by_worker=True, hf=False, library=None, reads=None)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    from shardplug.core.sharding.shard_plan import ShardPlan

__all__ = [
    "MAP_STYLE",
    "MIXTURE",
    "DISTRIBUTED_SAMPLER",
    "TOKEN_BUDGET",
    "DISPATCH",
    "LOCAL",
    "PRESPLIT",
    "NATIVE",
    "READ_ALL",
    "NodeSplit",
    "ShardingKind",
    "Shard",
]

MAP_STYLE = "map_style"
"""Map-style data: every process draws one order, and takes its batches (:mod:`~shardplug.core.sharding.map_style`)."""
MIXTURE = "mixture"
"""A :class:`~shardplug.core.sharding.mixture.Mixture`: map-style data whose order is its own, a pure function
of the global position (:mod:`~shardplug.core.sharding.mixture`)."""
DISTRIBUTED_SAMPLER = "distributed_sampler"
"""Map-style data read through a user's torch ``DistributedSampler``: its order, its batches as under native DDP
(:mod:`~shardplug.core.sharding.distributed_sampler`)."""
TOKEN_BUDGET = "token_budget"
"""Map-style data in micro-batches by a token budget, planned for all processes at once
(:mod:`~shardplug.core.sharding.token_budget`)."""
DISPATCH = "dispatch"
"""Process 0 reads the data for every process and sends each its rows (:mod:`shardplug.core.dispatch`)."""
LOCAL = "local"
"""A stream this process reads as it is: one process (:mod:`~shardplug.core.sharding.local`)."""
PRESPLIT = "presplit"
"""A stream already split by node: each process reads its part as it is (:mod:`~shardplug.core.sharding.presplit`)."""
NATIVE = "native"
"""A stream that shards itself into one part per process (:mod:`~shardplug.core.sharding.native`)."""
READ_ALL = "read_all"
"""A stream every process reads whole, keeping its slices (:mod:`~shardplug.core.sharding.read_all`)."""


@dataclasses.dataclass(frozen=True)
class NodeSplit:
    """How a stream is already split by node (process): ``how`` in words, and the part it reads
    (``rank`` of ``world_size``) where the stream says (``None``: it asks ``torch.distributed``
    when it is read, so it is this process's)."""

    how: str
    rank: int | None = None
    world_size: int | None = None


class ShardingKind(NamedTuple):
    """The kind of sharding a loader gets (``name``, one of the names above), and what its module needs of
    the stream, read once where the kind was recognised: how it is already split by node (``split``),
    whether it splits itself across DataLoader workers, is a Hugging Face stream (``hf``), and which
    streaming library's ``StreamingDataset`` it is (``library``).  For dispatch, ``reads``: the kind
    process 0 reads the data by, for every process (:data:`MAP_STYLE`, or :data:`LOCAL` for a stream)."""

    name: str
    split: NodeSplit | None = None
    splits_by_worker: bool = False
    hf: bool = False
    library: str | None = None
    reads: str | None = None


class Shard(NamedTuple):
    """What a kind's module hands the planner: the dataset the rebuilt DataLoader reads, its plan, its
    keywords (batch size, ``drop_last``, or the (batch) sampler), the generator to synchronise from
    process 0 at each pass (``None``: none), and what the processes compare when the loader is
    prepared (``None``: nothing; see ``agree_at_prepare``)."""

    dataset: Any
    plan: ShardPlan
    loader_kwargs: dict[str, Any]
    synchronized_generator: torch.Generator | None = None
    prepare_check: tuple[int | None, int | None] | None = None
