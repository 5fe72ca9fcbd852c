"""torchdata.nodes graphs prepared by prepare_data_loader (issue 39, item 1): real graphs, real gloo processes.

Every sample once per epoch, equal steps with the padding marked, shuffles that agree, len() equal to what a
pass yields, a position that resumes exactly on the same and on another number of processes, the graph's
work (ParallelMapper threads and processes, Prefetcher) on each process's part, a weighted mixture that keeps
its weights and resumes, and the refusals with their fixes.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torchdata.nodes as tn
from _dist import run_gloo
from torch.utils.data import RandomSampler, SequentialSampler

from shardplug import prepare_data_loader, skip_first_batches
from shardplug.core.planner import can_prepare


def _row(key: int) -> dict[str, int]:
    """The per-row work: read sample ``key`` (module level: process workers pickle it)."""
    return {"x": key * 10}


def _row_b(key: int) -> dict[str, int]:
    """The per-row work of a mixture's second source: its keys read as 1000 + key."""
    return {"x": (key + 1000) * 10}


def _same(key: int) -> int:
    return key


def _keys(batch: list[dict[str, int]]) -> list[int]:
    return [row["x"] // 10 for row in batch]


def _graph(n: int, batch_size: int, shuffle: bool = True, **mapper: object) -> tn.Loader:
    """A map-style graph as users build it: sampler, ParallelMapper, Batcher, Prefetcher."""
    sampler = RandomSampler(range(n)) if shuffle else SequentialSampler(range(n))
    rows = tn.ParallelMapper(tn.SamplerWrapper(sampler), _row, **{"num_workers": 2, **mapper})
    return tn.Loader(tn.Prefetcher(tn.Batcher(rows, batch_size=batch_size, drop_last=False), prefetch_factor=2))


def _epochs(rank, world, n, batch_size):
    """Two epochs of a shuffled graph: each batch's keys and real count, and len() before each pass."""
    loader = prepare_data_loader(_graph(n, batch_size))
    loader.track_padding()
    epochs = []
    for _ in range(2):
        length, batches = len(loader), []
        for batch in loader:
            batches.append((_keys(batch), loader.batch_real_count, loader.end_of_dataloader))
        epochs.append((length, batches))
    return epochs


def test_every_sample_once_per_epoch_equal_steps_and_agreeing_shuffles_on_three_processes():
    n, batch_size = 22, 4
    results = run_gloo(_epochs, n, batch_size, world_size=3)
    for epoch in range(2):
        lengths = [results[rank][epoch][0] for rank in range(3)]
        batches = [results[rank][epoch][1] for rank in range(3)]
        assert lengths == [len(b) for b in batches] == [2, 2, 2], "len() is what a pass yields, equal on every process"
        real = [key for part in batches for keys, count, _ in part for key in keys[:count]]
        assert sorted(real) == list(range(n)), "every sample once per epoch, the padding marked"
        assert all(last == (i == len(part) - 1) for part in batches for i, (_, _, last) in enumerate(part))
    orders = [[k for rank in range(3) for keys, _, _ in results[rank][epoch][1] for k in keys] for epoch in range(2)]
    assert orders[0] != orders[1], "each epoch has its own shuffle"


def _resume(rank, world, n, batch_size, state):
    """Two batches then a position (with the rest of the epoch, uninterrupted), or with ``state``: the
    rest of the epoch after it, and what the next epoch yields."""
    loader = prepare_data_loader(_graph(n, batch_size))
    if state is None:
        batches = iter(loader)
        head = [_keys(next(batches)) for _ in range(2)]
        saved = loader.state_dict()
        rest = [_keys(b) for b in batches]
        again = prepare_data_loader(_graph(n, batch_size))
        again.load_state_dict(saved)
        return head, saved, rest, len(again), [_keys(b) for b in again]
    loader.load_state_dict(state)
    length = len(loader)
    rest = [_keys(b) for b in loader]
    return length, rest, len(loader)


def test_a_position_resumes_exactly_on_the_same_and_on_another_number_of_processes():
    n, batch_size = 30, 3
    first = run_gloo(_resume, n, batch_size, None, world_size=2)
    for _, saved, rest, length, resumed in first:
        assert saved["batches_yielded"] == 2 and saved["num_processes"] == 2
        assert resumed == rest and length == len(rest), "the same number of processes: the same batches"
    assert first[0][1] == first[1][1], "the position is the same on every process"
    seen = [k for head, *_ in first for batch in head for k in batch]
    second = run_gloo(_resume, n, batch_size, first[0][1], world_size=3)
    later = [k for length, rest, _ in second for batch in rest for k in batch]
    assert [length for length, rest, _ in second] == [len(rest) for _, rest, _ in second]
    assert set(seen).isdisjoint(later) and set(seen) | set(later) == set(range(n)), "nothing lost or repeated"
    assert [full for _, _, full in second] == [4, 4, 4], "the next epoch is whole again (30 / (3 x 3), padded)"


@pytest.mark.parametrize("method", ["thread", "process"])
def test_parallel_mapper_workers_do_each_process_s_rows(method):
    parts = []
    for index in range(2):
        graph = _graph(10, 3, shuffle=False, method=method, in_order=method == "thread")
        loader = prepare_data_loader(graph, num_processes=2, process_index=index)
        parts.append([_keys(b) for b in loader])
    assert parts == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]], "in the plan's order, also with in_order=False"


