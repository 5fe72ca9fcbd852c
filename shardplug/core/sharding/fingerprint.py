"""Do all processes read the same stream? A fingerprint of each pass's first global batch, compared.

A stream read by every process (each keeps its slice of every global batch) is exact only if it
yields the same elements in the same order everywhere. An unseeded shuffle, files listed in
another order, a rank-dependent transform break that silently: samples are duplicated and others
never seen. :class:`FirstBatchCheck` hashes the first global batch of every pass where it is read
(the loader's process, or its first DataLoader worker, through a small shared-memory tensor) and
the loader compares the hashes of all processes once per pass: a mismatch is a ``RuntimeError``
on every process.

Example::

    >>> fingerprint([torch.arange(3), {"text": "a"}]) == fingerprint([torch.arange(3), {"text": "a"}])
    True
    >>> fingerprint([torch.arange(3)]) == fingerprint([torch.arange(1, 4)])
    False
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from shardplug.core._internal.collectives import communication_device, waiting_for, world_size

__all__ = ["FirstBatchCheck", "fingerprint", "checked_first_batch"]

logger = logging.getLogger(__name__)


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"tensor:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, Mapping):
        digest.update(b"map")
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"seq:{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    elif isinstance(value, (str, bytes, int, float, bool, type(None))):
        digest.update(repr(value).encode())
    elif hasattr(value, "tobytes") and hasattr(value, "dtype"):  # numpy arrays and scalars
        digest.update(f"array:{value.dtype}:{getattr(value, 'shape', ())}".encode())
        digest.update(value.tobytes())
    else:
        try:
            digest.update(pickle.dumps(value, protocol=4))
        except Exception:
            digest.update(repr(value).encode())


def fingerprint(elements: list[Any]) -> int:
    """A non-zero 63-bit hash of ``elements`` (tensors by value, containers recursively)."""
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, elements)
    value = int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)
    return value or 1


class FirstBatchCheck:
    """The fingerprint of each pass's first global batch, from wherever it is read, and its comparison.

    ``slots`` (shared memory, so DataLoader workers can write it): the pass the loader started, the
    pass the fingerprint is of, the fingerprint (0: none yet).  ``replicas``: every process reads the
    stream whole as the one data process (the ranks of a device mesh that share its data index).
    """

    def __init__(self, replicas: bool = False) -> None:
        # shared now: forked workers inherit it, spawned ones receive it shared
        self.slots = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._pass = 0
        self.replicas = replicas

    def begin_pass(self) -> None:
        """The loader (its own process) starts a pass: fingerprints of earlier passes no longer count."""
        self._pass += 1
        self.slots[0] = self._pass
        self.slots[2] = 0

    def recorder(self) -> Callable[[list[Any]], None]:
        """A callback for the reader of the first global batch (in the loader's process or a worker)."""
        wanted = int(self.slots[0])

        def record(elements: list[Any]) -> None:
            self.slots[2] = fingerprint(elements) if elements else 1
            self.slots[1] = wanted

        return record

    def agree(self) -> None:
        """Compare the fingerprints of every process (a collective); ``RuntimeError`` when they differ."""
        if world_size() == 1:
            return
        import torch.distributed as dist

        mine = int(self.slots[2]) if int(self.slots[1]) == self._pass else 0  # 0: not known here
        gathered = torch.zeros(world_size(), dtype=torch.int64, device=communication_device())
        with waiting_for("the fingerprint of every process's order of the stream"):
            dist.all_gather_into_tensor(gathered, torch.tensor([mine], dtype=torch.int64, device=gathered.device))
        known = [v for v in gathered.tolist() if v]
        if len(set(known)) > 1:
            if self.replicas:
                how = "Every process reads the whole stream as the device mesh's one data index (its tp / cp ranks)"
                fixes = "or list its files in a fixed order"
            else:
                how = "Every process reads the whole stream and keeps its own slice"
                fixes = (
                    "list its files in a fixed order, or let the stream shard itself (n_shards divisible by the "
                    "processes). If it already reads only its process's part (e.g. it iterates litdata's or "
                    "streaming's StreamingDataset, which split themselves by rank), declare split_by_node = True on "
                    "its class, and splits_by_worker = True if it also reads only its DataLoader worker's part (as "
                    "those do): shardplug then reads each process's part as it is"
                )
            raise RuntimeError(
                "the processes read different streams: the first global batch of this pass differs between them "
                f"(fingerprints per process: {[hex(v) for v in gathered.tolist()]}). {how}, so the stream must yield "
                "the same elements in the same order on every process: seed its shuffle the same way everywhere "
                f"(e.g. dataset.shuffle(seed=...)), {fixes}"
            )
        if not known:
            logger.debug("no fingerprint of the first global batch on any process (an empty pass?)")


def checked_first_batch(batches: Iterator[Any], check: FirstBatchCheck, record: bool = False) -> Iterator[Any]:
    """``batches``, with the processes' first global batches compared once the first one was read
    (``record``: fingerprinted here, the loader's batches being the global ones; else by the reader)."""
    iterator = iter(batches)
    try:
        first = next(iterator)
    except StopIteration:
        check.agree()
        return
    if record:
        check.recorder()([first])
    check.agree()
    yield first
    yield from iterator
