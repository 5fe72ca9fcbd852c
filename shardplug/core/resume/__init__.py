"""Positions as values: the saved :class:`~shardplug.core.resume.position.Position`, its refusals
(:mod:`~shardplug.core.resume.checks`), where the next pass starts (:mod:`~shardplug.core.resume.pending`),
the lengths that depend on where a pass starts (:mod:`~shardplug.core.resume.lengths`) and the
``StatefulDataLoader``'s own state (:mod:`~shardplug.core.resume.stateful`). The loader keeps them in its
resume state (:mod:`~shardplug.core.loader.resume_state`)."""
