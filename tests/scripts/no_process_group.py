"""``prepare_data_loader`` under ``torchrun`` before and after ``dist.init_process_group``.

Usage: ``torchrun --nproc_per_node 2 no_process_group.py OUT_DIR``. Without a process group (the
topology comes from the launcher's environment) each rank prepares a shuffled loader, a sequential
one (2 workers), a shuffled one with ``data_seed`` (2 workers) and a stream put on device; then it
initialises the group and prepares the shuffled loader again. Each case's rows per epoch (or its
error) go to ``OUT_DIR/rank{r}.json``. Last, with the group destroyed again, the shuffled loader is
prepared without catching its error: the launch ends with that error, as a user's script would.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from shardplug import prepare_data_loader


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(20))


def epochs(loader: DataLoader, n: int = 2) -> list[list[int]]:
    """This process's rows, per epoch."""
    out = []
    for epoch in range(n):
        loader.set_epoch(epoch)
        out.append([int(v) for batch in loader for v in batch])
    return out


def attempt(make: Any, **options: Any) -> dict[str, Any]:
    try:
        return {"rows": epochs(prepare_data_loader(make(), **options))}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def shuffled() -> DataLoader:
    return DataLoader(range(20), batch_size=2, shuffle=True)


def main(out: Path) -> None:
    results = {
        "shuffle": attempt(shuffled),
        "sequential": attempt(lambda: DataLoader(range(20), batch_size=2, num_workers=2)),
        "seeded": attempt(lambda: DataLoader(range(20), batch_size=2, shuffle=True, num_workers=2), data_seed=7),
        "stream_on_device": attempt(lambda: DataLoader(Stream(), batch_size=2), put_on_device=True),
    }
    dist.init_process_group("gloo")
    results["shuffle_with_group"] = attempt(shuffled)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()  # both ranks wrote theirs before either fails below
    dist.destroy_process_group()
    prepare_data_loader(shuffled())


if __name__ == "__main__":
    assert "RANK" in os.environ, "run under torchrun"
    main(Path(sys.argv[1]))
