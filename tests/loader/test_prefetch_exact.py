"""Reading batches ahead (``prefetch_depth``) changes nothing a user sees: the same batches in the same
order, ``len()``, ``end_of_dataloader``, padding marks, ``state_dict()`` after a ``break`` (also a
``StatefulDataLoader``'s own state), ``skip_first_batches``, a dataset's exception at its batch.

On a CPU device the prefetcher is a look-ahead (each batch copied as it is read) through the same seam as
on a GPU (tests/gpu/ checks the CUDA copy): every case runs with depth 0 (no look-ahead), 1 and 2,
with and without DataLoader workers.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from _datasets import Stream
from _dist import worker_context
from _prefetch_data import Failing, FailingStream, Resumable
from torch.utils.data import DataLoader

from shardplug import prepare_data_loader, skip_first_batches
from shardplug.core.loader.prefetch import Prefetcher, resolve_prefetch_depth

DEPTHS = [0, 1, 2]


def _prepared(data, depth, workers=0, processes=2, index=1, batch_size=2, **kwargs):
    loader_kwargs = {"num_workers": workers, "multiprocessing_context": worker_context(workers)} if workers else {}
    return prepare_data_loader(
        DataLoader(data, batch_size=batch_size, **loader_kwargs),
        num_processes=processes,
        process_index=index,
        put_on_device=True,
        device="cpu",
        prefetch_depth=depth,
        dispatch_batches=False,  # a stream with put_on_device would be dispatched: each process reads here
        **kwargs,
    )


def _values(batch) -> list[int]:
    x = batch["x"] if isinstance(batch, dict) else batch
    return x.flatten().tolist()


def _seen(loader) -> list[tuple[list[int], bool, int | None]]:
    """What a user sees of each batch: its values, ``end_of_dataloader`` and the real count."""
    return [(_values(b), loader.end_of_dataloader, loader.batch_real_count) for b in loader]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("depth", DEPTHS)
def test_batches_marks_and_len_are_those_without_prefetch(depth, workers):
    loader = _prepared(list(range(11)), depth, workers)  # 11 rows on 2 processes: the last step is padded
    loader.track_padding()
    reference = _prepared(list(range(11)), 0)
    reference.track_padding()
    assert len(loader) == len(reference) == 3
    expected = _seen(reference)
    assert expected[-1][1:] == (True, 1)  # the padded last batch, marked
    assert _seen(loader) == expected
    assert _seen(loader) == expected  # a second epoch (the loader's epoch advanced alike)


@pytest.mark.parametrize("depth", DEPTHS)
def test_a_stream_is_handed_out_alike(depth):
    loader = _prepared(Stream(13), depth)
    assert _seen(loader) == _seen(_prepared(Stream(13), 0))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("depth", DEPTHS)
def test_state_after_break_counts_batches_handed_out(depth, workers):
    loader = _prepared(list(range(20)), depth, workers, processes=1, index=0)
    taken = []
    for batch in loader:
        taken.append(_values(batch))
        if len(taken) == 3:
            break
    state = loader.state_dict()
    assert state["batches_yielded"] == 3
    again = _prepared(list(range(20)), depth, workers, processes=1, index=0)
    again.load_state_dict(state)
    rest = [_values(b) for b in again]
    assert taken + rest == [[2 * i, 2 * i + 1] for i in range(10)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("depth", DEPTHS)
def test_statefuldataloader_state_after_break_is_that_of_the_last_batch_handed_out(depth, workers):
    """The StatefulDataLoader's own state (its dataset's position) after a ``break``: before the fix a pass
    that read one batch ahead saved the state after that batch, and the resumed run lost it silently."""
    pytest.importorskip("torchdata.stateful_dataloader")

    def loader():
        return _prepared(Resumable(14), depth, workers, processes=1, index=0, use_stateful_dataloader=True)

    first = loader()
    taken = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torchdata's own deprecation notices
        for batch in first:
            taken.append(_values(batch))
            if len(taken) == 2:
                break
        state = first.state_dict()
        resumed = loader()
        resumed.load_state_dict(state)
        rest = [_values(b) for b in resumed]
    everything = sorted(v for batch in taken + rest for v in batch)
    assert everything == list(range(14))  # nothing lost, nothing twice
    assert taken + rest == _batches_of(Resumable(14), workers)


def _batches_of(data, workers) -> list[list[int]]:
    kwargs = {"num_workers": workers, "multiprocessing_context": worker_context(workers)} if workers else {}
    return [b.tolist() for b in DataLoader(data, batch_size=2, **kwargs)]


@pytest.mark.parametrize(("kind", "workers"), [("map", 0), ("map", 2), ("stream", 0)])
@pytest.mark.parametrize("depth", DEPTHS)
def test_dataset_error_surfaces_at_its_batch_and_nothing_after(depth, kind, workers, monkeypatch):
    """Also where the loader reads one batch ahead to know the last (a stream): before the fix the error met
    while reading ahead came one batch early, and the batch before it was never handed out."""
    # torch's DataLoader, after a worker's exception, waits this long per worker when its iterator goes (plain
    # DataLoader too: 10 s for 2 workers); the workers raise cleanly, so the test does not wait for that
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    data = Failing(12, bad=7) if kind == "map" else FailingStream(12, bad=7)  # item 7: in the 4th batch
    loader = _prepared(data, depth, workers, processes=1, index=0)
    handed = []
    with pytest.raises(ValueError, match="item 7 is broken"):
        for batch in loader:
            handed.append(_values(batch))
    assert handed == [[0, 1], [2, 3], [4, 5]]
    assert loader.state_dict()["batches_yielded"] == 3
    del loader
    gc.collect()  # the DataLoader iterator (and its workers) end here, inside the shorter wait


@pytest.mark.parametrize("depth", DEPTHS)
def test_skip_first_batches_and_end_of_dataloader(depth):
    loader = skip_first_batches(_prepared(list(range(10)), depth, processes=1, index=0), 2)
    seen = [(_values(b), loader.end_of_dataloader) for b in loader]
    assert seen == [([4, 5], False), ([6, 7], False), ([8, 9], True)]


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetcher_reads_ahead_and_keeps_an_error_for_its_batch(depth):
    reads: list[int] = []

    def source():
        for i in range(5):
            reads.append(i)
            if i == 3:
                raise KeyError("broken")
            yield i, False

    ahead = iter(Prefetcher(source(), depth))
    assert next(ahead)[0] == 0 and reads == list(range(depth + 1))  # at most depth batches beyond the one out
    handed = [0]
    with pytest.raises(KeyError):
        for batch, _, _ in ahead:
            handed.append(batch)
    assert handed == [0, 1, 2]


def test_depth_defaults_and_checks():
    # opt-in until the GPU checks have passed on a real GPU: None is 0 on a CUDA device too
    assert resolve_prefetch_depth(None, torch.device("cuda")) == 0
    assert resolve_prefetch_depth(2, torch.device("cuda")) == 2
    assert resolve_prefetch_depth(None, torch.device("cpu")) == 0
    assert resolve_prefetch_depth(None, None) == 0
    with pytest.raises(ValueError, match=r"prefetch_depth=-1 is invalid: pass an integer >= 0"):
        _prepared(list(range(4)), -1)


def test_dispatch_with_an_explicit_depth_is_refused():
    with pytest.raises(ValueError, match=r"prefetch_depth=2 is not supported with dispatch_batches=True.*"):
        prepare_data_loader(
            DataLoader(Stream(8), batch_size=2),
            num_processes=1,
            process_index=0,
            put_on_device=True,
            device="cpu",
            dispatch_batches=True,
            prefetch_depth=2,
        )


@pytest.mark.parametrize("depth", [1, 2])
def test_an_evaluation_loader_drops_the_same_padding(depth):
    from shardplug.core.evaluation import prepare_eval_loader

    def seen(depth):
        loader = prepare_eval_loader(
            DataLoader(list(range(11)), batch_size=2),
            drop_padding=True,
            num_processes=2,
            process_index=1,
            put_on_device=True,
            device="cpu",
            prefetch_depth=depth,
        )
        return [(b.tolist(), loader.end_of_dataloader) for b in loader]

    assert seen(depth) == seen(0)
    assert seen(depth)[-1] == ([10], True)  # process 1's last batch: 10 and a padding row, cut off


@pytest.mark.parametrize("depth", [1, 2])
def test_a_position_saved_while_reading_ahead_resumes_on_another_number_of_processes(depth):
    def saved(depth):
        loader = _prepared(list(range(24)), depth, processes=2, index=0)
        for i, _ in enumerate(loader):
            if i == 2:
                break
        return loader.state_dict()

    state = saved(depth)
    assert state == saved(0)  # three batches handed out, whatever was read ahead
    resized = _prepared(list(range(24)), depth, processes=1, index=0)
    resized.load_state_dict(state)
    rest = [_values(b) for b in resized]
    assert sorted(v for b in rest for v in b) == list(range(12, 24))  # 2 processes x 3 batches x 2 rows consumed


def _layouts():
    dense = torch.arange(12.0).reshape(3, 4) * (torch.arange(12).reshape(3, 4) % 3 == 0)
    uncoalesced = torch.sparse_coo_tensor(torch.tensor([[0, 0, 2]]), torch.tensor([1.0, 2.0, 3.0]), (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nested's prototype warning
        nested = torch.nested.nested_tensor([torch.ones(2), torch.full((3,), 2.0)])
        jagged = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)
    return {
        "dense": dense,
        "coo": dense.to_sparse(),
        "coo_uncoalesced": uncoalesced,
        "csr": dense.to_sparse_csr(),
        "csc": dense.to_sparse_csc(),
        "bsr": torch.arange(16.0).reshape(4, 4).to_sparse_bsr((2, 2)),
        "nested": nested,
        "jagged": jagged,
    }


@pytest.mark.parametrize("name", sorted(_layouts()))
def test_strided_parts_hold_the_memory_of_every_layout(name):
    """What the side-stream copy marks with ``record_stream`` (a kernel for strided tensors only): strided
    tensors whose storages are those of the sparse or nested tensor's own components."""
    from shardplug.core.loader.prefetch import strided_parts

    tensor = _layouts()[name]
    parts = strided_parts(tensor)
    assert parts and all(part.layout is torch.strided and not part.is_nested for part in parts)
    storages = {part.untyped_storage().data_ptr() for part in parts}
    if tensor.layout is torch.sparse_coo:
        owned = [tensor._indices(), tensor._values()]
    elif tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        owned = [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    elif tensor.layout is torch.sparse_csc:
        owned = [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    elif tensor.is_nested:
        owned = list(tensor.unbind())  # views of the nested tensor's buffer
    else:
        owned = [tensor]
    assert {t.untyped_storage().data_ptr() for t in owned} <= storages


class _Refilled(torch.utils.data.IterableDataset):
    """Yields one buffer, refilled in place with 0, 1, ..., n - 1 (a staging buffer reused by its source)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        buffer = torch.zeros(1)
        for value in range(self.n):
            buffer.fill_(value)
            yield buffer


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_refilled_buffer_hands_out_what_depth_0_hands_out(depth):
    """Even at depth 0 the loader reads one batch ahead (to know the last one), so a source that refills one
    buffer hands out each value one step late and the last twice; reading further ahead on the CPU copies
    each batch as it is read, so it changes nothing more (the source must yield copies to be right)."""

    def handed(d):
        loader = _prepared(_Refilled(12), d, processes=1, index=0, batch_size=None)
        return [batch.item() for batch in loader]

    at_0 = handed(0)
    assert at_0 == [*range(1, 12), 11]  # the value the buffer held when the next one had been read
    assert handed(depth) == at_0


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_for_loop_holds_depth_plus_two_batches(depth):
    """What docs/gpu.md states as the batches held: while the next is read, ``depth + 1`` by the prefetcher
    and the previous one by the loop's variable."""
    alive: weakref.WeakSet = weakref.WeakSet()
    most = 0

    def start(batch):
        nonlocal most
        copy = batch.clone()  # what the device copy makes
        alive.add(copy)
        most = max(most, len(alive))
        return copy

    steps = iter([(torch.full((1,), i), i == 19) for i in range(20)])
    for batch, _, _ in Prefetcher(steps, depth, start):
        assert batch.numel() == 1
    assert most == depth + 2


def test_an_out_of_memory_error_of_a_look_ahead_copy_surfaces_at_its_batch():
    def start(batch):
        if batch == 3:
            raise torch.OutOfMemoryError("the copy of batch 3")
        return batch

    handed = []
    with pytest.raises(torch.OutOfMemoryError, match="batch 3"):
        for batch, _, _ in Prefetcher(iter([(i, i == 5) for i in range(6)]), 2, start):
            handed.append(batch)
    assert handed == [0, 1, 2]  # the batches before it, as a dataset's exception
