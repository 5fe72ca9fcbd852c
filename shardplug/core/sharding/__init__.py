"""Which rows each process gets, how many batches that is, and where a pass resumes: one module per kind.

:func:`~shardplug.core.planner.prepare_data_loader` (the planner) validates the options once into a
:class:`~shardplug.core.sharding.layout.ShardLayout`, picks the kind of sharding once and hands over to that
kind's module, which holds its whole path (its wrapper, its plan, its length, where its pass resumes):

* :mod:`~shardplug.core.sharding.map_style`: map-style data; a batch sampler's global batches shared out by
  index arithmetic (:mod:`~shardplug.core.sharding.arithmetic`) or by walking them.
* :mod:`~shardplug.core.sharding.distributed_sampler`: map-style data read through a user's ``DistributedSampler``:
  the batches native DDP gives, its rest dealt over any number of processes on a resume.
* :mod:`~shardplug.core.sharding.token_budget`: map-style data in micro-batches by a token budget, planned for
  all processes at once (the plan: :mod:`~shardplug.core.sharding.budget_plan`; the packing collate:
  :mod:`~shardplug.core.sharding.packing`).
* :mod:`~shardplug.core.sharding.read_all`: a stream every process reads whole, keeping its part of each
  global batch (checked alike by :mod:`~shardplug.core.sharding.fingerprint`).
* :mod:`~shardplug.core.sharding.native`: a stream that shards itself (``n_shards``, ``shard()``).
* :mod:`~shardplug.core.sharding.presplit`: a stream already split by node (litdata, MosaicML streaming).
* :mod:`~shardplug.core.sharding.local`: data this process reads as it is (one process, or process 0 of dispatch).
* dispatch: :mod:`shardplug.core.dispatch` (process 0 reads, every process receives its rows).

Every plan answers the protocol of :mod:`~shardplug.core.sharding.shard_plan`;
:mod:`~shardplug.core.sharding.stream_traits` reads what a stream already does by itself (the planner's one
look at a stream); :mod:`~shardplug.core.sharding.kinds` names the kinds and what a kind's ``shard()`` hands
back; :mod:`~shardplug.core.sharding.counting` is the one batch counter of their lengths.

A position counts what the whole job consumed of the epoch in the plan's ``unit`` (global
batches, stream elements, or this loader's batches); ``num_batches(consumed)`` is the number of
batches this process yields after it, with this plan's number of processes: so a position saved
with N processes continues with M.

Example::

    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> from shardplug.core.sharding.layout import ShardLayout
    >>> from shardplug.core.sharding.map_style import BatchSamplerPlan
    >>> plan = BatchSamplerPlan(BatchSampler(SequentialSampler(range(21)), 3, False), ShardLayout(2, 1, batch_size=3))
    >>> plan.num_batches(), plan.num_batches(consumed=4)
    (4, 2)
    >>> [batch for batch, real in plan.batches(consumed=4)]
    [[15, 16, 17], [0, 1, 2]]
"""
