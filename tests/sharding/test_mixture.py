"""shardplug.Mixture on one process: its refusals, what a batch tells of its sources, and resumes whose order
changes (new weights at an epoch's end, persistent workers that must read the new order)."""

from __future__ import annotations

from typing import Any

import pytest
from _dist import worker_context
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SubsetRandomSampler

import shardplug

SOURCES = {"a": list(range(0, 40)), "b": list(range(100, 160)), "c": list(range(200, 205))}
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


def _loader(mixture: shardplug.Mixture, **kwargs: Any) -> shardplug.PreparedDataLoader:
    names = ("num_processes", "process_index", "data_seed", "dispatch_batches")
    options = {k: kwargs.pop(k) for k in names if k in kwargs}
    return shardplug.prepare_data_loader(
        DataLoader(mixture, batch_size=kwargs.pop("batch_size", 4), **kwargs),
        num_processes=options.get("num_processes", 1),
        process_index=options.get("process_index", 0),
        data_seed=options.get("data_seed"),
        **(
            {"dispatch_batches": True, "put_on_device": True, "device": "cpu"}
            if options.get("dispatch_batches")
            else {}
        ),
    )


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(3))


@pytest.mark.parametrize(
    ("sources", "weights", "message"),
    [
        (
            SOURCES,
            {"a": 1, "b": 1},
            r"weights names \['a', 'b'\] but the sources are \['a', 'b', 'c'\] \(missing \['c'\]",
        ),
        (SOURCES, {"a": 1, "b": 1, "c": 1, "d": 1}, r"unknown \['d'\]"),
        (SOURCES, {"a": 1, "b": -0.5, "c": 1}, r"weights\['b'\]=-0.5 is invalid: a weight is a finite number >= 0"),
        (SOURCES, {"a": 0, "b": 0, "c": 0}, r"are all zero: no source would be drawn; give one a weight > 0"),
        ({**SOURCES, "d": []}, {**WEIGHTS, "d": 1}, r"sources\['d'\] is empty \(len 0\).*remove it"),
        ({**SOURCES, "d": _Stream()}, {**WEIGHTS, "d": 1}, r"sources\['d'\]=_Stream is not a map-style data set"),
        (SOURCES, [(5, WEIGHTS)], r"weights\[0\] starts at position 5: a schedule starts at position 0"),
        (SOURCES, [(0, WEIGHTS), (0, WEIGHTS)], r"weights\[1\] starts at position 0.*positions increase"),
        (SOURCES, [(0, WEIGHTS), (9, {"a": 1})], r"weights\[1\]\[1\] names \['a'\]"),
    ],
)
def test_bad_input_is_refused_with_the_argument_the_value_and_the_fix(sources: Any, weights: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        shardplug.Mixture(sources, weights, seed=0)


def test_what_would_reorder_the_mixture_or_be_ignored_is_refused() -> None:
    mixture = shardplug.Mixture(SOURCES, WEIGHTS, seed=4)
    with pytest.raises(ValueError, match="SubsetRandomSampler, which would reorder the mixture's global positions"):
        _loader(mixture, sampler=SubsetRandomSampler(range(10)))
    with pytest.raises(ValueError, match="DistributedSampler, which would reorder the mixture's global positions"):
        _loader(mixture, sampler=DistributedSampler(mixture, num_replicas=1, rank=0))  # not adopted as DDP's order
    with pytest.raises(ValueError, match="batch_size=None; pass batch_size"):
        shardplug.prepare_data_loader(DataLoader(mixture, batch_size=None), num_processes=1, process_index=0)
    with pytest.raises(
        ValueError, match=r"data_seed=7 would be ignored: a Mixture's order is seeded by Mixture\(seed=4\)"
    ):
        _loader(mixture, data_seed=7)
    saved = {**_loader(mixture).state_dict(), "batches_yielded": 1, "consumed": 1}
    loader = _loader(shardplug.Mixture(SOURCES, WEIGHTS, seed=5))
    before = loader.state_dict()
    with pytest.raises(ValueError, match="saved by a Mixture with seed=4 and this Mixture has seed=5"):
        loader.load_state_dict(saved)
    assert loader.state_dict() == before, "refused before anything changed"
    shorter = {**SOURCES, "b": SOURCES["b"][:-1]}
    with pytest.raises(ValueError, match="source 'b' had 60 samples when the position was saved and has 59 now"):
        _loader(shardplug.Mixture(shorter, WEIGHTS, seed=4, samples_per_epoch=105)).load_state_dict(saved)
    with pytest.raises(ValueError, match="is not one a Mixture saved"):
        _loader(mixture).load_state_dict({**saved, "dataset_state": {"seed": 4}})
    with pytest.raises(
        ValueError, match=r"a Mixture's dataset_length is its samples_per_epoch: pass samples_per_epoch=105"
    ):
        _loader(shardplug.Mixture({**SOURCES, "d": [1, 2]}, {**WEIGHTS, "d": 1}, seed=4)).load_state_dict(saved)


def test_shuffle_true_and_false_read_the_same_order_and_each_batch_names_its_sources() -> None:
    mixture = shardplug.Mixture(SOURCES, WEIGHTS, seed=2)
    plain, shuffled = _loader(mixture), _loader(mixture, shuffle=True)
    plain.track_padding()
    rows, sources = [], []
    for batch in plain:
        rows += batch.tolist()
        sources += plain.batch_sources
    assert rows == [x for batch in shuffled for x in batch.tolist()] == [mixture[p] for p in range(len(mixture))]
    assert sources == [mixture.locate(p).source for p in range(len(mixture))]
    assert [{"a": 0, "b": 1, "c": 2}[s] for s in sources] == [x // 100 for x in rows]


def test_new_weights_loaded_at_an_epochs_end_go_on_from_its_draws() -> None:
    """A position saved at an epoch's end carries the order too: the next epoch, with new weights, reads each
    source from its next draw (nothing of a cycle repeated)."""
    old = shardplug.Mixture(SOURCES, WEIGHTS, seed=3)
    loader = _loader(old)
    first = [x for batch in loader for x in batch.tolist()]
    state = loader.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 0) and state["dataset_state"] is not None
    new = shardplug.Mixture(SOURCES, {"a": 0.1, "b": 0.1, "c": 0.8}, seed=3)
    resumed = _loader(new)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    second = [x for batch in resumed for x in batch.tolist()]
    assert sum(x // 100 == 2 for x in second) > 0.7 * len(second)
    length = {0: 40, 1: 60, 2: 5}
    for source in range(3):
        stream = [x for x in first + second if x // 100 == source]
        for start in range(0, len(stream), length[source]):  # every cycle: each sample once
            cycle = stream[start : start + length[source]]
            assert len(set(cycle)) == len(cycle)
        order = new.order
        assert [d.sample for d in order.locate_many(range(2 * len(old))) if d.source == "abc"[source]] == [
            x % 100 for x in stream
        ]


@pytest.mark.parametrize("dispatch", [False, True], ids=["own-shard", "dispatch"])
def test_persistent_workers_read_the_order_loaded_after_they_started(dispatch: bool) -> None:
    mixture = shardplug.Mixture(SOURCES, WEIGHTS, seed=6)
    workers = {
        "num_workers": 2,
        "persistent_workers": True,
        "multiprocessing_context": worker_context(2, ["shardplug"]),
        "dispatch_batches": dispatch,  # process 0's reader (the one process here) starts its workers anew too
    }
    saved_loader = _loader(shardplug.Mixture(SOURCES, WEIGHTS, seed=6))
    batches = iter(saved_loader)
    for _ in range(5):
        next(batches)
    state = saved_loader.state_dict()
    loader = _loader(shardplug.Mixture(SOURCES, {"a": 0, "b": 0, "c": 1}, seed=6), **workers)
    before = [x for batch in loader for x in batch.tolist()]  # the workers start with the new weights from 0
    assert {x // 100 for x in before} == {2}
    loader.load_state_dict(state)
    after = [x for batch in loader for x in batch.tolist()]
    expected = shardplug.Mixture(SOURCES, {"a": 0, "b": 0, "c": 1}, seed=6)
    expected.continue_from(20, mixture.order.state())
    assert after == [expected[p] for p in range(20, len(mixture))]


def test_the_audit_reports_every_source_cycle_read_once_across_processes_and_epochs() -> None:
    mixture = shardplug.Mixture(SOURCES, WEIGHTS, seed=8)
    parts = [_loader(mixture, num_processes=2, process_index=rank, batch_size=3) for rank in range(2)]
    audits = [part.enable_audit() for part in parts]
    for epoch in range(2):
        for part in parts:
            part.set_epoch(epoch)
            for _ in part:
                pass
    audits[0].load_state_dict(audits[1].state_dict())  # both processes' records in one
    assert all(audits[0].report(epoch).exact for epoch in range(2))
    seen: dict[tuple[str, int], int] = {}
    for epoch in range(2):
        for cycle in audits[0].by_source(mixture, epoch):
            assert not cycle.duplicated, cycle
            seen[(cycle.source, cycle.cycle)] = seen.get((cycle.source, cycle.cycle), 0) + cycle.seen
    counts = mixture.order.counts_at(2 * len(mixture))
    for (source, cycle), count in seen.items():  # every cycle ended within the two epochs was read whole
        length = len(SOURCES[source])
        assert count == (length if (cycle + 1) * length <= counts[source] else counts[source] - cycle * length)
    assert sum(seen.values()) == 2 * len(mixture)
    assert max(c for s, c in seen if s == "c") >= 8, "the small source cycles several times an epoch"


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("before", "after"), [(3, 2), (2, 4), (4, 1)])
def test_a_position_resumes_on_another_number_of_processes_with_every_option(
    split: bool, even: bool, drop_last: bool, before: int, after: int
) -> None:
    """Processes simulated (num_processes=N, process_index=i: a mixture needs no group): the epoch's positions
    read before the save and after the resume are each read once, in the global order, the items the mixture's,
    and only a short tail is dropped (drop_last) or padded (marked)."""
    mixture = shardplug.Mixture(SOURCES, WEIGHTS, seed=9)

    def parts(processes: int) -> list[shardplug.PreparedDataLoader]:
        made = [
            shardplug.prepare_data_loader(
                DataLoader(mixture, batch_size=12, drop_last=drop_last),
                num_processes=processes,
                process_index=rank,
                split_batches=split,
                even_batches=even,
            )
            for rank in range(processes)
        ]
        for part in made:
            part.track_padding()
        return made

    def read(loaders: list[shardplug.PreparedDataLoader], steps: int | None) -> list[int]:
        """The global positions of the real rows the loaders hand out (all, or ``steps`` each), step by step."""
        per_process = []
        for part in loaders:
            rows = []
            for batch in part:
                start = part.epoch * len(mixture)
                real = part.batch_real_count
                assert batch.tolist() == [mixture[start + i] for i in part.batch_indices], "the mixture's rows"
                rows.append([start + i for i in part.batch_indices[:real]])
                if len(rows) == steps:
                    break
            per_process.append(rows)
        return [
            p
            for step in range(max(map(len, per_process)))
            for rows in per_process
            if step < len(rows)
            for p in rows[step]
        ]

    first = parts(before)
    done = read(first, 2)
    resumed = parts(after)
    for part in resumed:
        part.load_state_dict(first[0].state_dict())
    rest = read(resumed, None)
    read_positions = done + rest
    assert read_positions == sorted(set(read_positions)), "the global order, each position once"
    size = len(mixture)
    for epoch in sorted({p // size for p in read_positions}):
        mine = [p - epoch * size for p in read_positions if p // size == epoch]
        assert mine == list(range(len(mine))), "an epoch is read from its start, without a gap"
        if epoch == 0:  # a layout's drop_last drops less than one of its steps at the epoch's end
            assert size - len(mine) < 12 * max(before, after) if drop_last else len(mine) == size


def test_a_source_removed_at_a_resume_is_named_where_an_earlier_position_reads_it() -> None:
    old = shardplug.Mixture(SOURCES, WEIGHTS, seed=2)
    fewer = shardplug.Mixture({k: SOURCES[k] for k in "ab"}, {"a": 1, "b": 1}, seed=2, samples_per_epoch=105)
    fewer.continue_from(50, old.order.state())
    reads_c = next(p for p in range(50) if old.locate(p).source == "c")
    with pytest.raises(KeyError, match=f"position {reads_c} reads source 'c', which this Mixture no longer has"):
        fewer.__getitems__([reads_c])
    assert {fewer.locate(p).source for p in range(50, 105)} == {"a", "b"}
