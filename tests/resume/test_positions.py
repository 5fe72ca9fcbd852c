"""Positions with identity (docs/resume.md) and the fixes of the plan rebuild, each shown by a test that
failed before it: validation of loaded positions, exact len() after a resume, generator-driven
shuffles resumed in a fresh process, nested set_epoch, per-pass padding state, pickling,
DataLoader(batch_size=None), shuffles from a sampler's generator, the data_seed range."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from _datasets import Stream, rows
from _dist import run_gloo
from torch.utils.data import BatchSampler, DataLoader, SubsetRandomSampler

from shardplug import SeedableRandomSampler, ShardplugConfig, prepare_data_loader
from shardplug.core.resume.position import POSITION_FORMAT, Position


def _prepared(n=20, b=2, world=2, rank=0, **kwargs):
    return prepare_data_loader(DataLoader(range(n), batch_size=b, **kwargs), num_processes=world, process_index=rank)


def _after(loader, batches):
    iterator = iter(loader)
    return [next(iterator).tolist() for _ in range(batches)]


# -- the position's identity and validation ------------------------------------------------------------
def test_a_position_records_its_identity_and_loads_with_weights_only(tmp_path):
    loader = prepare_data_loader(
        DataLoader(range(20), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3)),
        num_processes=2,
        process_index=0,
    )
    _after(loader, 2)
    state = loader.state_dict()
    assert state["format"] == POSITION_FORMAT
    assert (state["dataset_length"], state["batch_size"], state["process_batch_size"], state["step_batch_size"]) == (
        20,
        2,
        2,
        4,
    )
    assert (state["sampler"], state["even_batches"], state["drop_last"]) == ("RandomSampler", True, False)
    assert state["generator_state"].dtype == torch.uint8
    torch.save(state, tmp_path / "p.pt")
    loaded = torch.load(tmp_path / "p.pt", weights_only=True)
    assert Position.from_dict(loaded) == Position.from_dict(state)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"format": 99}, "format=99"),
        ({"extra": 1}, "extra keys \\['extra'\\]"),
        ({"consumed": -1}, "consumed=-1"),
        ({"epoch": "0"}, "epoch='0'"),
        ({"batches_yielded": 1.5}, "batches_yielded=1.5"),
        ({"unit": "rows"}, "unit='rows'"),
        ({"seeds": ["a"]}, "seeds=\\['a'\\]"),
        ({"consumed": 11}, "consumed=11 is beyond this loader's epoch of 10 global_batches"),
        ({"batches_yielded": 6}, "batches_yielded=6 is beyond"),
        ({"dataset_length": 30}, "dataset_length=30 differs from this loader's dataset_length=20"),
        ({"batch_size": 4}, "batch_size=4 differs from this loader's batch_size=2"),
        ({"drop_last": True}, "drop_last=True differs"),
        ({"sampler": "RandomSampler"}, "sampler='RandomSampler' differs"),
        ({"seeds": [1]}, "1 shuffle seeds"),
    ],
)
def test_a_bad_position_is_refused_before_anything_changes(change, key):
    loader = _prepared()
    _after(loader, 2)
    good = loader.state_dict()
    target = _prepared()
    expected = rows(_prepared())
    with pytest.raises(ValueError, match=key):
        target.load_state_dict({**good, **change})
    assert rows(target) == expected, "a refused position must leave the loader as it was"
    target.load_state_dict(good)
    assert rows(target) == expected[2:]


def test_missing_keys_and_old_positions_are_refused_with_the_fix():
    loader = _prepared()
    state = loader.state_dict()
    del state["sampler"]
    with pytest.raises(ValueError, match=r"missing keys \['sampler'\]"):
        loader.load_state_dict(state)
    with pytest.raises(ValueError, match="no 'format' key.*skip_first_batches"):
        loader.load_state_dict({"epoch": 0, "batches_yielded": 2, "seeds": []})
    with pytest.raises(ValueError, match="must be a dict"):
        loader.load_state_dict([1, 2])


def test_a_position_for_another_batch_size_or_dataset_is_refused():
    loader = _prepared(b=2)
    _after(loader, 3)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="batch_size=2 differs from this loader's batch_size=4"):
        _prepared(b=4).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_length=20 differs from this loader's dataset_length=24"):
        _prepared(n=24).load_state_dict(state)


@pytest.mark.parametrize("world_after", [2, 3])
def test_len_is_exact_after_a_resume_also_with_another_number_of_processes(world_after):
    loaders = [_prepared(n=23, world=2, rank=r) for r in range(2)]
    for loader in loaders:
        _after(loader, 3)
    state = loaders[0].state_dict()
    for rank in range(world_after):
        resumed = _prepared(n=23, world=world_after, rank=rank)
        resumed.load_state_dict(state)
        expected_len = len(resumed)
        got = rows(resumed)
        assert len(got) == expected_len, "len() after load_state_dict is what the resumed pass yields"
        assert len(resumed) == len(_prepared(n=23, world=world_after, rank=rank)), "then the full epoch again"


def test_skip_first_batches_len_matches_what_it_yields():
    from shardplug import skip_first_batches

    loader = _prepared(n=21)
    skipped = skip_first_batches(loader, 2)
    assert len(skipped) == len(rows(skipped)) == len(loader) - 2


def test_a_generator_driven_shuffle_resumes_in_a_fresh_process_in_any_epoch():
    def make():
        generator = torch.Generator().manual_seed(11)  # a fresh process: the generator starts over
        return prepare_data_loader(
            DataLoader(range(24), batch_size=3, shuffle=True, generator=generator), num_processes=2, process_index=1
        )

    reference = make()
    epochs = [rows(reference) for _ in range(3)]
    assert epochs[0] != epochs[1]
    loader = make()
    rows(loader)  # epoch 0
    assert _after(loader, 2) == epochs[1][:2]
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert rows(resumed) == epochs[1][2:], "epoch 1 continues with epoch 1's order, not epoch 0's"
    assert rows(resumed) == epochs[2]


def test_a_position_saved_at_the_end_of_a_pass_starts_the_next_epoch():
    def make():
        return prepare_data_loader(
            DataLoader(range(12), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(2)),
            num_processes=2,
            process_index=0,
        )

    reference = make()
    epochs = [rows(reference) for _ in range(2)]
    loader = make()
    iterator = iter(loader)
    for _ in range(len(loader)):
        next(iterator)  # the last batch is being processed
    state = loader.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 0)
    resumed = make()
    resumed.load_state_dict(state)
    assert rows(resumed) == epochs[1]


# -- set_epoch reaches every level ---------------------------------------------------------------------
class EpochBatchSampler(BatchSampler):
    """A batch sampler with a set_epoch of its own, over a sampler that has one too."""

    def __init__(self, sampler, batch_size):
        super().__init__(sampler, batch_size, False)
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def test_set_epoch_reaches_a_sampler_inside_a_batch_sampler_with_its_own_set_epoch():
    batch_sampler = EpochBatchSampler(SeedableRandomSampler(range(16), data_seed=4), 4)
    loader = prepare_data_loader(DataLoader(range(16), batch_sampler=batch_sampler), num_processes=2, process_index=0)
    first = rows(loader)
    loader.set_epoch(1)
    second = rows(loader)
    assert first != second, "the inner sampler must change its order with the epoch"
    assert loader.batch_sampler.batch_sampler.epochs[-1] == 1
    assert loader.batch_sampler.sampler.epoch == 1


# -- per-pass state --------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_leaving_a_pass_early_leaves_no_padding_record_behind(workers):
    loader = prepare_data_loader(
        DataLoader(range(10), batch_size=2, num_workers=workers), num_processes=2, process_index=1
    )
    loader.track_padding()
    for _ in loader:
        break
    seen = [(batch.tolist(), loader.batch_indices, loader.batch_real_count) for batch in loader]
    assert [batch for batch, _, _ in seen] == [[2, 3], [6, 7], [0, 1]]
    assert all(batch == indices for batch, indices, _ in seen), "batch_indices must describe the batch handed out"
    assert [real for _, _, real in seen] == [2, 2, 0]


# -- pickling --------------------------------------------------------------------------------------------
class MyLoader(DataLoader):
    pass


def test_prepared_loaders_pickle_also_from_a_dataloader_subclass_and_mid_epoch():
    loader = prepare_data_loader(MyLoader(range(10), batch_size=2), num_processes=2, process_index=1)
    copy = pickle.loads(pickle.dumps(loader))
    assert isinstance(copy, MyLoader) and type(copy).__name__ == type(loader).__name__
    assert rows(copy) == rows(loader)
    iterator = iter(loader)
    next(iterator)
    middle = pickle.loads(pickle.dumps(loader))  # mid-epoch: the position travels, the open iterator does not
    assert middle.state_dict() == loader.state_dict()
    buffer = io.BytesIO()
    torch.save(loader, buffer)
    assert isinstance(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False), MyLoader)


# -- DataLoader(batch_size=None) ---------------------------------------------------------------------------
def test_a_loader_without_batches_is_unchanged_on_one_process_and_sharded_by_samples_on_more():
    single = prepare_data_loader(DataLoader(range(5), batch_size=None), num_processes=1, process_index=0)
    assert [int(x) for x in single] == [0, 1, 2, 3, 4] and single.batch_size is None
    shards = [
        prepare_data_loader(DataLoader(range(5), batch_size=None), num_processes=2, process_index=r) for r in range(2)
    ]
    got = [[int(x) for x in shard] for shard in shards]
    assert got == [[0, 2, 4], [1, 3, 0]], "samples shared out as batches of one, padded from the epoch's start"
    assert [len(shard) for shard in shards] == [3, 3]
    uneven = [
        prepare_data_loader(DataLoader(range(5), batch_size=None), num_processes=2, process_index=r, even_batches=False)
        for r in range(2)
    ]
    assert [[int(x) for x in shard] for shard in uneven] == [[0, 2, 4], [1, 3]]


# -- seeds -------------------------------------------------------------------------------------------------
def test_data_seed_range_is_checked_everywhere_and_the_top_of_the_range_works():
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="data_seed"):
            prepare_data_loader(
                DataLoader(range(4), batch_size=2, shuffle=True), num_processes=1, process_index=0, data_seed=bad
            )
        with pytest.raises(ValueError, match="data_seed"):
            SeedableRandomSampler(range(4), data_seed=bad)
        with pytest.raises(ValueError, match="data_seed"):
            ShardplugConfig(data_seed=bad)
    loader = prepare_data_loader(
        DataLoader(range(4), batch_size=2, shuffle=True), num_processes=1, process_index=0, data_seed=2**64 - 1
    )
    epochs = [sorted(x for b in rows(loader) for x in b) for _ in range(3)]  # epoch 1 used to overflow
    assert epochs == [[0, 1, 2, 3]] * 3


def _subset_shards(rank, world):
    torch.manual_seed(100 + rank)  # processes seeded differently
    sampler = SubsetRandomSampler(list(range(3, 23)))
    loader = prepare_data_loader(DataLoader(range(30), batch_size=2, sampler=sampler))
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append([x for b in loader for x in b.tolist()])
    return epochs, sampler.generator is None


def test_a_sampler_shuffling_with_its_generator_agrees_across_differently_seeded_processes():
    results = run_gloo(_subset_shards, world_size=2)
    for epoch in range(2):
        union = sorted(results[0][0][epoch] + results[1][0][epoch])
        assert union == list(range(3, 23)), "every sample of the subset exactly once"
    assert results[0][0][0] != results[0][0][1], "epochs differ"
    assert all(untouched for _, untouched in results), "the user's sampler is not modified"


# -- streams ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_honours_even_batches_false(workers):
    loaders = [
        prepare_data_loader(
            DataLoader(Stream(11), batch_size=2, num_workers=workers),
            num_processes=2,
            process_index=r,
            even_batches=False,
        )
        for r in range(2)
    ]
    got = [rows(loader) for loader in loaders]
    assert got == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10]]], (
        "no padding: the leftovers go to the first process"
    )
    assert [len(loader) for loader in loaders] == [3, 3]
    shorter = [
        prepare_data_loader(
            DataLoader(Stream(9), batch_size=2, num_workers=workers),
            num_processes=2,
            process_index=r,
            even_batches=False,
        )
        for r in range(2)
    ]
    assert [len(rows(loader)) for loader in shorter] == [len(loader) for loader in shorter] == [3, 2]


@pytest.mark.parametrize("persistent", [False, True])
def test_a_resumed_stream_read_by_workers_skips_only_in_the_resumed_pass(persistent):
    def make():
        return prepare_data_loader(
            DataLoader(Stream(20), batch_size=2, num_workers=2, persistent_workers=persistent),
            num_processes=2,
            process_index=0,
        )

    whole = rows(make())
    loader = make()
    assert _after(loader, 2) == whole[:2]
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    assert rows(resumed) == whole[2:]
    assert rows(resumed) == whole, "the next epoch is whole again (the skip was one-shot)"


def test_a_stream_position_loaded_after_persistent_workers_started_reaches_new_workers():
    def make():
        return prepare_data_loader(
            DataLoader(Stream(20), batch_size=2, num_workers=2, persistent_workers=True),
            num_processes=2,
            process_index=0,
        )

    whole = rows(make())
    saver = make()
    assert _after(saver, 2) == whole[:2]
    state = saver.state_dict()
    loader = make()
    assert rows(loader) == whole  # its persistent workers are running now
    loader.load_state_dict(state)
    assert rows(loader) == whole[2:], "the workers started before the load must not replay the epoch"
    assert rows(loader) == whole, "and the next epoch is whole"


# -- set_epoch in the user's loop after a position was loaded -----------------------------------------
def _epoch_loop_loader(dispatch: bool, drop_last: bool = True):
    """13 samples, batch 2, even_batches=False, a StatefulDataLoader: on 3 processes two steps an epoch with
    drop_last, else 3, 2 and 2 batches."""
    from shardplug import BijectiveRandomSampler

    sampler = BijectiveRandomSampler(range(13), data_seed=99)
    return prepare_data_loader(
        DataLoader(list(range(13)), batch_size=2, sampler=sampler, drop_last=drop_last),
        even_batches=False,
        use_stateful_dataloader=True,
        put_on_device=dispatch,
        dispatch_batches=dispatch,
    )


def _epoch_loops(rank, world):
    """A user's loop ``for epoch in range(start, E): loader.set_epoch(epoch); for batch in loader``, resumed."""
    out = {}
    for dispatch in (False, True):
        uninterrupted = _epoch_loop_loader(dispatch)
        epochs = []
        for epoch in range(2):
            uninterrupted.set_epoch(epoch)
            epochs.append([b.tolist() for b in uninterrupted])
        saving = _epoch_loop_loader(dispatch)
        saving.set_epoch(0)
        iterator = iter(saving)
        next(iterator)
        state = saving.state_dict()  # saved in epoch 0, after its first step
        del iterator
        once = _epoch_loop_loader(dispatch)
        once.load_state_dict(state)
        once.set_epoch(0)  # the loop resumes the epoch it saved in
        iterator = iter(once)
        second = next(iterator).tolist()
        state = once.state_dict()  # saved in epoch 0 again, after its last step: the epoch's end
        del iterator
        twice = _epoch_loop_loader(dispatch)
        twice.load_state_dict(state)
        twice.set_epoch(0)
        rest = (len(twice), [b.tolist() for b in twice])
        twice.set_epoch(1)
        following = [b.tolist() for b in twice]
        at_start = _epoch_loop_loader(dispatch)
        list(at_start)
        at_start.set_epoch(1)  # the loop enters epoch 1 and saves before its first batch
        state = at_start.state_dict()
        resumed = _epoch_loop_loader(dispatch)
        resumed.load_state_dict(state)
        out[dispatch] = (epochs, second, rest, following, [b.tolist() for b in resumed])
        uneven = _epoch_loop_loader(dispatch, drop_last=False)
        whole = []
        for epoch in range(2):
            uneven.set_epoch(epoch)
            whole.append([b.tolist() for b in uneven])
        uneven.set_epoch(1)  # the start of epoch 1 again, after the processes yielded 3, 2 and 2 batches
        states: list = [None] * world
        torch.distributed.all_gather_object(states, uneven.state_dict())
        copies = []
        for state in states:  # every process's copy, loaded on this process
            resumed = _epoch_loop_loader(dispatch, drop_last=False)
            resumed.load_state_dict(state)
            copies.append([b.tolist() for b in resumed])
        out[dispatch, "uneven"] = (states, whole[1], copies)
    out["workers"] = _last_step_positions(world)
    return out


