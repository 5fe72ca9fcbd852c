"""Datasets of the prefetch tests, importable by DataLoader workers started from the tests' fork server."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset


class Failing(Dataset):
    """``0 .. n-1`` (as ``{"x": tensor}``) whose item ``bad`` raises ``ValueError`` (in a worker too: the worker
    sends the exception back and stays alive, as DataLoader workers do)."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i == self.bad:
            raise ValueError(f"item {i} is broken")
        return {"x": torch.tensor([i])}


class Resumable(IterableDataset):
    """The integers ``0 .. n-1`` as a stream with a ``state_dict()`` of its own (a ``StatefulDataLoader``
    saves and restores it: its own state is the place a resumed pass continues from); in DataLoader workers,
    worker ``w`` of ``W`` reads ``w, w + W, ...``."""

    def __init__(self, n: int) -> None:
        self.n, self.pos = n, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()  # in DataLoader workers each reads its own share
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        mine = range(first, self.n, step)
        while self.pos < len(mine):
            self.pos += 1
            yield mine[self.pos - 1]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class FailingStream(IterableDataset):
    """The integers ``0 .. n-1`` as a stream that raises ``ValueError`` instead of yielding ``bad``."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __iter__(self):
        for i in range(self.n):
            if i == self.bad:
                raise ValueError(f"item {i} is broken")
            yield {"x": torch.tensor([i])}
