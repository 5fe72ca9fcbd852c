"""Positions as values: the saved :class:`~shardplug.core.resume.position.Position`, its refusals
(:mod:`~shardplug.core.resume.checks`), the lengths that depend on where a pass starts
(:mod:`~shardplug.core.resume.lengths`) and the ``StatefulDataLoader``'s own state
(:mod:`~shardplug.core.resume.stateful`). A loader's place, with the start of its next pass, is its cursor
(:mod:`~shardplug.core.loader.cursor`); its positions are read and written by its resume state
(:mod:`~shardplug.core.loader.resume_state`)."""
