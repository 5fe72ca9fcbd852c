"""The prepared loader: its settings (:mod:`~shardplug.core.loader.prepared`), one pass over it
(:mod:`~shardplug.core.loader.passes`), the move of its batches to a device (:mod:`~shardplug.core.loader.transfer`)
and the one walker over nested batches (:mod:`~shardplug.core.loader.rows`)."""
