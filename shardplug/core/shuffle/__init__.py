"""Orders every process draws alike: seedable and bijective samplers (:mod:`~shardplug.core.shuffle.seedable`),
their agreement with process 0 (:mod:`~shardplug.core.shuffle.agreement`) and RNG synchronisation
(:mod:`~shardplug.core.shuffle.rng`)."""
