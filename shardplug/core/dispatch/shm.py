"""Shared-memory rings: how a dispatching process 0 hands rows to processes on its own host.

Process 0 writes each step's rows for process ``j`` into one slot of a ring it made for ``j``
(a file in ``/dev/shm``, memory-mapped); process ``j`` maps the same file, copies its rows out
and counts the step in its :class:`ReceiptCounter` (shared memory too), after which the slot may
be written again. The process group carries only the control messages. With the loader's
``default_collate``, :class:`CollateIntoRing` makes the rows in the slot in the first place.
The file is removed as soon as process ``j`` has mapped it
(the mapping stays valid), so nothing is left in ``/dev/shm`` when a process exits, fails or is
killed; a ring nobody mapped is removed by its owner when it is closed or at exit.

Example::

    >>> ring = SharedRing(slots=2, slot_bytes=64)
    >>> reader = RingReader(ring.path, ring.slots, ring.slot_bytes)  # in the other process
    >>> ring.write(0, [torch.arange(4)])  # the bytes copied
    32
    >>> reader.read(0, [(torch.int64, (4,))])[0].tolist()
    [0, 1, 2, 3]
    >>> ring.close(); reader.close()
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import struct
import uuid
from typing import Any, cast

import torch
from torch.utils.data import default_collate

from shardplug.core._internal.compat import torch_collate as _torch_collate

__all__ = [
    "SharedRing",
    "RingReader",
    "ReceiptCounter",
    "CollateIntoRing",
    "ring_bytes",
    "shared_memory_dir",
]

logger = logging.getLogger(__name__)

_OPEN: set[str] = set()  # rings made by this process whose file may still exist


def shared_memory_dir() -> str | None:
    """Where rings live (``/dev/shm``), or ``None`` where there is no such directory."""
    path = os.environ.get("SHARDPLUG_SHM_DIR", "/dev/shm")
    return path if os.path.isdir(path) and os.access(path, os.W_OK) else None


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


_ALIGNMENT = 64
"""Every tensor in a slot starts at a multiple of this many bytes (aligned for any dtype)."""


def _padded(nbytes: int) -> int:
    """The bytes a tensor of ``nbytes`` takes in a slot: the next one starts aligned."""
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


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


def _create_mapped(nbytes: int, directory: str | None) -> tuple[str, mmap.mmap]:
    """A new file of ``nbytes`` in the shared-memory directory, mapped; removed at exit unless a
    reader removed it first."""
    directory = directory or shared_memory_dir()
    if directory is None:
        raise OSError("no shared-memory directory (/dev/shm) to put a dispatch ring in")
    path = os.path.join(directory, f"shardplug-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    _OPEN.add(path)
    try:
        os.ftruncate(fd, nbytes)
        return path, mmap.mmap(fd, nbytes)
    except BaseException:
        _unlink(path)
        raise
    finally:
        os.close(fd)


def _attach_mapped(path: str, nbytes: int) -> mmap.mmap:
    """Map another process's file, and remove it: both hold the mapping now, nothing can be left behind."""
    fd = os.open(path, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return mapped


class SharedRing:
    """Process 0's side: ``slots`` slots of ``slot_bytes`` bytes in one memory-mapped file."""

    def __init__(self, slots: int, slot_bytes: int, directory: str | None = None) -> None:
        self.slots, self.slot_bytes = slots, _padded(slot_bytes)  # every slot starts aligned
        self.path, self._map = _create_mapped(slots * self.slot_bytes, directory)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def slot_view(self, slot: int, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The ``dtype`` / ``shape`` tensor at byte ``offset`` of ``slot`` (a view: writing it writes
        the ring), or ``None`` where it would not fit or not be aligned for ``dtype``."""
        nbytes = _nbytes(dtype, shape)
        start = slot * self.slot_bytes + offset
        if start % torch.empty((), dtype=dtype).element_size() or offset + nbytes > self.slot_bytes:
            return None
        return self._bytes[start : start + nbytes].view(dtype).view(shape)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies in this ring."""
        base = self._bytes.data_ptr()
        return tensor.device.type == "cpu" and base <= tensor.data_ptr() < base + self.slots * self.slot_bytes

    def write(self, slot: int, tensors: list[torch.Tensor]) -> int:
        """Put ``tensors`` (one after the other, each aligned) into ``slot``; the bytes copied.

        A tensor already in its place (collated there by :class:`CollateIntoRing`) is not copied;
        one that lies elsewhere in the ring is copied out first, so no write overwrites a source.
        """
        offset, placed = slot * self.slot_bytes, []
        for tensor in tensors:
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            in_place = flat.data_ptr() == self._bytes.data_ptr() + offset
            placed.append((offset, None if in_place else flat.clone() if self.holds(flat) else flat))
            offset += _padded(flat.numel())
        copied = 0
        for start, source in placed:
            if source is not None:
                self._bytes[start : start + source.numel()].copy_(source)
                copied += source.numel()
        return copied

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
        self._map = _attach_mapped(path, slots * slot_bytes)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def read(self, slot: int, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
        """Copies of the tensors of ``specs`` (dtype, shape) stored one after the other in ``slot``."""
        offset = slot * self.slot_bytes
        out = []
        for dtype, shape in specs:
            n = _nbytes(dtype, shape)
            out.append(self._bytes[offset : offset + n].clone().view(dtype).reshape(shape))
            offset += _padded(n)
        return out

    def close(self) -> None:
        self._bytes = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            pass


class ReceiptCounter:
    """How many steps process ``j`` has received, in shared memory: ``j`` counts, process 0 reads.

    The receipt a process sends for every step, without the process group: on one host a gloo
    send and receive cost more than the rows of a step cost to copy. Process 0 makes it
    (``ReceiptCounter()``), process ``j`` maps it (``ReceiptCounter(path)``, which removes the file).
    The other way, process 0 writes there which process died (:attr:`dead`, ``-1``: none), so that
    ``j`` stops waiting for a message that may never come.

    Example::

        >>> mine = ReceiptCounter()
        >>> theirs = ReceiptCounter(mine.path)  # in process j
        >>> theirs.count = 3
        >>> mine.count, theirs.dead
        (3, -1)
        >>> mine.dead = 2
        >>> theirs.dead
        2
        >>> theirs.close(); mine.close()
    """

    _FORMAT = "q"

    def __init__(self, path: str | None = None, directory: str | None = None) -> None:
        if path is None:
            self.path, self._map = _create_mapped(_ALIGNMENT, directory)
        else:
            self.path, self._map = path, _attach_mapped(path, _ALIGNMENT)

    @property
    def count(self) -> int:
        return cast("int", struct.unpack_from(self._FORMAT, self._map, 0)[0])

    @count.setter
    def count(self, value: int) -> None:
        struct.pack_into(self._FORMAT, self._map, 0, value)  # one aligned 8-byte store

    @property
    def dead(self) -> int:
        """The process that process 0 found dead (``-1``: none)."""
        return cast("int", struct.unpack_from(self._FORMAT, self._map, 8)[0]) - 1

    @dead.setter
    def dead(self, process: int) -> None:
        struct.pack_into(self._FORMAT, self._map, 8, process + 1)  # a new file holds zeros: none

    def close(self, remove: bool = True) -> None:
        """Unmap (and remove the file if the other process never mapped it)."""
        if remove:
            _unlink(self.path)
        self._map.close()


def ring_bytes(specs: list[tuple[Any, Any]]) -> int:
    """Bytes one part of the tensor ``specs`` takes in a slot (each tensor's start aligned)."""
    return sum(_padded(_nbytes(dtype, shape)) for dtype, shape in specs)


class CollateIntoRing:
    """``default_collate`` that can stack a batch's tensors straight into a slot of a ring.

    While :attr:`target` is ``(ring, slot)``, the next batch collated puts its tensors one after
    the other into that slot, in the order :meth:`SharedRing.write` lays them out (the batch's
    leaves in order), so writing the batch there copies nothing. Numbers become their tensor as
    ``default_collate`` makes it and are put in place too. A tensor that ``torch.stack(out=)``
    cannot make as ``default_collate`` does (autograd, mixed dtypes or shapes, not strided CPU
    memory), or that does not fit, is collated as usual, and the rest of the batch with it. The
    target is used for one batch only; without one this is ``default_collate`` exactly.

    Example::

        >>> ring = SharedRing(slots=2, slot_bytes=64)
        >>> collate = CollateIntoRing()
        >>> collate.target = (ring, 1)
        >>> batch = collate([torch.arange(2), torch.arange(2)])
        >>> ring.holds(batch), ring.write(1, [batch])  # already in place: no byte copied
        (True, 0)
        >>> del batch; ring.close()
    """

    def __init__(self) -> None:
        self.target: tuple[SharedRing, int] | None = None
        self._offset = 0
        table = dict(_torch_collate.default_collate_fn_map)
        for kind, function in table.items():  # the entries that make a tensor without recursing
            if function in _NUMBER_FUNCTIONS:
                table[kind] = self._placed(function)
        table[torch.Tensor] = self._stack_into_slot
        self._table = table

    def __call__(self, batch: Any) -> Any:
        if self.target is None:
            return default_collate(batch)
        self._offset = 0
        try:
            return _torch_collate.collate(batch, collate_fn_map=self._table)
        finally:
            self.target = None

    def _slot(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The next place in the target slot for a ``dtype`` / ``shape`` tensor, or ``None``
        (and no target any more: the tensors after this one would not be in their place)."""
        if self.target is not None:
            ring, slot = self.target
            out = ring.slot_view(slot, self._offset, dtype, shape)
            if out is not None:
                self._offset += _padded(out.numel() * out.element_size())
                return out
        self.target = None
        return None

    def _stack_into_slot(self, batch: Any, *, collate_fn_map: Any = None) -> torch.Tensor:
        elem = batch[0]
        out = self._slot(elem.dtype, (len(batch), *elem.shape)) if _stackable(batch) else None
        if out is None:
            self.target = None
            return cast("torch.Tensor", _torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map))
        return torch.stack(batch, 0, out=out)

    def _placed(self, function: Any) -> Any:
        def collate_and_place(batch: Any, *, collate_fn_map: Any = None) -> Any:
            made = function(batch, collate_fn_map=collate_fn_map)
            if not isinstance(made, torch.Tensor) or made.dim() == 0:
                return made
            out = self._slot(made.dtype, tuple(made.shape))
            return made if out is None else out.copy_(made)

        return collate_and_place

    def __reduce__(self) -> Any:
        return CollateIntoRing, ()  # a copy holds no ring


_NUMBER_FUNCTIONS = (
    _torch_collate.collate_float_fn,
    _torch_collate.collate_int_fn,
    _torch_collate.collate_numpy_scalar_fn,
)


def _stackable(batch: list[Any]) -> bool:
    """Whether ``torch.stack(batch, out=)`` gives what ``default_collate`` gives."""
    elem = batch[0]
    if elem.layout != torch.strided or elem.is_nested or elem.device.type != "cpu":
        return False
    return not any(t.requires_grad or t.dtype != elem.dtype or t.shape != elem.shape for t in batch)