def test_drop_padding_rows_cuts_a_batcher_list_of_samples():
    loader = prepare_data_loader(_graph(10, 3, shuffle=False), num_processes=2, process_index=1)
    loader.drop_padding_rows()
    assert [_keys(b) for b in loader] == [[3, 4, 5], [9]]


def test_skip_first_batches_and_initial_epoch():
    skipped = skip_first_batches(_graph(9, 2, shuffle=False), 3)
    assert len(skipped) == 2 and [_keys(b) for b in skipped] == [[6, 7], [8]]
    sampler = RandomSampler(range(12))
    at_three = prepare_data_loader(tn.Batcher(tn.SamplerWrapper(sampler, initial_epoch=3), 4), data_seed=5)
    plain = prepare_data_loader(tn.Batcher(tn.SamplerWrapper(sampler), 4), data_seed=5)
    plain.set_epoch(3)
    assert at_three.epoch == 3 and list(at_three) == list(plain)


def _mixture(seed: int = 7, stop: str = "FIRST_DATASET_EXHAUSTED") -> tn.Loader:
    sources = {
        "a": tn.Mapper(tn.SamplerWrapper(RandomSampler(range(40))), _row),
        "b": tn.Mapper(tn.SamplerWrapper(SequentialSampler(range(20))), _row_b),
    }
    mixture = tn.MultiNodeWeightedSampler(sources, {"a": 3.0, "b": 1.0}, stop_criteria=stop, seed=seed)
    return tn.Loader(tn.Batcher(mixture, batch_size=4, drop_last=False))


def _mixture_run(rank, world):
    loader = prepare_data_loader(_mixture())
    batches = iter(loader)
    head = [_keys(next(batches)) for _ in range(3)]
    saved = loader.state_dict()
    rest = [_keys(b) for b in batches]
    again = prepare_data_loader(_mixture())
    again.load_state_dict(saved)
    try:
        prepare_data_loader(_mixture(seed=rank))
        refused = None
    except ValueError as error:
        refused = str(error)
    return head, saved, rest, [_keys(b) for b in again], refused


def test_a_weighted_mixture_keeps_its_weights_and_resumes_on_the_same_number_of_processes():
    results = run_gloo(_mixture_run, world_size=2)
    for _, _, rest, resumed, refused in results:
        assert resumed == rest, "the mixture resumes exactly"
        assert refused is not None and "seed differs between processes" in refused and "data_seed=" in refused
    batches = [head + rest for head, _, rest, _, _ in results]
    # the same sources drawn in the same order on every process (equal steps), each process's rows its own
    assert [[k >= 1000 for k in b] for b in batches[0]] == [[k >= 1000 for k in b] for b in batches[1]]
    rows = [Counter(k for b in part for k in b) for part in batches]
    assert not set(rows[0]) & set(rows[1]) and max(rows[0].values()) == 1, "no row read twice in the pass"
    # the weights (3:1) hold: the share of the first source's rows over 400 draws
    forever = prepare_data_loader(_mixture(stop="CYCLE_FOREVER"), num_processes=2, process_index=0, data_seed=1)
    drawn = [k for b, _ in zip(forever, range(100)) for k in _keys(b)]
    assert 0.68 < sum(k < 1000 for k in drawn) / len(drawn) < 0.82
    with pytest.raises(ValueError, match="resumes exactly only on the number of processes it was saved with"):
        other = prepare_data_loader(_mixture(), num_processes=1, process_index=0)
        other.load_state_dict(results[0][1])


