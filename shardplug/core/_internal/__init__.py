"""Plumbing no user imports: the process topology, the few collectives, and every private name of another
library the core reads (:mod:`~shardplug.core._internal.compat`)."""