def _last_step_positions(world):
    """Every process's position at each step of a stream split by its 2 DataLoader workers, even_batches=False
    (3, 2 and 2 batches on 3 processes: the stream's end is read in the workers), until every loop has ended."""
    from _combinations import WorkerSplitStream
    from _dist import worker_context

    loader = prepare_data_loader(
        DataLoader(WorkerSplitStream(13), batch_size=2, num_workers=2, multiprocessing_context=worker_context(2)),
        even_batches=False,
    )
    iterator, steps = iter(loader), []
    while True:
        here: list = [None] * world
        torch.distributed.all_gather_object(here, (next(iterator, None) is None, loader.state_dict()))
        if all(ended for ended, _ in here):
            return steps
        steps.append([position for _, position in here])


def test_set_epoch_after_loading_a_position_keeps_its_place_on_3_processes():
    """A position saved at an epoch's end (the pass still open) loaded, then set_epoch(that epoch): the rest of
    the epoch is empty (it yielded the epoch again: process 0 [9, 11], [0, 6]); a position saved right after
    set_epoch(1) at the start of epoch 1 resumes epoch 1 (it said epoch 1 ended: the epoch was skipped), and is
    the same on every process also where they held 3, 2 and 2 batches (batches_yielded 3 on one, 2 on the
    others), every process's copy loading to the same place.  A stream split by its DataLoader workers: at
    process 0's last batch every position is the epoch's end (process 0's said batches_yielded=3 inside epoch 0)."""
    results = run_gloo(_epoch_loops, world_size=3, timeout=120)
    for rank, out in enumerate(results):
        for dispatch in (False, True):
            where = f"process {rank}, dispatch={dispatch}"
            epochs, second, rest, following, resumed = out[dispatch]
            assert second == epochs[0][1], where
            assert rest == (0, []), where
            assert following == epochs[1], where
            assert resumed == epochs[1], where
            states, epoch_one, copies = out[dispatch, "uneven"]
            assert all(state == states[0] for state in states), f"{where}: positions differ {states}"
            assert copies == [epoch_one] * 3, where
    assert results[0][False][0][0] == [[9, 11], [0, 6]]
    steps = results[0]["workers"]
    assert len(steps) == 3 and all(p == steps[-1][0] for p in steps[-1]), f"at process 0's last batch: {steps[-1]}"
    assert steps[-1][0]["epoch"] == 1