def test_graphs_that_cannot_be_sharded_from_outside_are_refused_with_the_fix():
    assert can_prepare(_graph(4, 2)) and can_prepare(tn.SamplerWrapper(range(4))) and not can_prepare(range(4))
    cases = {
        "every process would read all of it": tn.Batcher(tn.IterableWrapper(range(8)), 2),
        "Unbatcher node": tn.Unbatcher(tn.Batcher(tn.SamplerWrapper(range(8)), 2)),
        "batch once": tn.Batcher(tn.Batcher(tn.SamplerWrapper(range(8)), 2), 2),
        "build the SamplerWrapper without epoch_updater": tn.SamplerWrapper(range(8), epoch_updater=lambda e: e + 2),
    }
    for message, graph in cases.items():
        with pytest.raises(TypeError, match=message):
            prepare_data_loader(graph, num_processes=2, process_index=0)
    with pytest.raises(ValueError, match="pass dispatch_batches=False"):
        prepare_data_loader(_graph(8, 2), dispatch_batches=True, put_on_device=True, num_processes=1, process_index=0)
    with pytest.raises(TypeError, match="or a torchdata.nodes graph"):
        prepare_data_loader(range(4))


def test_a_pass_left_early_restarts_its_epoch_even_when_read_to_its_end_ahead():
    loader = prepare_data_loader(_graph(6, 2, shuffle=False), num_processes=1, process_index=0)
    for batch in loader:
        assert _keys(batch) == [0, 1]
        time.sleep(0.2)  # the Prefetcher and the mapper's threads read the rest of the epoch meanwhile
        break
    assert loader.state_dict()["batches_yielded"] == 1 and loader.epoch == 0
    assert [_keys(b) for b in loader] == [[0, 1], [2, 3], [4, 5]] and loader.epoch == 0
    assert loader.state_dict()["epoch"] == 1, "a complete pass: the position is the next epoch's start"


def test_a_graph_over_a_distributed_sampler_reads_the_epochs_torchdata_reads():
    """``SamplerWrapper(DistributedSampler(...))``: the sampler is adopted (torch's batches, its padding marked) and,
    as torchdata's SamplerWrapper sets the next epoch on the sampler at every new pass, each pass reads the next
    epoch's order (it read epoch 0's every time: the same order each epoch, unlike the user's graph); a position
    inside epoch 1 resumes on another number of processes with every remaining sample once; one of another process
    is refused."""
    from torch.utils.data import DistributedSampler

    n = 11

    def graph(processes: int, index: int, initial_epoch: int = 0) -> tn.Loader:
        sampler = DistributedSampler(range(n), processes, index, shuffle=True, seed=3)
        rows = tn.Mapper(tn.SamplerWrapper(sampler, initial_epoch=initial_epoch), _same)
        return tn.Loader(tn.Batcher(rows, batch_size=2, drop_last=False))

    for initial_epoch in (0, 2):
        for index in range(2):
            native = graph(2, index, initial_epoch)
            expected = [[list(batch) for batch in native] for _ in range(3)]
            prepared = prepare_data_loader(graph(2, index, initial_epoch), num_processes=2, process_index=index)
            assert [[list(batch) for batch in prepared] for _ in range(3)] == expected, (initial_epoch, index)
    saving = [prepare_data_loader(graph(2, index), num_processes=2, process_index=index) for index in range(2)]
    seen = []
    for loader in saving:
        loader.track_padding()
        for _ in loader:  # epoch 0
            pass
        batches = iter(loader)
        seen += next(batches)[: loader.batch_real_count]  # the first step of epoch 1
    position = saving[0].state_dict()
    for index in range(3):
        resumed = prepare_data_loader(graph(3, index), num_processes=3, process_index=index)
        resumed.load_state_dict(position)
        resumed.track_padding()
        seen += [key for batch in resumed for key in batch[: resumed.batch_real_count]]
        assert resumed.epoch == 1
    assert sorted(seen) == list(range(n)), "epoch 1 across the resize: every sample once"
    with pytest.raises(ValueError, match="DistributedSampler has rank=1, but this process is process 0 of 2"):
        prepare_data_loader(graph(2, 1), num_processes=2, process_index=0)
