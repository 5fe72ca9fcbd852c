"""The prepared loader: its settings (:mod:`~shardplug.core.loader.prepared`), one pass over it
(:mod:`~shardplug.core.loader.passes`), its resume state (:mod:`~shardplug.core.loader.resume_state`, which
places each pass with :mod:`~shardplug.core.loader.placing` and builds positions with
:mod:`~shardplug.core.loader.building`) and the move of its batches to a device
(:mod:`~shardplug.core.loader.transfer`)."""
