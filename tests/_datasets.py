"""Small datasets and helpers shared by the tests."""

from __future__ import annotations

from torch.utils.data import IterableDataset


class Stream(IterableDataset):
    """The integers ``0 .. n-1`` as a sized stream."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def rows(loader):
    """Every batch of one pass, as lists."""
    return [b.tolist() for b in loader]
