"""Where a pass stands and where the next one starts: the saved :class:`~shardplug.core.resume.position.Position`,
the loader's resume state (:mod:`~shardplug.core.resume.state`) with its pieces (the pending start
:mod:`~shardplug.core.resume.pending`, the refusals :mod:`~shardplug.core.resume.checks`, the lengths
:mod:`~shardplug.core.resume.lengths`), and the ``StatefulDataLoader``'s own state
(:mod:`~shardplug.core.resume.stateful`)."""
