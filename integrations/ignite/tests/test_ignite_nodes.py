"""A torchdata.nodes graph under a real Ignite ``Engine`` with ``ShardplugHandler`` (issue 39, item 1), on 2 gloo
processes: ``handler.prepare_data_loader(graph)`` gives each process its part (each sample once per epoch, equal
steps, a new shuffle each epoch), and a run stopped mid-epoch resumes from the handler's and the engine's state on
the same batches."""

from __future__ import annotations

import copy
from typing import Any

import torchdata.nodes as tn
from _dist import run_gloo
from ignite.engine import Engine, Events
from torch.utils.data import RandomSampler

from shardplug.core.config import ShardplugConfig
from shardplug_ignite import ShardplugHandler

N, BATCH = 14, 3


def _row(key: int) -> int:
    return key


def _graph() -> tn.Loader:
    rows = tn.ParallelMapper(tn.SamplerWrapper(RandomSampler(range(N))), _row, num_workers=2)
    return tn.Loader(tn.Prefetcher(tn.Batcher(rows, batch_size=BATCH, drop_last=False), prefetch_factor=2))


def _run(stop_at: int | None, state: Any) -> tuple[dict[int, list[list[int]]], Any]:
    handler = ShardplugHandler(ShardplugConfig(data_seed=11))
    loader = handler.prepare_data_loader(_graph())
    seen: dict[int, list[list[int]]] = {}
    trainer = Engine(lambda engine, batch: seen.setdefault(engine.state.epoch, []).append(list(batch)))
    handler.attach(trainer)
    saved: list[Any] = []
    if stop_at is not None:

        def save_and_stop(engine: Engine) -> None:
            saved.append(copy.deepcopy((engine.state_dict(), handler.state_dict())))
            engine.terminate()

        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop_at), save_and_stop)
    if state is not None:
        trainer.load_state_dict(state[0])
        handler.load_state_dict(state[1])
    trainer.run(loader, max_epochs=2)
    return seen, saved[0] if saved else None


def _ranks(rank: int, world: int) -> dict[str, Any]:
    whole, _ = _run(None, None)
    head, state = _run(4, None)
    rest, _ = _run(None, state)
    return {"whole": whole, "head": head, "rest": rest}


def test_a_graph_under_an_engine_is_sharded_and_resumes_exactly() -> None:
    ranks = run_gloo(_ranks, world_size=2)
    for epoch in (1, 2):
        batches = [r["whole"][epoch] for r in ranks]
        assert [len(b) for b in batches] == [3, 3], "equal steps: 14 samples, 3 per batch, 2 processes"
        seen = [k for part in batches for batch in part for k in batch]
        assert set(seen) == set(range(N)) and len(seen) == 18, "each sample once, 4 rows of padding"
    assert ranks[0]["whole"][1] != ranks[0]["whole"][2], "a new shuffle each epoch"
    assert [len(r["head"][2]) for r in ranks] == [1, 1] and 1 not in ranks[0]["rest"], "stopped inside epoch 2"
    for r in ranks:
        resumed = r["head"][1] + r["head"][2] + r["rest"][2]
        assert resumed == r["whole"][1] + r["whole"][2], "stopped at iteration 4 and resumed: the same batches"
