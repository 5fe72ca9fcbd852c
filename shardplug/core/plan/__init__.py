"""Which rows one process gets in one epoch, how many batches that is, and where a pass resumes.

One plan per kind of sharding, all answering the same small protocol (:class:`ShardPlan`):

* :class:`BatchSamplerPlan`: map-style data; the global batches of a batch sampler, shared out
  by index arithmetic (standard samplers) or by walking the batches (any other batch sampler).
* :class:`StreamPlan`: a stream every process reads whole, keeping its part of each global batch.
* :class:`NativeStreamPlan`: a stream that sharded itself (each process reads only its shards);
  equal step counts from the parts' lengths, or from an agreement on when the first runs out.
* :class:`LocalPlan`: the loader's own batches are this process's part (data nobody else reads).
* :class:`DispatchPlan`: process 0 reads, every process receives its rows of each step.

A position counts what the whole job consumed of the epoch in the plan's ``unit`` (global
batches, stream elements, or this loader's batches); ``num_batches(consumed)`` is the number of
batches this process yields after it, with this plan's number of processes: so a position saved
with N processes continues with M.

Example::

    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> from shardplug.core.layout import ShardLayout
    >>> plan = BatchSamplerPlan(BatchSampler(SequentialSampler(range(21)), 3, False), ShardLayout(2, 1, batch_size=3))
    >>> plan.num_batches(), plan.num_batches(consumed=4)
    (4, 2)
    >>> [batch for batch, real in plan.batches(consumed=4)]
    [[15, 16, 17], [0, 1, 2]]
"""

from __future__ import annotations

from ..layout import ShardLayout
from .dispatch import DispatchPlan
from .local import LocalPlan
from .map_style import BatchSamplerPlan
from .native import NativeStreamPlan
from .padding import PaddingTag, TagCollate, TaggedBatch
from .protocol import UNITS, PassRecord, ShardPlan, sized_length
from .streams import StreamPlan

__all__ = [
    "ShardPlan",
    "PassRecord",
    "BatchSamplerPlan",
    "StreamPlan",
    "LocalPlan",
    "NativeStreamPlan",
    "DispatchPlan",
    "UNITS",
    "sized_length",
    "PaddingTag",
    "TaggedBatch",
    "TagCollate",
    "ShardLayout",
]
