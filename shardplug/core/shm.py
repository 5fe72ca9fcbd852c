"""Shared-memory rings: how a dispatching process 0 hands rows to processes on its own host.

Process 0 writes each step's rows for process ``j`` into one slot of a ring it made for ``j``
(a file in ``/dev/shm``, memory-mapped); process ``j`` maps the same file, copies its rows out
and sends process 0 a receipt, after which the slot may be written again. The process group
carries only the control messages. The file is removed as soon as process ``j`` has mapped it
(the mapping stays valid), so nothing is left in ``/dev/shm`` when a process exits, fails or is
killed; a ring nobody mapped is removed by its owner when it is closed or at exit.

Example::

    >>> ring = SharedRing(slots=2, slot_bytes=64)
    >>> reader = RingReader(ring.path, ring.slots, ring.slot_bytes)  # in the other process
    >>> ring.write(0, [torch.arange(4)])
    >>> reader.read(0, [(torch.int64, (4,))])[0].tolist()
    [0, 1, 2, 3]
    >>> ring.close(); reader.close()
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import uuid
from typing import Any, Optional

import torch

__all__ = ["SharedRing", "RingReader", "ring_bytes", "shared_memory_dir"]

logger = logging.getLogger(__name__)

_OPEN: set[str] = set()  # rings made by this process whose file may still exist


def shared_memory_dir() -> Optional[str]:
    """Where rings live (``/dev/shm``), or ``None`` where there is no such directory."""
    path = os.environ.get("SHARDPLUG_SHM_DIR", "/dev/shm")
    return path if os.path.isdir(path) and os.access(path, os.W_OK) else None


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    _OPEN.discard(path)


@atexit.register
def _remove_unmapped_rings() -> None:
    for path in list(_OPEN):
        _unlink(path)


class SharedRing:
    """Process 0's side: ``slots`` slots of ``slot_bytes`` bytes in one memory-mapped file."""

    def __init__(self, slots: int, slot_bytes: int, directory: Optional[str] = None) -> None:
        directory = directory or shared_memory_dir()
        if directory is None:
            raise OSError("no shared-memory directory (/dev/shm) to put a dispatch ring in")
        self.slots, self.slot_bytes = slots, slot_bytes
        self.path = os.path.join(directory, f"shardplug-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        _OPEN.add(self.path)
        try:
            os.ftruncate(fd, slots * slot_bytes)
            self._map = mmap.mmap(fd, slots * slot_bytes)
        except BaseException:
            _unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def write(self, slot: int, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` (one after the other) into ``slot``."""
        offset = slot * self.slot_bytes
        for tensor in tensors:
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            self._bytes[offset : offset + flat.numel()].copy_(flat)
            offset += flat.numel()

    def close(self, remove: bool = True) -> None:
        """Unmap; remove the file if no reader did (``remove=False``: a reader may still map it,
        and removes it then; failing that, it is removed at exit)."""
        if remove:
            _unlink(self.path)
        self._bytes = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a tensor view is still alive: the mapping goes with it
            logger.debug("dispatch ring %s still viewed; unmapped when the view goes", self.path)


class RingReader:
    """Process ``j``'s side: maps the ring's file (and removes it: the mapping stays valid)."""

    def __init__(self, path: str, slots: int, slot_bytes: int) -> None:
        self.path, self.slots, self.slot_bytes = path, slots, slot_bytes
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, slots * slot_bytes)
        finally:
            os.close(fd)
        try:
            os.unlink(path)  # both processes hold the mapping now: nothing can be left behind
        except FileNotFoundError:
            pass
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def read(self, slot: int, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
        """Copies of the tensors of ``specs`` (dtype, shape) stored one after the other in ``slot``."""
        offset = slot * self.slot_bytes
        out = []
        for dtype, shape in specs:
            n = _nbytes(dtype, shape)
            out.append(self._bytes[offset : offset + n].clone().view(dtype).reshape(shape))
            offset += n
        return out

    def close(self) -> None:
        self._bytes = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            pass


def ring_bytes(specs: list[tuple[Any, Any]]) -> int:
    """Bytes one part of the tensor ``specs`` takes in a slot."""
    return sum(_nbytes(dtype, shape) for dtype, shape in specs)
