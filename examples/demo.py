"""Launch 2 CPU processes (gloo) and print which samples each process's batches hold.

Run: python examples/demo.py        (no torchrun needed; it spawns its own processes)
"""

from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

import shardplug

MODES = [
    ("default (even_batches=True: the last step is padded from the start)", {}),
    ("split_batches=True (each global batch of 4 is cut in 2)", {"split_batches": True}),
    ("even_batches=False (no padding; a process may get one batch fewer)", {"even_batches": False}),
    ("shuffle=True (same seed agreed from process 0: disjoint shards)", {"shuffle": True}),
]


def _worker(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for title, options in MODES:
            options = dict(options)
            shuffle = options.pop("shuffle", False)
            batch_size = 4 if options.get("split_batches") else 3
            loader = shardplug.prepare_data_loader(
                DataLoader(range(21), batch_size=batch_size, shuffle=shuffle), **options
            )
            batches = [batch.tolist() for batch in loader]
            lines = [None] * world_size
            dist.all_gather_object(lines, f"  process {rank}: {len(batches)} batches {batches}")
            if rank == 0:
                sys.stdout.write(f"\n21 samples, batch_size={batch_size}, {world_size} processes, {title}\n")
                sys.stdout.write("\n".join(lines) + "\n")
                sys.stdout.flush()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
