"""The sharding engine: samplers, shards, loaders and the functions that prepare them."""

from .batch_plan import ShardLayout
from .dispatch import DataLoaderDispatcher, DispatchError
from .iterable import IterableDatasetShard
from .loaders import DataLoaderShard, PreparedDataLoader
from .prepare import prepare_data_loader, skip_first_batches
from .rng import synchronize_rng_states
from .samplers import BatchSamplerShard, SeedableRandomSampler
from .topology import ProcessTopology, resolve_data_topology
from .transfer import send_to_device

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DispatchError",
    "IterableDatasetShard",
    "PreparedDataLoader",
    "ProcessTopology",
    "SeedableRandomSampler",
    "ShardLayout",
    "prepare_data_loader",
    "resolve_data_topology",
    "send_to_device",
    "skip_first_batches",
    "synchronize_rng_states",
]
