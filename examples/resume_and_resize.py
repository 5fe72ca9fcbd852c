"""Stop a 2-process run mid-epoch, resume it on 3 processes, and prove every sample was seen once.

Run: python examples/resume_and_resize.py      (spawns its own gloo processes on the CPU)
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

import shardplug

SAMPLES, BATCH, STOP_AFTER = 50, 4, 3


def _run(rank: int, world_size: int, port: int, checkpoint: str, resume: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        loader = shardplug.prepare_data_loader(DataLoader(range(SAMPLES), batch_size=BATCH, shuffle=True))
        audit = loader.enable_audit()  # opt-in record of which samples this process consumed
        if resume:
            saved = torch.load(checkpoint, weights_only=True)
            loader.load_state_dict(saved["loader"])  # saved by 2 processes, loaded by 3
            if rank == 0:
                audit.load_state_dict(saved["audit"])  # the interrupted run's record, summed over its processes
        seen = []
        for step, batch in enumerate(loader):
            seen.append(batch.tolist())
            if not resume and step + 1 == STOP_AFTER:
                gathered = audit.gathered()  # a collective: every process calls it
                if rank == 0:
                    torch.save({"loader": loader.state_dict(), "audit": gathered.state_dict()}, checkpoint)
                break
        lines = [None] * world_size
        dist.all_gather_object(lines, f"  process {rank}: {seen}")
        report = audit.gathered().report(epoch=0) if resume else None
        if rank == 0:
            title = "resumed on 3 processes" if resume else f"2 processes, stopped after {STOP_AFTER} batches each"
            sys.stdout.write(f"\n{title}\n" + "\n".join(lines) + "\n")
            if report is not None:
                sys.stdout.write(
                    f"\naudit of epoch 0: {report.seen}/{report.dataset_length} samples seen, "
                    f"missing {report.missing}, duplicated {report.duplicated}, padding {report.padding}, "
                    f"exact={report.exact}\n"
                )
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = os.path.join(folder, "position.pt")
        mp.spawn(_run, args=(2, _port(), checkpoint, False), nprocs=2, join=True)
        mp.spawn(_run, args=(3, _port(), checkpoint, True), nprocs=3, join=True)


if __name__ == "__main__":
    main()
