"""Evaluation helpers: per-sample results without the wrap-around padding."""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from shardplug.core._internal.collectives import waiting_for
from shardplug.core._internal.rows import iter_leaves, map_leaves
from shardplug.core._internal.topology import distributed_is_active
from shardplug.core.padding.tracking import leading_rows

__all__ = ["drop_padding", "gather_for_metrics", "MarksPadding"]


class MarksPadding(Protocol):
    """A loader that tells how many leading samples of the batch being processed are real (a prepared
    loader after ``track_padding()``; ``None`` before)."""

    @property
    def batch_real_count(self) -> int | None: ...


def _tensors_only(data: Any) -> Any:
    """``data`` when every leaf is a tensor (per-sample results), else ``TypeError``."""
    for leaf in iter_leaves(data):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"expected tensors (possibly in dicts, lists or tuples), got {type(leaf).__name__}")
    return data


def _real_count(loader: MarksPadding) -> int:
    real = getattr(loader, "batch_real_count", None)
    if real is None:
        raise ValueError(
            "the loader does not know which samples of this batch are padding: call loader.track_padding() "
            "(or loader.enable_audit()) before iterating it"
        )
    return cast("int", real)


def drop_padding(data: Any, loader: MarksPadding) -> Any:
    """The rows of ``data`` (per-sample results of the current batch) that are real samples.

    The padding rows come last: this keeps the leading ``loader.batch_real_count`` rows
    (:func:`~shardplug.core.padding.tracking.leading_rows`, the one cut every front end makes).
    """
    real = _real_count(loader)
    return leading_rows(_tensors_only(data), real)


GATHER = "every process's rows of this batch (gather_for_metrics: call it on every process for every batch)"
"""What :func:`gather_for_metrics` waits for."""


def _gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    world = dist.get_world_size()
    rows = torch.tensor([tensor.shape[0]], dtype=torch.int64)
    sizes = [torch.zeros_like(rows) for _ in range(world)]
    with waiting_for(GATHER):
        dist.all_gather(sizes, rows)
    most = int(max(s.item() for s in sizes))
    padded = torch.zeros((most, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    with waiting_for(GATHER):
        dist.all_gather(parts, padded)
    return torch.cat([part[: int(size.item())] for part, size in zip(parts, sizes)])


def gather_for_metrics(data: Any, loader: MarksPadding) -> Any:
    """Per-sample results of the current batch from every process, padding dropped, in rank order.

    A collective: call it on every process for every batch.  Example::

        loader.track_padding()
        for x, y in loader:
            preds, labels = gather_for_metrics((model(x).argmax(1), y), loader)
            metric.update(preds, labels)   # every sample of the dataset exactly once
    """
    local = drop_padding(data, loader)
    if not distributed_is_active() or dist.get_world_size() == 1:
        return local
    return map_leaves(local, _gather_rows)
