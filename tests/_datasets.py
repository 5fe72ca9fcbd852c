"""Small datasets and helpers shared by the tests."""

from __future__ import annotations

from collections import namedtuple

import torch
from torch.utils.data import Dataset, IterableDataset

Pair = namedtuple("Pair", ["a", "b"])


class Records(Dataset):
    """Nested samples: a dict holding a tensor, a list of tensors and a namedtuple."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {
            "x": torch.tensor([i, i]),
            "parts": [torch.tensor(i), torch.tensor(-i)],
            "pair": Pair(torch.tensor(i), torch.tensor(2 * i)),
        }


class Line(Dataset):
    """``samples`` pairs ``(x, 2x + 1)`` for a linear model (the fault tests train on it)."""

    samples = 47

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), torch.tensor([2.0 * i + 1.0])


class Counting(Dataset):
    """A map-style dataset that records which indices were loaded, and its epochs."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded, self.epochs = n, [], []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded.append(i)
        return i

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class Stream(IterableDataset):
    """The integers ``0 .. n-1`` as a sized stream."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class Unsized(IterableDataset):
    """The integers ``0 .. n-1`` as a stream without ``__len__``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


NO_LEN = "the Unsized has no __len__; give Unsized a __len__"
"""What ``len()`` of a prepared loader over :class:`Unsized` says (with the other fix: iterate without len())."""


class Files(IterableDataset):
    """A stream that shards itself: `n_shards` files of `size` records, split by DataLoader worker too."""

    splits_by_worker = True  # its __iter__ reads only its DataLoader worker's files

    def __init__(self, files, size=5):
        self.files, self.size, self.reads = list(files), size, 0

    @property
    def n_shards(self):
        return len(self.files)

    def shard(self, num_shards, index):
        return type(self)(self.files[index::num_shards], self.size)

    def __len__(self):
        return len(self.files) * self.size

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        mine = self.files if info is None else self.files[info.id :: info.num_workers]
        for f in mine:
            for k in range(self.size):
                yield f * 100 + k


class PlainShards(Files):
    """A stream that shards itself by process (`n_shards` files of `size` records) but not by
    DataLoader worker: every worker reads all of it unless someone splits it."""

    splits_by_worker = False  # shardplug gives each DataLoader worker its own shards

    def __iter__(self):
        for f in self.files:
            for k in range(self.size):
                yield f * 100 + k


def rows(loader):
    """Every batch of one pass, as lists."""
    return [b.tolist() for b in loader]


# a mixture's sources whose rows name both the source and the sample (disjoint values), one 10 times smaller
MIXTURE_SOURCES = {"web": range(0, 30), "code": range(100, 120), "math": range(200, 203)}
MIXTURE_WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


def mixture_sources() -> dict[str, list[int]]:
    return {name: list(rows) for name, rows in MIXTURE_SOURCES.items()}


def check_mixture_read(read: list[int], mixture) -> None:
    """``read`` (the rows a job read from position 0 on, in global order, across its resumes) is ``mixture``'s
    uninterrupted global sequence (a ``shardplug.Mixture`` of :data:`MIXTURE_SOURCES`), and holds every sample
    once per cycle of its source (the ``k``-th draw of a source belongs to its cycle ``k // len(source)``)."""
    expected = [MIXTURE_SOURCES[d.source][d.sample] for d in mixture.locate_many(range(len(read)))]
    assert read == expected, "the global sequence of an uninterrupted run"
    for name, rows in MIXTURE_SOURCES.items():
        drawn = [i for i in read if i in rows]
        cycles = [drawn[c : c + len(rows)] for c in range(0, len(drawn), len(rows))]
        assert all(len(set(cycle)) == len(cycle) for cycle in cycles), f"{name}: a sample twice in a cycle"
        assert all(sorted(cycle) == list(rows) for cycle in cycles[:-1]), f"{name}: a whole cycle each"
        if name == "math":
            assert len(cycles) > 5, "math (3 samples, a fifth of the positions) cycles several times"
