"""Dispatch mode: process 0 reads the data and scatters each process its own rows.

* :mod:`~shardplug.core.dispatch.dispatcher`: :class:`DataLoaderDispatcher`, its options and wiring.
* :class:`~shardplug.core.dispatch.dispatch_plan.DispatchPlan`: which rows of a step go to which process, the
  padding of a short last step, the check of the batches joined into one step.
* :mod:`~shardplug.core.dispatch.wire_protocol`: the wire protocol (the message before every step,
  the header, what follows), :class:`DispatchError`, :class:`DispatchStats`.
* :mod:`~shardplug.core.dispatch.sender`: process 0 reads each step and sends the others their rows.
* :mod:`~shardplug.core.dispatch.receiver`: the other processes receive theirs.
* :mod:`~shardplug.core.dispatch.wire`: :class:`Wire`, the process group and its traffic, one part per job:
  :mod:`~shardplug.core.dispatch.liveness`, :mod:`~shardplug.core.dispatch.timed_waits`,
  :mod:`~shardplug.core.dispatch.object_collectives`, :mod:`~shardplug.core.dispatch.receipts`,
  :mod:`~shardplug.core.dispatch.ring_slots`.
* :mod:`~shardplug.core.dispatch.shm`: shared-memory rings, collation straight into them, receipt counters.
"""
