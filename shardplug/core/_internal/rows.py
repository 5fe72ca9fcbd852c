"""Batches as rows: nested dicts / lists / tuples of tensors and plain values, cut and joined along dim 0.

This is the one walker over nested batches: :func:`map_leaves` (a batch of the same shape with each
leaf mapped: moved to a device, cloned, cut), :func:`iter_leaves` and :func:`first_leaf`, and
:func:`flatten` / :func:`unflatten` (leaves and a skeleton, for the rows below). Containers are
dicts and other mappings (rebuilt as their type, or as a ``dict`` when the type cannot be built
from one), named tuples (their type), lists and tuples (their type); everything else is a leaf.

A batch is flattened into *leaves*: tensors, lists or tuples of plain values (``["a", "b"]``, a
list of ids), and other values. Its **rows** are the first dimension of its first tensor of at
least one dimension (else the length of its first list of plain values). A tensor's rows are
its dim 0; a list of plain values of that length has one value per row; every other leaf (a
string, a number, a 0-dim tensor, a list of another length) belongs to the whole batch and is
kept as it is in every part. A list (or tuple) of tensors of different lengths -- one sequence per
sample, as a collate that does not pad returns -- is *ragged rows*: one
leaf with one tensor per row, cut, joined and sent row by row; a list of tensors of one length
(``default_collate``'s ``[inputs, labels]``) is a container of leaves, unless the batches it is
dispatched with tell otherwise (:func:`mark_ragged_rows` makes such lists :class:`RaggedRows`).

Example::

    >>> batch = {"x": torch.arange(4).view(4, 1), "text": ["a", "b", "c", "d"], "source": "web"}
    >>> part = slice_rows(batch, slice(2, 4))
    >>> part["x"].flatten().tolist(), part["text"], part["source"]
    ([2, 3], ['c', 'd'], 'web')
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "map_leaves",
    "iter_leaves",
    "first_leaf",
    "flatten",
    "unflatten",
    "batch_rows",
    "slice_rows",
    "take_rows",
    "concatenate_rows",
    "describe_path",
    "leaf_spec",
    "mark_ragged_rows",
    "RaggedRows",
    "OBJECT",
]

OBJECT = "object"
"""The spec of a leaf that is not a tensor of at least one dimension (sent pickled)."""


def _is_plain(value: Any) -> bool:
    return not isinstance(value, (torch.Tensor, Mapping, list, tuple))


class RaggedRows(list):  # type: ignore[type-arg]
    """A list of tensors that holds one tensor per row (sequences of their own lengths): one leaf of a
    batch, cut, joined and sent row by row (a slice is ragged rows too).

    Example::

        >>> rows = RaggedRows([torch.zeros(2), torch.zeros(2), torch.zeros(1)])
        >>> type(rows[1:]).__name__, flatten({"tokens": rows})[0] == [rows]
        ('RaggedRows', True)
    """

    def __getitem__(self, index: Any) -> Any:
        got = super().__getitem__(index)
        return RaggedRows(got) if isinstance(index, slice) else got


def _tensor_list(value: Any) -> bool:
    """A list or tuple (not a named tuple) of tensors of at least one dimension."""
    return (
        isinstance(value, (list, tuple))
        and not _is_namedtuple(value)
        and len(value) > 0
        and all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in value)
    )


def _is_ragged_rows(value: Any) -> bool:
    """Whether ``value`` is :class:`RaggedRows`, or a list or tuple of tensors of different lengths (dim 0).

    Example::

        >>> _is_ragged_rows([torch.zeros(5), torch.zeros(3)]), _is_ragged_rows([torch.zeros(4, 2), torch.zeros(4)])
        (True, False)
    """
    if isinstance(value, RaggedRows):
        return True
    return _tensor_list(value) and len({int(v.shape[0]) for v in value}) > 1


def mark_ragged_rows(batches: list[Any]) -> list[Any]:
    """The batches of one step with every list of tensors that holds one tensor per row made
    :class:`RaggedRows`, at the same places in all of them: a list of tensors of different lengths,
    or one as long as the rows of the batch's other tensors whose tensors are not that long (sequences
    of one length by chance, beside their ids). A list of tensors as long as one another and the
    batch (``default_collate``'s ``[inputs, labels]``) stays a container.

    Example::

        >>> a = {"tokens": [torch.zeros(3), torch.zeros(1)], "ids": torch.arange(2)}
        >>> b = {"tokens": [torch.zeros(3), torch.zeros(3)], "ids": torch.arange(2)}
        >>> [type(batch["tokens"]).__name__ for batch in mark_ragged_rows([a, b])]
        ['RaggedRows', 'RaggedRows']
    """
    paths: set[tuple[Any, ...]] = set()
    for batch in batches:
        _ragged_paths(batch, _rows_beside_lists(batch), (), paths)
    if not paths:
        return batches
    return [_wrapped(batch, paths, ()) for batch in batches]


def _rows_beside_lists(data: Any) -> int | None:
    """The rows of the first tensor of ``data`` that is not in a list of tensors."""
    if isinstance(data, torch.Tensor):
        return int(data.shape[0]) if data.dim() > 0 else None
    if _tensor_list(data) or not isinstance(data, (Mapping, list, tuple)):
        return None
    for value in data.values() if isinstance(data, Mapping) else data:
        rows = _rows_beside_lists(value)
        if rows is not None:
            return rows
    return None


def _ragged_paths(data: Any, rows: int | None, path: tuple[Any, ...], found: set[tuple[Any, ...]]) -> None:
    """Add to ``found`` the places in ``data`` of lists of tensors holding one tensor per row."""
    if _tensor_list(data):
        lengths = {int(v.shape[0]) for v in data}
        if _is_ragged_rows(data) or (rows is not None and len(data) == rows and lengths != {rows}):
            found.add(path)
        return
    if isinstance(data, Mapping):
        for key, value in data.items():
            _ragged_paths(value, rows, path + (key,), found)
    elif isinstance(data, (list, tuple)):
        for position, value in enumerate(data):
            _ragged_paths(value, rows, path + (position,), found)


def _wrapped(data: Any, paths: set[tuple[Any, ...]], path: tuple[Any, ...]) -> Any:
    """``data`` with the lists of tensors at ``paths`` made :class:`RaggedRows`."""
    if path in paths and _tensor_list(data):
        return data if isinstance(data, RaggedRows) else RaggedRows(data)
    if isinstance(data, Mapping):
        built = {key: _wrapped(value, paths, path + (key,)) for key, value in data.items()}
        return _rebuilt_mapping(type(data), built)
    if _is_namedtuple(data):
        return type(data)(*(_wrapped(value, paths, path + (k,)) for k, value in enumerate(data)))
    if isinstance(data, (list, tuple)):
        return type(data)([_wrapped(value, paths, path + (k,)) for k, value in enumerate(data)])
    return data


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _rebuilt_mapping(cls: type, built: dict[Any, Any]) -> Any:
    """``built`` as a mapping of type ``cls`` (a ``dict`` when ``cls`` cannot be built from one)."""
    try:
        return cls(built)
    except TypeError:
        return built


def map_leaves(data: Any, fn: Callable[[Any], Any], skip_keys: Collection[Any] = ()) -> Any:
    """``data`` with every leaf replaced by ``fn(leaf)``; containers are rebuilt with their type.

    Every list, tuple, named tuple and mapping is walked (and copied), also one of plain values;
    ``skip_keys``: mapping keys (at any depth) whose values are kept as they are.

    Example::

        >>> map_leaves({"x": (1, 2), "id": "a"}, lambda leaf: leaf * 2, skip_keys={"id"})
        {'x': (2, 4), 'id': 'a'}
    """
    if _is_namedtuple(data):
        return type(data)(*(map_leaves(v, fn, skip_keys) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)([map_leaves(v, fn, skip_keys) for v in data])
    if isinstance(data, Mapping):
        built = {k: (v if k in skip_keys else map_leaves(v, fn, skip_keys)) for k, v in data.items()}
        return _rebuilt_mapping(type(data), built)
    return fn(data)


def iter_leaves(data: Any) -> Iterator[Any]:
    """The leaves of ``data`` in order, depth first (a mapping's values, a sequence's elements).

    Example::

        >>> list(iter_leaves({"a": [1, (2, 3)], "b": "text"}))
        [1, 2, 3, 'text']
    """
    if isinstance(data, (Mapping, list, tuple)):
        for value in data.values() if isinstance(data, Mapping) else data:
            yield from iter_leaves(value)
    else:
        yield data


def first_leaf(data: Any) -> Any:
    """The leading leaf of ``data``: the first value of each container down to one that is not a
    container; a list or tuple whose first element is a plain value (``["a", "b"]``) is a leaf, and
    so is an empty container.

    Example::

        >>> first_leaf({"text": ["a", "b"], "x": torch.zeros(2)}), first_leaf([[], 1])
        (['a', 'b'], [])
    """
    while isinstance(data, (Mapping, list, tuple)) and len(data):
        head = next(iter(data.values())) if isinstance(data, Mapping) else data[0]
        if not isinstance(data, Mapping) and _is_plain(head):
            return data
        data = head
    return data


def flatten(data: Any) -> tuple[list[Any], Any]:
    """Leaves of a nested dict / list / tuple / namedtuple, and a picklable skeleton to rebuild it.

    A non-empty list or tuple of plain values (no tensor, no container) is one leaf, and so is a
    list or tuple of tensors of different lengths, or :class:`RaggedRows` (one tensor per row).
    """
    if _is_ragged_rows(data):
        return [data], None
    if isinstance(data, Mapping):
        keys = list(data.keys())
        parts = [flatten(data[k]) for k in keys]
        return [leaf for p in parts for leaf in p[0]], ("map", type(data), keys, [p[1] for p in parts])
    if _is_namedtuple(data):
        parts = [flatten(v) for v in data]
        return [leaf for p in parts for leaf in p[0]], ("namedtuple", type(data), None, [p[1] for p in parts])
    if isinstance(data, (list, tuple)) and not (data and all(_is_plain(v) for v in data)):
        parts = [flatten(v) for v in data]
        return [leaf for p in parts for leaf in p[0]], ("seq", type(data), None, [p[1] for p in parts])
    return [data], None


def unflatten(leaves: Iterator[Any], skeleton: Any) -> Any:
    """The nested batch of :func:`flatten`'s ``skeleton`` with ``leaves`` in order."""
    if skeleton is None:
        return next(leaves)
    kind, cls, keys, children = skeleton
    values = [unflatten(leaves, child) for child in children]
    if kind == "map":
        return _rebuilt_mapping(cls, dict(zip(keys, values)))
    if kind == "namedtuple":
        return cls(*values)
    return cls(values)


def describe_path(skeleton: Any, index: int) -> str:
    """Where leaf ``index`` sits in the batch, e.g. ``['input_ids']`` or ``[1]``."""
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


def _is_rows_tensor(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0


def batch_rows(leaves: list[Any]) -> int | None:
    """The rows of a flattened batch (``None``: nothing in it has rows)."""
    for leaf in leaves:
        if _is_rows_tensor(leaf):
            return int(leaf.shape[0])
    for leaf in leaves:
        if isinstance(leaf, (list, tuple)):
            return len(leaf)
    return None


def _per_row(leaf: Any, rows: int | None) -> bool:
    """Whether ``leaf`` has one entry per row (it is cut with the rows) or belongs to the batch."""
    if _is_rows_tensor(leaf):
        return True
    return isinstance(leaf, (list, tuple)) and rows is not None and len(leaf) == rows


def leaf_spec(leaf: Any) -> tuple[Any, Any]:
    """``(dtype, shape)`` of a tensor of at least one dimension, else ``(OBJECT, None)``."""
    if _is_rows_tensor(leaf):
        return leaf.dtype, tuple(leaf.shape)
    return OBJECT, None


def slice_rows(data: Any, rows: slice, process_index: int = 0, num_processes: int = 1) -> Any:
    """Rows ``rows`` of ``data`` (the default ``slice_fn`` of dispatching loaders)."""
    leaves, skeleton = flatten(data)
    n = batch_rows(leaves)
    return unflatten(iter([leaf[rows] if _per_row(leaf, n) else leaf for leaf in leaves]), skeleton)


def take_rows(data: Any, index: torch.Tensor) -> Any:
    """The rows at ``index`` (a 1-d integer tensor) of ``data``."""
    leaves, skeleton = flatten(data)
    n = batch_rows(leaves)
    picks = index.tolist()
    taken = []
    for leaf in leaves:
        if _is_rows_tensor(leaf):
            taken.append(leaf[index])
        elif _per_row(leaf, n):
            taken.append(type(leaf)(leaf[i] for i in picks))
        else:
            taken.append(leaf)
    return unflatten(iter(taken), skeleton)


def concatenate_rows(batches: list[Any]) -> Any:
    """Same-structured nested batches joined along their rows (values of the whole batch: the first's)."""
    flat = [flatten(b) for b in batches]
    skeleton = flat[0][1]
    counts = [batch_rows(leaves) for leaves, _ in flat]
    joined = []
    for column in zip(*(leaves for leaves, _ in flat)):
        if all(_is_rows_tensor(leaf) for leaf in column):
            joined.append(torch.cat(column, dim=0))
        elif all(_per_row(leaf, n) for leaf, n in zip(column, counts)):
            joined.append(type(column[0])(value for leaf in column for value in leaf))
        else:
            joined.append(column[0])
    return unflatten(iter(joined), skeleton)
