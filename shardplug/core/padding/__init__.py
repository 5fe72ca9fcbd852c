"""The samples that pad a short epoch: where they are marked (:mod:`~shardplug.core.padding.marks`), which a
batch holds (:mod:`~shardplug.core.padding.tracking`), evaluation loaders (:mod:`~shardplug.core.padding.evaluation`),
metrics without them (:mod:`~shardplug.core.padding.metrics`) and the exactly-once audit
(:mod:`~shardplug.core.padding.audit`)."""
