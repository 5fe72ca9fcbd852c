"""shardplug: exact distributed data loading and optimizer stepping for any PyTorch loop.

Example::

    import shardplug
    loader = shardplug.prepare_data_loader(DataLoader(dataset, batch_size=16, shuffle=True))
"""

from shardplug.core import (
    AuditReport,
    BatchSamplerShard,
    BijectiveRandomSampler,
    DataLoaderDispatcher,
    DataLoaderShard,
    DispatchError,
    GradientState,
    IterableDatasetShard,
    LengthMismatchWarning,
    Mixture,
    PackingCollate,
    Position,
    PreparedDataLoader,
    PreparedOptimizer,
    PreparedScheduler,
    ProcessTopology,
    ResumeState,
    SampleAudit,
    SeedableRandomSampler,
    ShardplugConfig,
    StepTotals,
    TokenBudgetBatchSampler,
    TrainingRun,
    drop_padding,
    gather_for_metrics,
    prepare_data_loader,
    resolve_data_topology,
    send_to_device,
    skip_first_batches,
    step_totals,
    synchronize_rng_states,
)

__version__ = "0.1.0"

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
