"""Dispatch mode: process 0 reads the data and scatters each process its own rows."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist

from .collectives import broadcast_object, global_rank, world_size
from .loaders import DataLoaderShard
from .topology import resolve_data_topology

__all__ = ["DataLoaderDispatcher", "DispatchError", "slice_rows", "concatenate_rows"]

logger = logging.getLogger(__name__)

SliceFn = Callable[[Any, slice, int, int], Any]


class DispatchError(RuntimeError):
    """Raised on every process when process 0 cannot dispatch a batch."""


# -- nested structures ------------------------------------------------------------------------
def _flatten(data: Any) -> tuple[list[Any], Any]:
    """Leaves of a nested dict / list / tuple / namedtuple, and a picklable skeleton to rebuild it."""
    if isinstance(data, Mapping):
        keys = list(data.keys())
        parts = [_flatten(data[k]) for k in keys]
        return [leaf for p in parts for leaf in p[0]], ("map", type(data), keys, [p[1] for p in parts])
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        parts = [_flatten(v) for v in data]
        return [leaf for p in parts for leaf in p[0]], ("namedtuple", type(data), None, [p[1] for p in parts])
    if isinstance(data, (list, tuple)):
        parts = [_flatten(v) for v in data]
        return [leaf for p in parts for leaf in p[0]], ("seq", type(data), None, [p[1] for p in parts])
    return [data], None


def _unflatten(leaves: Iterator[Any], skeleton: Any) -> Any:
    if skeleton is None:
        return next(leaves)
    kind, cls, keys, children = skeleton
    values = [_unflatten(leaves, child) for child in children]
    if kind == "map":
        built = dict(zip(keys, values))
        try:
            return cls(built)
        except TypeError:
            return built
    if kind == "namedtuple":
        return cls(*values)
    return cls(values)


def _describe_path(skeleton: Any, index: int) -> str:
    paths: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if node is None:
            paths.append(prefix or "batch")
            return
        kind, _, keys, children = node
        for position, child in enumerate(children):
            walk(child, f"{prefix}[{keys[position]!r}]" if kind == "map" else f"{prefix}[{position}]")

    walk(skeleton, "")
    return paths[index] if index < len(paths) else "batch"


def slice_rows(data: Any, rows: slice, process_index: int = 0, num_processes: int = 1) -> Any:
    """Rows ``rows`` of every tensor in ``data`` (the default ``slice_fn``)."""
    leaves, skeleton = _flatten(data)
    return _unflatten(iter([leaf[rows] for leaf in leaves]), skeleton)


def concatenate_rows(batches: list[Any]) -> Any:
    """Concatenate same-structured nested batches along dim 0."""
    flat = [_flatten(b) for b in batches]
    skeleton = flat[0][1]
    columns = list(zip(*(leaves for leaves, _ in flat)))
    return _unflatten(iter([torch.cat(column, dim=0) for column in columns]), skeleton)


_FIX = "pass split_batches=True (one batch per step, no concatenation) or dispatch_batches=False"


def _check_batch(batch: Any, reference: Optional[tuple[Any, list[torch.Size]]]) -> tuple[Any, list[torch.Size]]:
    leaves, skeleton = _flatten(batch)
    shapes: list[torch.Size] = []
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise DispatchError(
                f"dispatch_batches=True can only dispatch tensors, but {_describe_path(skeleton, k)} is a "
                f"{type(leaf).__name__}; make the collate_fn return tensors only, or pass dispatch_batches=False"
            )
        if leaf.dim() == 0:
            raise DispatchError(
                f"dispatch_batches=True splits tensors along dim 0, but {_describe_path(skeleton, k)} is a scalar; "
                "give it a batch dimension, or pass dispatch_batches=False"
            )
        shapes.append(leaf.shape)
    if len({s[0] for s in shapes}) > 1:
        raise DispatchError(
            f"dispatch_batches=True needs every tensor of a batch to have the same number of rows, got "
            f"{[s[0] for s in shapes]}; pass dispatch_batches=False"
        )
    if reference is not None:
        ref_skeleton, ref_shapes = reference
        if ref_skeleton != skeleton or [s[1:] for s in ref_shapes] != [s[1:] for s in shapes]:
            raise DispatchError(
                "dispatch_batches=True concatenates batches, but they differ in structure or in shape beyond "
                f"dim 0 ({[tuple(s) for s in ref_shapes]} vs {[tuple(s) for s in shapes]}); {_FIX}"
            )
    return skeleton, shapes


class DataLoaderDispatcher(DataLoaderShard):
    """Process 0 reads every batch; each process receives only its own rows (scatter).

    Per step process 0 takes one batch (``split_batches=True``) or ``N`` consecutive batches
    concatenated along dim 0, and process ``i`` receives rows ``[i*k, (i+1)*k)``.  A final
    step whose rows do not divide by ``N`` is completed with rows of the first step.  Batches
    must be (nested) tensors with the same shape beyond dim 0; anything else is a
    :class:`DispatchError` raised on every process, never a hang.

    Example (2 processes)::

        loader = DataLoaderDispatcher(dataset, batch_size=8, split_batches=True)
        for batch in loader:  # 4 rows here, 4 on the other process
            ...
    """

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        slice_fn: Optional[SliceFn] = None,
        torch_device_mesh: Any = None,
        device: Union[str, torch.device, None] = None,
        rng_types: Optional[Iterable[str]] = None,
        synchronized_generator: Optional[torch.Generator] = None,
        non_blocking: bool = False,
        num_processes: Optional[int] = None,
        process_index: Optional[int] = None,
        **dataloader_kwargs: Any,
    ) -> None:
        super().__init__(
            dataset,
            device=device,
            rng_types=rng_types,
            synchronized_generator=synchronized_generator,
            skip_batches=skip_batches,
            non_blocking=non_blocking,
            **dataloader_kwargs,
        )
        self._setup_dispatch(split_batches, slice_fn, torch_device_mesh, num_processes, process_index)

    def _setup_dispatch(
        self,
        split_batches: bool,
        slice_fn: Optional[SliceFn],
        torch_device_mesh: Any,
        num_processes: Optional[int],
        process_index: Optional[int],
    ) -> None:
        self.split_batches = split_batches
        self.slice_fn: SliceFn = slice_fn or slice_rows
        self.num_processes, self.process_index = resolve_data_topology(num_processes, process_index, torch_device_mesh)
        if self.num_processes != world_size():
            raise ValueError(
                f"DataLoaderDispatcher needs one process per data shard: num_processes={self.num_processes} but "
                f"the process group has {world_size()} processes; use DataLoaderShard for other layouts"
            )
        base = self.batch_size
        if split_batches and base is not None and base % self.num_processes != 0:
            raise ValueError(
                f"split_batches=True needs a batch size that is a multiple of num_processes, got batch_size={base} "
                f"and num_processes={self.num_processes}; change the batch size or pass split_batches=False"
            )

    @property
    def _batches_per_step(self) -> int:
        return 1 if self.split_batches else self.num_processes

    def _full_length(self) -> int:
        underlying = super()._full_length()
        if self.split_batches:
            return underlying
        if self.drop_last:
            return underlying // self.num_processes
        return -(-underlying // self.num_processes)

    @property
    def total_batch_size(self) -> Optional[int]:
        if self.batch_size is None:
            return None
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    def _inner_batches(self, skip: int) -> Iterator[Any]:
        return self._receive(skip)

    # -- process 0 --------------------------------------------------------------------------
    def _read_steps(self, skip: int) -> Iterator[Any]:
        """Process 0: the concatenated global batch of each step."""
        batches = super()._inner_batches(skip * self._batches_per_step)
        first: Optional[Any] = None
        reference = None
        while True:
            group = []
            for batch in batches:
                group.append(batch)
                if len(group) == self._batches_per_step:
                    break
            if not group:
                return
            if self.drop_last and len(group) < self._batches_per_step:
                return
            for batch in group:
                checked = _check_batch(batch, reference)
                reference = reference or checked
            step = group[0] if len(group) == 1 else concatenate_rows(group)
            if first is None:
                first = step
            yield self._pad_rows(step, first)

    def _pad_rows(self, step: Any, first: Any) -> Any:
        leaves, _ = _flatten(step)
        rows = leaves[0].shape[0]
        missing = -rows % self.num_processes
        if missing == 0:
            return step
        source_rows = _flatten(first)[0][0].shape[0]
        picks = torch.arange(missing) % source_rows
        padding = slice_rows_index(first, picks)
        return concatenate_rows([step, padding])

    # -- every process ----------------------------------------------------------------------
    def _receive(self, skip: int) -> Iterator[Any]:
        steps: Optional[Iterator[Any]] = self._read_steps(skip) if global_rank() == 0 else None
        while True:
            header: Any = None
            parts: Optional[list[Any]] = None
            if steps is not None:
                try:
                    step = next(steps, None)
                    if step is None:
                        header = ("end",)
                    else:
                        parts = self._cut(step)
                        leaves, skeleton = _flatten(parts[0])
                        header = ("batch", skeleton, [(leaf.dtype, tuple(leaf.shape)) for leaf in leaves])
                except Exception as exc:  # reach every process instead of leaving them waiting
                    header = ("error", f"{type(exc).__name__}: {exc}")
                    error = exc
            header = broadcast_object(header)
            if header[0] == "end":
                return
            if header[0] == "error":
                if steps is not None:
                    raise error
                raise DispatchError(f"process 0 failed to dispatch a batch: {header[1]}")
            yield self._scatter(header, parts)

    def _cut(self, step: Any) -> list[Any]:
        rows = _flatten(step)[0][0].shape[0]
        k = rows // self.num_processes
        parts = [self.slice_fn(step, slice(j * k, (j + 1) * k), j, self.num_processes) for j in range(self.num_processes)]
        first_leaves, first_skeleton = _flatten(parts[0])
        for part in parts[1:]:
            leaves, skeleton = _flatten(part)
            if skeleton != first_skeleton or [l.shape for l in leaves] != [l.shape for l in first_leaves]:
                raise DispatchError("slice_fn_for_dispatch returned parts of different structure or shape for different processes")
        return parts

    def _scatter(self, header: Any, parts: Optional[list[Any]]) -> Any:
        _, skeleton, specs = header
        comm_device = _communication_device()
        received = []
        part_leaves = [_flatten(p)[0] for p in parts] if parts is not None else None
        for k, (dtype, shape) in enumerate(specs):
            out = torch.empty(shape, dtype=dtype, device=comm_device)
            sources = [leaves[k].contiguous().to(comm_device) for leaves in part_leaves] if part_leaves else None
            if world_size() == 1:
                out = sources[0]  # type: ignore[index]
            else:
                dist.scatter(out, sources, src=0)
            received.append(out)
        return _unflatten(iter(received), skeleton)


def slice_rows_index(data: Any, index: torch.Tensor) -> Any:
    leaves, skeleton = _flatten(data)
    return _unflatten(iter([leaf[index] for leaf in leaves]), skeleton)


def _communication_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
