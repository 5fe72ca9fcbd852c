"""The sharding engine: samplers, shards, loaders and the functions that prepare them."""

from shardplug.core._internal.topology import ProcessTopology, resolve_data_topology
from shardplug.core.config import ShardplugConfig
from shardplug.core.dispatch.dispatch_plan import DispatchError
from shardplug.core.dispatch.dispatcher import DataLoaderDispatcher
from shardplug.core.loader.passes import LengthMismatchWarning
from shardplug.core.loader.prepared import DataLoaderShard, PreparedDataLoader
from shardplug.core.loader.resume_state import ResumeState
from shardplug.core.loader.transfer import send_to_device
from shardplug.core.padding.audit import AuditReport, SampleAudit
from shardplug.core.padding.metrics import drop_padding, gather_for_metrics
from shardplug.core.planner import prepare_data_loader, skip_first_batches
from shardplug.core.resume.position import Position
from shardplug.core.sharding.map_style import BatchSamplerShard
from shardplug.core.sharding.mixture import Mixture
from shardplug.core.sharding.packing import PackingCollate
from shardplug.core.sharding.read_all import IterableDatasetShard
from shardplug.core.sharding.token_budget import StepTotals, TokenBudgetBatchSampler, step_totals
from shardplug.core.shuffle.rng import synchronize_rng_states
from shardplug.core.shuffle.seedable import BijectiveRandomSampler, SeedableRandomSampler
from shardplug.core.stepping.accumulation import GradientState
from shardplug.core.stepping.optimizer import PreparedOptimizer
from shardplug.core.stepping.scheduler import PreparedScheduler
from shardplug.core.stepping.training import TrainingRun

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
    "LengthMismatchWarning",
    "Mixture",
    "PackingCollate",
    "Position",
    "PreparedDataLoader",
    "PreparedOptimizer",
    "PreparedScheduler",
    "ResumeState",
    "ProcessTopology",
    "SeedableRandomSampler",
    "ShardplugConfig",
    "StepTotals",
    "TokenBudgetBatchSampler",
    "TrainingRun",
    "prepare_data_loader",
    "resolve_data_topology",
    "send_to_device",
    "skip_first_batches",
    "step_totals",
    "synchronize_rng_states",
]
