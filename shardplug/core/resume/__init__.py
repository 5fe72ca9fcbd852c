"""Positions as values: the saved :class:`~shardplug.core.resume.position.Position`, its refusals
(:mod:`~shardplug.core.resume.checks`) and the ``StatefulDataLoader``'s own state
(:mod:`~shardplug.core.resume.stateful`). A loader's place (its epoch, the start of its next pass, the
counters of its pass and the lengths that follow from them) is its cursor (:mod:`~shardplug.core.loader.cursor`);
its positions are read and written by its resume state (:mod:`~shardplug.core.loader.resume_state`)."""
