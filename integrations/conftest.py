"""Test helpers shared by the Lightning and Ignite tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def parquet_shards() -> Callable[[Path], tuple[int, ...]]:
    """Writes a local Hugging Face stream (4 parquet shards of 10, 10, 10 and 13 rows: parts of 20 and
    23 rows on 2 processes, row ``i`` holds ``x = i``) into a directory; returns the rows per shard."""
    datasets = pytest.importorskip("datasets")
    shards = (10, 10, 10, 13)

    def write(root: Path) -> tuple[int, ...]:
        root.mkdir()
        start = 0
        for s, rows in enumerate(shards):
            datasets.Dataset.from_dict({"x": list(range(start, start + rows))}).to_parquet(
                str(root / f"part-{s}.parquet")
            )
            start += rows
        return shards

    return write
