"""Evaluation over prepared loaders: every sample counted once, padding dropped before the metrics.

Example::

    evaluator = Engine(evaluation_step(model))
    Accuracy().attach(evaluator, "accuracy", usage=RealSamplesOnly())
    evaluator.run(handler.prepare_eval_loader(DataLoader(val_set, batch_size=64)))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from ignite.engine import Engine, Events
from ignite.metrics.metric import MetricUsage

from shardplug.core.front_ends import iter_leaves
from shardplug.core.padding.tracking import leading_rows

from .compat import ignite_prepare_batch

__all__ = ["RealSamplesOnly", "drop_padding_if_tracked", "evaluation_step", "real_count"]


def _identity(value: Any) -> Any:
    return value


def _call_model(model: torch.nn.Module, x: Any) -> Any:
    return model(x)


def _prediction_and_target(x: Any, y: Any, y_pred: Any) -> tuple[Any, Any]:
    return y_pred, y


def real_count(loader: object) -> int | None:
    """The real count of the batch ``loader`` handed out last: how many of its leading rows are real samples.

    ``None`` means "unknown: all of them" (a loader that does not track padding: an iterable or
    a training loader). The evaluation loaders of :meth:`ShardplugHandler.prepare_eval_loader`
    track it (``loader.track_padding()``); the padding rows come last in every batch, so cutting
    to the real count keeps each sample exactly once across processes.

    Example::

        rows = real_count(engine.state.dataloader)   # inside an evaluation step
        y_pred, y = y_pred[:rows], y[:rows]
    """
    return getattr(loader, "batch_real_count", None)


def drop_padding_if_tracked(data: Any, loader: object) -> Any:
    """``data`` (a batch, or per-sample results of it) cut to the real count of ``loader``'s latest
    batch when ``loader`` tracks padding; else ``data`` as it is.

    The cut is :func:`shardplug.drop_padding`'s (the batch's leading real rows); unlike it, a loader
    that does not track padding (a training loader, a plain ``DataLoader``) is no error, so an
    evaluation step can call it on whatever loader the engine runs.

    Example::

        y_pred, y = drop_padding_if_tracked((y_pred, y), engine.state.dataloader)
    """
    return leading_rows(data, real_count(loader))


def _first_tensor(data: Any) -> torch.Tensor | None:
    return next((leaf for leaf in iter_leaves(data) if isinstance(leaf, torch.Tensor)), None)


def _output_has_samples(engine: Engine, _event_count: int) -> bool:
    tensor = _first_tensor(engine.state.output)
    return tensor is None or tensor.dim() == 0 or tensor.shape[0] > 0


class RealSamplesOnly(MetricUsage):
    """Epoch-wise metric usage that skips iterations whose output (padding dropped) holds no sample.

    A process whose last evaluation batch is pure padding gets an empty output from the
    handler's evaluation step; metrics attached with this usage do not see it (``Loss`` would
    turn an empty batch into NaN).

    Example::

        Accuracy().attach(evaluator, "accuracy", usage=RealSamplesOnly())
    """

    usage_name: str = "real_samples_only"

    def __init__(self) -> None:
        super().__init__(
            started=Events.EPOCH_STARTED,
            completed=Events.EPOCH_COMPLETED,
            iteration_completed=Events.ITERATION_COMPLETED(event_filter=_output_has_samples),
        )


def evaluation_step(
    model: torch.nn.Module,
    *,
    device: str | torch.device | None = None,
    non_blocking: bool = False,
    prepare_batch: Callable[..., tuple[Any, Any]] = ignite_prepare_batch,
    model_transform: Callable[[Any], Any] = _identity,
    output_transform: Callable[[Any, Any, Any], Any] = _prediction_and_target,
    model_fn: Callable[[torch.nn.Module, Any], Any] = _call_model,
    autocast: Callable[[], Any] | None = None,
) -> Callable[[Engine, Any], Any]:
    """The process function of an evaluator over a prepared evaluation loader.

    ``x``, ``y`` and ``y_pred`` are cut to the real count (:func:`drop_padding_if_tracked`) before
    ``output_transform(x, y, y_pred)`` (default ``(y_pred, y)``), so metrics count each sample
    once across ranks. A batch of pure padding gives empty tensors: attach metrics with
    :class:`RealSamplesOnly`. ``autocast``: a context factory for the forward pass (or ``None``).
    """

    def evaluate(engine: Engine, batch: Any) -> Any:
        model.eval()
        with torch.no_grad():
            x, y = prepare_batch(batch, device=device, non_blocking=non_blocking)
            if autocast is None:
                y_pred = model_transform(model_fn(model, x))
            else:
                with autocast():
                    y_pred = model_transform(model_fn(model, x))
            x, y, y_pred = drop_padding_if_tracked((x, y, y_pred), engine.state.dataloader)
            return output_transform(x, y, y_pred)

    return evaluate
