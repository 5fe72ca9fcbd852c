"""Optimizer and scheduler stepping: gradient accumulation (:mod:`~shardplug.core.stepping.accumulation`),
mixed-precision skipped steps (:mod:`~shardplug.core.stepping.amp`), the prepared optimizer and scheduler, and
:class:`~shardplug.core.stepping.training.TrainingRun`, the plain-PyTorch front door."""
