"""Reading batches ahead of the step: the :class:`Prefetcher` of a pass and its :class:`SideStreamCopy`.

A pass hands its batches out through one seam (its ``HandOut``, in :mod:`~shardplug.core.loader.passes`);
with a prefetch depth ``k > 0`` the :class:`Prefetcher` sits in that seam: it reads ``k`` batches ahead of
the one handed out and starts their copy to the device, while counting, padding marks, ``end_of_dataloader``,
the gradient state's notices and the position stay with the batch *handed out* (they happen at hand-out, as without it).

On a CUDA device the copy runs on a side stream (:class:`SideStreamCopy`): host memory is pinned where the
loader did not pin it, the copy of batch ``i + 1`` runs while the step of batch ``i`` computes, the step's
stream waits for its own batch only (an event) and each tensor is marked as used on the step's stream
(``record_stream``; a sparse or nested tensor through its strided components, :func:`strided_parts`), so
the caching allocator never hands its memory out early. At most ``k + 1`` batches
are held by the prefetcher while the next is read; in a ``for`` loop the loop variable holds one more (the
previous batch), ``k + 2`` in all.  Elsewhere (a CPU device, no device) the prefetcher is a look-ahead
whose batches are copied as they are read (:func:`copy_ahead`), so the logic is the same and CI checks it.

An exception raised while reading ahead is kept and raised when the pass reaches the batch it belongs to;
nothing after it is handed out.

Example::

    >>> ahead = Prefetcher(iter([(1, False), (2, False), (3, True)]), depth=2)
    >>> [batch for batch, last, note in ahead]
    [1, 2, 3]
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from shardplug.core._internal.arguments import DEFAULT_CUDA_DEPTH, check_prefetch_depth
from shardplug.core._internal.rows import iter_leaves, map_leaves
from shardplug.core.loader.transfer import move_leaf

__all__ = [
    "Prefetcher",
    "SideStreamCopy",
    "resolve_prefetch_depth",
    "check_prefetch_depth",
    "strided_parts",
    "copy_ahead",
    "DEFAULT_CUDA_DEPTH",
]

logger = logging.getLogger(__name__)


def resolve_prefetch_depth(depth: int | None, device: torch.device | None) -> int:
    """The depth a pass uses: ``depth`` when given, else :data:`DEFAULT_CUDA_DEPTH` on a CUDA ``device`` (0:
    prefetching is opt-in until the GPU checks have passed on a real GPU) and 0 elsewhere (reading ahead on
    the CPU only holds batches longer).

    Example::

        >>> resolve_prefetch_depth(None, torch.device("cpu")), resolve_prefetch_depth(1, None)
        (0, 1)
    """
    if depth is not None:
        return depth
    return DEFAULT_CUDA_DEPTH if device is not None and device.type == "cuda" else 0


class _Failed(NamedTuple):
    """An exception raised while reading ahead, kept for the batch it belongs to."""

    error: BaseException


class Prefetcher:
    """Reads ``depth`` items of ``steps`` (``(batch, last)`` pairs) ahead of the one handed out.

    ``start(batch)`` runs when an item is read (a :class:`SideStreamCopy` starts its copy there), ``finish``
    when it is handed out (the step's stream then waits for its copy); ``note()`` is called right after each
    read and its value handed out with the item (a ``StatefulDataLoader``'s state after that batch).  Yields
    ``(batch, last, note)``.

    Example::

        >>> seen = []
        >>> ahead = Prefetcher(iter([("a", False), ("b", True)]), depth=1, start=lambda b: seen.append(b) or b)
        >>> first = next(iter(ahead)); first[0], seen  # "b" was read (and started) before "a" was handed out
        ('a', ['a', 'b'])
    """

    def __init__(
        self,
        steps: Iterator[tuple[Any, bool]],
        depth: int,
        start: Callable[[Any], Any] | None = None,
        finish: Callable[[Any], Any] | None = None,
        note: Callable[[], Any] | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth!r} is invalid for a Prefetcher: it reads at least 1 batch ahead")
        self.steps = steps
        self.depth = depth
        self.start = start
        self.finish = finish
        self.note = note

    def __iter__(self) -> Iterator[tuple[Any, bool, Any]]:
        queue: deque[tuple[Any, bool, Any] | _Failed] = deque()
        steps, start, finish = self.steps, self.start, self.finish
        more = True
        while True:
            while more and len(queue) <= self.depth:  # the one handed out next, and ``depth`` behind it
                try:
                    batch, last = next(steps)
                    queue.append((start(batch) if start is not None else batch, last, self._noted()))
                except StopIteration:
                    more = False
                except Exception as exc:  # raised where the pass reaches it, and nothing after it
                    queue.append(_Failed(exc))
                    more = False
            if not queue:
                return
            item = queue.popleft()
            if isinstance(item, _Failed):
                queue.clear()
                raise item.error
            batch, last, noted = item
            del item
            yield (finish(batch) if finish is not None else batch), last, noted
            del batch, noted  # the batch handed out is the user's: this frame keeps no reference to it

    def _noted(self) -> Any:
        return self.note() if self.note is not None else None


def copy_ahead(transfer: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """The ``start`` of a look-ahead off CUDA: each batch read ahead is moved (``transfer``, when given) and
    its tensors copied as it is read, so a source that refills one buffer in place hands out what it hands
    out at depth 0 (as the side stream's copy of unpinned memory on a GPU does).

    Example::

        >>> buffer = torch.zeros(1)
        >>> held = copy_ahead(None)(buffer); _ = buffer.fill_(7.0)
        >>> held.item()
        0.0
    """

    def start(batch: Any) -> Any:
        return map_leaves(transfer(batch) if transfer is not None else batch, _copied)

    return start


def _copied(leaf: Any) -> Any:
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf


class _InFlight(NamedTuple):
    """A batch whose copy was started on the side stream, and the event recorded after its copy."""

    batch: Any
    event: Any


class SideStreamCopy:
    """Copies batches to a CUDA ``device`` on a side stream, so that a copy overlaps the step before it.

    :meth:`start` pins host tensors the loader left unpinned (a copy from pageable memory cannot overlap)
    and enqueues the copies on the side stream, then records an event; :meth:`finish` makes the current
    stream wait for that event only and marks each tensor as used by the current stream
    (``Tensor.record_stream``). Tensors already on the device are copied (a source reusing one device buffer
    would otherwise alias every batch in flight). Non-tensor leaves with a ``.to()`` are moved by it, inside
    the side stream.

    Example (on a CUDA machine)::

        copy = SideStreamCopy(torch.device("cuda"))
        batch = copy.finish(copy.start({"x": torch.ones(8)}))
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"device={device} is invalid for a SideStreamCopy: it copies to a CUDA device")
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._warned = False

    def start(self, batch: Any) -> _InFlight:
        """Enqueue ``batch``'s copy on the side stream (after what the current stream has queued so far)."""
        with torch.cuda.device(self.device):  # pinning and events on this device, never the process's current one
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                moved = map_leaves(batch, self._move)
                event = torch.cuda.Event()
                event.record(self.stream)
        return _InFlight(moved, event)

    def finish(self, flight: _InFlight) -> Any:
        """``flight``'s batch, ready for the current stream (which waits for its copy only)."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(flight.event)
        for leaf in _tensors(flight.batch):
            for part in strided_parts(leaf):
                if part.device.type == "cuda":
                    part.record_stream(current)
        return flight.batch

    def _move(self, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return move_leaf(leaf, self.device, non_blocking=True)
        if leaf.device.type == "cpu" and not leaf.is_pinned():
            leaf = self._pinned(leaf)
        moved = move_leaf(leaf, self.device, non_blocking=True)
        # already on the device: copied (on the side stream, after what the current stream queued), so a
        # source that reuses one device buffer does not make every batch in flight alias it
        return moved.clone() if moved is leaf else moved

    def _pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            return tensor.pin_memory()
        except RuntimeError as exc:  # e.g. no pinned memory left: the copy is made, but without overlap
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"shardplug could not pin a batch's host memory ({exc}); its copy to {self.device} cannot "
                    "overlap the step (pass pin_memory=True to the DataLoader, or prefetch_depth=0)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return tensor


def strided_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors that hold ``tensor``'s memory: ``tensor`` itself when it is strided, else its
    components (``Tensor.record_stream`` has a kernel for strided tensors only: marking the components marks
    the memory of a sparse or nested tensor).

    Example::

        >>> coo = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,))
        >>> [part.layout for part in strided_parts(coo)]
        [torch.strided, torch.strided]
    """
    layout = tensor.layout
    if tensor.is_nested:  # torch.strided (one buffer, its sizes kept on the host) or torch.jagged
        parts = [tensor.values()]
        if layout is torch.jagged:
            jagged: Any = tensor  # torch.nested's NestedTensor (a Tensor subclass): its offsets and lengths
            parts += [part for part in (jagged.offsets(), jagged.lengths()) if part is not None]
        return parts
    if layout is torch.strided:
        return [tensor]
    if layout is torch.sparse_coo:
        return [tensor._indices(), tensor._values()]  # also uncoalesced (indices() would refuse)
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    return [tensor]


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``batch``, also inside leaves that are objects with a ``.to()`` (their attributes
    and mapping values, one level deep)."""
    for leaf in iter_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            yield leaf
            continue
        inner = getattr(leaf, "data", None)
        values = inner.values() if isinstance(inner, dict) else getattr(leaf, "__dict__", {}).values()
        for value in values:
            if isinstance(value, torch.Tensor):
                yield value
