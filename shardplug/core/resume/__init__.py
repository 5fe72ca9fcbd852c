"""Where a pass stands and where the next one starts: the saved :class:`~shardplug.core.resume.position.Position`,
the keeping of it (:mod:`~shardplug.core.resume.keeping`), and the ``StatefulDataLoader``'s own state
(:mod:`~shardplug.core.resume.stateful`)."""
