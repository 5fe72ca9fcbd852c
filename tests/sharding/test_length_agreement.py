"""Processes given different datasets (or batch sizes) are refused at prepare_data_loader, on every
process, in the collective that agrees the shuffle seed (issue item 3; real gloo groups)."""

from __future__ import annotations

import torch.distributed as dist
from _dist import run_gloo
from torch.utils.data import DataLoader

from shardplug import prepare_data_loader


def _prepare_uneven(rank, world, lengths, batch_sizes, kwargs):
    loader = DataLoader(range(lengths[rank]), batch_size=batch_sizes[rank], shuffle=True)
    try:
        prepare_data_loader(loader, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


def test_different_dataset_lengths_are_refused_on_every_process():
    errors = run_gloo(_prepare_uneven, [20, 10], [4, 4], {}, world_size=2)
    for rank, error in enumerate(errors):
        assert error is not None, f"process {rank} did not refuse"
        assert "20 samples on process 0" in error and "10 on process 1" in error and f"process {rank})" in error


def test_different_batch_sizes_are_refused_on_every_process():
    errors = run_gloo(_prepare_uneven, [24, 24, 24], [4, 4, 6], {"shuffle_algorithm": "bijective"}, world_size=3)
    assert all(e is not None and "batch_size=4 on process 0" in e and "batch_size=6 on process 2" in e for e in errors)


def test_dispatch_reads_on_process_0_only_so_other_lengths_do_not_matter():
    results = run_gloo(
        _prepare_uneven,
        [20, 10],
        [4, 4],
        {"dispatch_batches": True, "put_on_device": True, "device": "cpu"},
        world_size=2,
    )
    assert results == [None, None]


class _Counting:
    """Counts the object collectives a loader makes (where a seed is agreed)."""

    def __init__(self):
        self.calls = []
        for name in ("broadcast_object_list", "all_gather_object"):
            original = getattr(dist, name)
            setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)

        return counted


def _collectives_of_a_shuffled_epoch(rank, world):
    counting = _Counting()
    loader = prepare_data_loader(DataLoader(range(20), batch_size=2, shuffle=True))
    at_prepare = len(counting.calls)
    orders = [[i for batch in loader for i in batch.tolist()] for _ in range(2)]
    gathered = [None] * world
    dist.all_gather_object(gathered, orders)
    assert all(sorted(sum((g[e] for g in gathered), [])) == list(range(20)) for e in range(2)), "disjoint shards"
    return at_prepare, counting.calls[:-1]


def test_the_agreement_is_the_seed_collective_and_no_other():
    for at_prepare, calls in run_gloo(_collectives_of_a_shuffled_epoch, world_size=2):
        assert at_prepare == 1 and calls == ["all_gather_object"], calls


def _dies_before(rank: int, world: int, point: str) -> str | None:
    """Process 1 is killed (SIGKILL) before the collective at ``point``; process 0 reports its error."""
    import os
    import signal

    from shardplug import gather_for_metrics

    dist.barrier()  # every process has its group up (a death during gloo's connecting fails the others' set-up)
    loader = None
    if point == "gather":
        loader = prepare_data_loader(DataLoader(range(8), batch_size=2), data_seed=1)
        loader.track_padding()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if point == "seed":
            prepare_data_loader(DataLoader(range(8), batch_size=2, shuffle=True))
        else:
            for batch in loader:
                gather_for_metrics(batch, loader)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_a_process_that_died_is_reported_by_what_the_others_waited_for():
    for point, waited in (
        ("seed", "every process of the group (process 0's shuffle seed and every dataset length and batch size)"),
        ("gather", "every process of the group (every process's rows of this batch (gather_for_metrics"),
    ):
        error = run_gloo(_dies_before, point, world_size=2, timeout=60, allow_deaths=True)[0]
        assert error is not None and f"process 0 waited for {waited}" in error, error
        assert "the group's timeout, 30 s" in error and "Restart the job" in error, error
