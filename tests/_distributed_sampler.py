"""A user's torch ``DistributedSampler`` adopted, in a real process group (test helper): the scenario program that
``tests/sharding/test_multiprocess.py`` runs in its launches of 2 and 3 processes (:func:`scenarios`), and what its
tests compare with (the reference is torch's own ``DataLoader`` with a ``DistributedSampler``, in the same process)."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from shardplug import prepare_data_loader

N, SEED = 23, 7  # 23 samples: neither 2 nor 3 processes divide them (padding, or drop_last's cut)
MATRIX = [  # (shuffle, the sampler's drop_last, the DataLoader's drop_last, DataLoader workers)
    *(
        (shuffle, sampler_drop, loader_drop, 0)
        for shuffle, sampler_drop, loader_drop in itertools.product([False, True], repeat=3)
    ),
    (True, False, False, 2),
]
RESUME = [(True, False), (False, True)]  # (shuffle, the sampler's drop_last) of the resumed runs, batches of 2
STOPS = (1, 3)  # batches each process yields before its position is saved


def loader(processes: int | None, index: int | None, shuffle: bool, sampler_drop: bool, batch: int, **kw: Any):
    """A user's DataLoader over ``range(N)`` with a DistributedSampler (``processes=None``: the group's)."""
    sampler = DistributedSampler(range(N), processes, index, shuffle=shuffle, seed=SEED, drop_last=sampler_drop)
    return sampler, DataLoader(range(N), batch_size=batch, sampler=sampler, **kw)


def native(shuffle: bool, sampler_drop: bool, loader_drop: bool, epoch: int, batch: int = 4) -> list[list[int]]:
    """What native DDP gives this process: torch's DataLoader and DistributedSampler, as they are."""
    sampler, user = loader(None, None, shuffle, sampler_drop, batch, drop_last=loader_drop)
    sampler.set_epoch(epoch)
    return [b.tolist() for b in user]


def real(prepared: Any, batch: torch.Tensor) -> list[int]:
    """The real (not padding) sample ids of ``batch``, the one ``prepared`` handed out last."""
    return batch.tolist()[: prepared.batch_real_count]


def consume(
    position: dict[str, Any] | None, processes: int | None, index: int | None, case: tuple[bool, bool], stop: int | None
) -> tuple[list[int], list[list[int]], dict[str, Any]]:
    """Epoch 1 of a loader of ``processes`` (this process being ``index``; ``None``: the process group's), resumed
    from ``position`` (if any), up to ``stop`` batches: (its real sample ids, its batches, its position)."""
    sampler, user = loader(processes, index, *case, batch=2)
    prepared = prepare_data_loader(user, num_processes=processes, process_index=index)
    prepared.track_padding()
    if position is not None:
        prepared.load_state_dict(position)
    sampler.set_epoch(1)  # the user's loop, as under DDP (a loaded position already stands there)
    ids, batches = [], []
    for batch in itertools.islice(prepared, stop):
        ids += real(prepared, batch)
        batches.append(batch.tolist())
    return ids, batches, prepared.state_dict()


def without_generator(position: dict[str, Any]) -> dict[str, Any]:
    """A position without its generator state (none here), comparable with ``==``."""
    return {key: value for key, value in position.items() if key != "generator_state"}


def scenarios(rank: int, world: int, worker_context: Any) -> dict[str, Any]:
    """Every scenario on this process of ``world`` (``worker_context``: the multiprocessing context of DataLoader
    workers, :func:`_dist.worker_context`)."""
    out: dict[str, Any] = {"native": {}, "adopted": {}, "loader_epochs": {}, "lengths": {}}
    for case in MATRIX:
        shuffle, sampler_drop, loader_drop, workers = case
        context = worker_context(workers) if workers else None
        sampler, user = loader(
            None,
            None,
            shuffle,
            sampler_drop,
            4,
            drop_last=loader_drop,
            num_workers=workers,
            multiprocessing_context=context,
        )
        prepared = prepare_data_loader(user)
        key = str(case)
        out["native"][key] = [native(shuffle, sampler_drop, loader_drop, epoch) for epoch in range(3)]
        out["adopted"][key], out["lengths"][key] = [], []
        for epoch in range(3):
            sampler.set_epoch(epoch)  # the user's own call, on the sampler
            out["lengths"][key].append(len(prepared))
            out["adopted"][key].append([b.tolist() for b in prepared])
        out["loader_epochs"][key] = prepared.epoch
    # padding marked: the wrapped-around rows of every process's last batch
    sampler, user = loader(None, None, True, False, 4)
    prepared = prepare_data_loader(user)
    prepared.track_padding()
    mine = [real(prepared, b) for b in prepared]
    out["all_real"] = [None] * world
    dist.all_gather_object(out["all_real"], mine)
    # resume: positions saved after STOPS batches, loaded on this number of processes and on the other one
    out["saved"], out["resumed"] = {}, {}
    other = 5 - world  # 2 -> 3, 3 -> 2
    for case in RESUME:
        whole = consume(None, None, None, case, None)
        for stop in STOPS:
            ids, _, position = consume(None, None, None, case, stop)
            rest_ids, rest, _ = consume(position, None, None, case, None)
            key = str((case, stop))
            out["saved"][key] = (ids, without_generator(position))
            out["resumed"][key] = {"same": (rest, whole[1][stop:])}
            # the position the other number of processes saves after ``stop`` batches (the same on every process:
            # computed here for each of them), loaded here
            theirs = [consume(None, other, index, case, stop) for index in range(other)]
            rest_ids, _, _ = consume(theirs[0][2], None, None, case, None)
            consumed = [i for index_ids, _, _ in theirs for i in index_ids]
            out["resumed"][key]["other"] = (consumed, rest_ids, without_generator(theirs[0][2]))
    # refused: a sampler built for another job
    out["errors"] = {}
    for name, kwargs in (("rank", {"rank": (rank + 1) % world}), ("num_replicas", {"num_replicas": world + 1})):
        try:
            prepare_data_loader(DataLoader(range(N), batch_size=4, sampler=DistributedSampler(range(N), **kwargs)))
        except ValueError as exc:
            out["errors"][name] = str(exc)
    return out
