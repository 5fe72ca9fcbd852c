"""torchdata.nodes graphs under the Lightning strategy (issue 39, item 1): a real Trainer on 2 processes.

One script run (``scripts/lightning_nodes.py``) covers: a graph as training loader, each sample once per epoch
with equal steps; a graph as validation loader, each sample exactly once (padding dropped); a checkpoint
saved mid-epoch that resumes on the same batches; and one ``UnshardedLoaderWarning`` for a loader the
strategy cannot shard, silenced by ``iterables_read_own_part=True``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torchdata.nodes as tn
from test_lightning_strategy import _run_script  # this folder: runs a scenario script, fails with its output
from torch.utils.data import SequentialSampler

from shardplug.core.loader.prepared import PreparedDataLoader
from shardplug_lightning import ShardplugDDPStrategy, ShardplugFabricDDPStrategy

N_TRAIN, N_VAL, BATCH, WORLD = 18, 10, 4, 2


def _run(out: Path) -> list[dict]:
    _run_script("lightning_nodes.py", out)
    return [json.loads((out / f"nodes_rank{r}.json").read_text()) for r in range(WORLD)]


def test_a_graph_trains_once_per_epoch_validates_exactly_resumes_and_other_iterables_warn(tmp_path: Path) -> None:
    ranks = _run(tmp_path)
    for epoch in range(2):
        train = [[keys for e, keys in r["fit"]["train"] if e == epoch] for r in ranks]
        assert [len(t) for t in train] == [3, 3], "equal steps: 18 samples, 4 per batch, 2 processes, padded"
        seen = [k for part in train for keys in part for k in keys]
        assert set(seen) == set(range(N_TRAIN)) and len(seen) == 24, "each sample once, 6 rows of padding"
        val = [k for r in ranks for e, keys in r["fit"]["val"] if e == epoch for k in keys]
        assert sorted(val) == list(range(N_VAL)), "validation: each sample exactly once (padding dropped)"
    for r in ranks:
        after = r["fit"]["train"][2:]
        assert r["resumed"] == after, "the fit resumed from the mid-epoch checkpoint trains on the same batches"
        assert len(r["warned"]) == 1 and "__main__.OwnIterable" in r["warned"][0]
        assert "every one of the 2 processes reads all of it" in r["warned"][0]
        assert "iterables_read_own_part=True" in r["warned"][0]
        assert r["silenced"] == []


def test_fabric_prepares_a_graph_setup_dataloaders_cannot_take() -> None:
    strategy = ShardplugFabricDDPStrategy()
    graph = tn.Loader(tn.Batcher(tn.SamplerWrapper(SequentialSampler(range(5))), 2, drop_last=False))
    prepared = strategy.prepare_loader(graph)
    assert isinstance(prepared, PreparedDataLoader) and list(prepared) == [[0, 1], [2, 3], [4]]
    with pytest.raises(TypeError, match="neither a DataLoader nor a torchdata.nodes graph"):
        strategy.prepare_loader(range(3))


def test_iterables_read_own_part_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="iterables_read_own_part='yes' is invalid"):
        ShardplugDDPStrategy(iterables_read_own_part="yes")
