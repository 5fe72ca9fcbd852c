"""The evaluation-loader rule (``shardplug.core.evaluation``) on tiny sets, processes simulated.

Every process gets the same number of batches (also with ``even_batches=False`` in the training
config, a set smaller than one global batch, or more processes than batches), and the real rows
over all processes are every sample exactly once.
"""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from shardplug import drop_padding
from shardplug.core.config import ShardplugConfig
from shardplug.core.evaluation import prepare_eval_loader
from shardplug.core.stepping.training import TrainingRun


def _passes(n: int, batch_size: int, world: int, **kwargs) -> list[list[list[int]]]:
    """Each process's real rows per batch, through ``TrainingRun.prepare_eval_loader``."""
    out = []
    for rank in range(world):
        run = TrainingRun(ShardplugConfig(even_batches=False), num_processes=world, process_index=rank)
        loader = run.prepare_eval_loader(DataLoader(list(range(n)), batch_size=batch_size), **kwargs)
        out.append([drop_padding(batch, loader).tolist() for batch in loader])
    return out


@pytest.mark.parametrize(
    "n, batch_size, world",
    [(3, 4, 2), (5, 4, 2), (100, 32, 8), (27, 4, 2), (1, 4, 3)],
    ids=["smaller-than-a-global-batch", "one-partial-step", "8-processes-4-batches", "27", "one-sample-3-processes"],
)
@pytest.mark.parametrize("drop", [False, True])
def test_every_process_gets_the_same_number_of_batches_and_each_sample_once(n, batch_size, world, drop) -> None:
    parts = _passes(n, batch_size, world, drop_padding=drop)
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) >= 1
    assert sorted(i for p in parts for b in p for i in b) == list(range(n))


def test_dropped_padding_leaves_empty_batches_on_the_processes_without_data() -> None:
    parts = []
    for rank in range(8):
        loader = prepare_eval_loader(
            DataLoader(list(range(100)), batch_size=32), drop_padding=True, num_processes=8, process_index=rank
        )
        parts.append([len(b) for b in loader])
    assert parts == [[32], [32], [32], [4], [0], [0], [0], [0]]


def test_uneven_evaluation_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="even_batches=False is invalid for an evaluation loader.*Leave"):
        _passes(3, 4, 2, even_batches=False)
    with pytest.raises(ValueError, match="even_batches=False is invalid"):
        prepare_eval_loader(DataLoader(list(range(3))), even_batches=False, num_processes=2, process_index=0)
    with pytest.raises(TypeError, match="drop_padding='yes' is invalid"):
        prepare_eval_loader(DataLoader(list(range(3))), drop_padding="yes", num_processes=2, process_index=0)


def test_single_samples_cannot_drop_rows() -> None:
    with pytest.raises(ValueError, match="batch_size=None"):
        prepare_eval_loader(
            DataLoader(list(range(3)), batch_size=None), drop_padding=True, num_processes=2, process_index=1
        )
