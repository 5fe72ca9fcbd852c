"""The samples that pad a short epoch: which a batch holds (:mod:`~shardplug.core.padding.tracking`; the
streams' readers mark them with :mod:`~shardplug.core.sharding.marks`), metrics without them
(:mod:`~shardplug.core.padding.metrics`) and the exactly-once audit (:mod:`~shardplug.core.padding.audit`).
Evaluation loaders are assembled by :mod:`~shardplug.core.evaluation`."""
