"""The prepared loader: its settings (:mod:`~shardplug.core.loader.prepared`, its options whole in
:mod:`~shardplug.core.loader.options`), its place as values (:mod:`~shardplug.core.loader.cursor`: the epoch,
where the next pass starts, the counters of its pass, the lengths), one pass over it as a chain of stages
(:mod:`~shardplug.core.loader.passes`), its saved positions (:mod:`~shardplug.core.loader.resume_state`, which
builds them with :mod:`~shardplug.core.loader.building`) and the move of its batches to a device
(:mod:`~shardplug.core.loader.transfer`, :mod:`~shardplug.core.loader.prefetch`)."""