def test_set_epoch_of_another_epoch_after_loading_a_position_inside_an_epoch_is_refused():
    """It resumed the position's place in the other epoch's order: epoch 1's first 2 global batches were lost."""

    def make():
        loader = DataLoader(range(20), batch_size=2, shuffle=True)
        return prepare_data_loader(loader, num_processes=2, process_index=0, data_seed=7)

    uninterrupted = make()
    epoch_zero = [b.tolist() for b in uninterrupted]
    saving = make()
    _after(saving, 1)
    resumed = make()
    resumed.load_state_dict(saving.state_dict())
    with pytest.raises(ValueError, match=r"set_epoch\(1\) after loading a position inside epoch 0 .*set_epoch\(0\)"):
        resumed.set_epoch(1)
    resumed.set_epoch(0)  # its own epoch keeps it
    assert [b.tolist() for b in resumed] == epoch_zero[1:]


@pytest.mark.parametrize("seeded", [True, False])
def test_a_position_with_no_step_left_on_the_new_layout_is_the_next_epochs_start(seeded):
    # 144 of 152 samples consumed on 1 process; on 2 processes the 8 left fill no step (drop_last): the
    # position is epoch 0's end there, and the loader resumes at epoch 1's start, with its order
    def make(world, rank):
        shuffle = {} if seeded else {"generator": torch.Generator().manual_seed(7)}
        loader = DataLoader(range(152), batch_size=8, shuffle=True, drop_last=True, **shuffle)
        return prepare_data_loader(
            loader,
            num_processes=world,
            process_index=rank,
            use_seedable_sampler=seeded,
            data_seed=5 if seeded else None,
        )

    saving = make(1, 0)
    _after(saving, 18)
    state = saving.state_dict()
    for rank in range(2):
        reference = make(2, rank)
        epochs = [rows(reference) for _ in range(2)]
        resumed = make(2, rank)
        resumed.load_state_dict(state)
        assert (resumed.epoch, len(resumed), resumed.resume.resumed_batches) == (1, 9, 0)
        assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["consumed"] == 0
        assert rows(resumed) == epochs[1]
