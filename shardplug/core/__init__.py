"""The sharding engine: samplers, shards, loaders and the functions that prepare them."""

from .accumulation import GradientState
from .audit import AuditReport, SampleAudit
from .config import ShardplugConfig
from .dispatch import DataLoaderDispatcher, DispatchError
from .iterable import IterableDatasetShard
from .layout import ShardLayout
from .loaders import DataLoaderShard, LengthMismatchWarning, PreparedDataLoader
from .metrics import drop_padding, gather_for_metrics
from .optimizer import PreparedOptimizer
from .position import Position
from .prepare import prepare_data_loader, skip_first_batches
from .rng import synchronize_rng_states
from .samplers import BatchSamplerShard, SeedableRandomSampler
from .scheduler import PreparedScheduler
from .shuffle import BijectiveRandomSampler, KeyedPermutation
from .topology import ProcessTopology, resolve_data_topology
from .training import TrainingRun
from .transfer import send_to_device

__all__ = [
    "AuditReport",
    "SampleAudit",
    "drop_padding",
    "gather_for_metrics",
    "BatchSamplerShard",
    "BijectiveRandomSampler",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DispatchError",
    "GradientState",
    "IterableDatasetShard",
    "KeyedPermutation",
    "LengthMismatchWarning",
    "Position",
    "PreparedDataLoader",
    "PreparedOptimizer",
    "PreparedScheduler",
    "ProcessTopology",
    "SeedableRandomSampler",
    "ShardLayout",
    "ShardplugConfig",
    "TrainingRun",
    "prepare_data_loader",
    "resolve_data_topology",
    "send_to_device",
    "skip_first_batches",
    "synchronize_rng_states",
]
