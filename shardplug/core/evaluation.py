"""Evaluation loaders: the one rule every front end follows (``TrainingRun``, Lightning, Fabric, Ignite).

**Every process takes part in every evaluation step that any process takes part in, and every
sample counts once.** An evaluation loader therefore

* gives every process the same number of batches (``even_batches=True``, whatever the training
  options say): a process never runs out of batches while another still evaluates, so a collective
  in the step (``self.log(..., sync_dist=True)``, a metric's sync, SyncBatchNorm, an all-gather)
  never hangs, and no process has an empty loader (an evaluation set smaller than one global
  batch, or 8 processes and 4 batches, still gives each process one batch);
* marks the padding that evens out the last step (``loader.batch_real_count``: the leading rows
  are real, the rest padding) and, with ``drop_padding=True``, cuts it off before the batch leaves
  the loader: a process whose last step holds no real sample then gets a batch of 0 rows;
* never dispatches and is not tied to a gradient state.

``drop_padding``/``gather_for_metrics`` (:mod:`shardplug.core.padding.metrics`) drop the marked padding
of per-sample results; a loader that already dropped it is left as it is.

Example::

    >>> from torch.utils.data import DataLoader
    >>> parts = [prepare_eval_loader(DataLoader(list(range(3)), batch_size=4), drop_padding=True,
    ...                              num_processes=2, process_index=i) for i in range(2)]
    >>> [[b.tolist() for b in part] for part in parts]
    [[[0, 1, 2]], [[]]]
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from shardplug.core.planner import prepare_data_loader
from shardplug.core.sharding.shard_plan import plan_traits

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from shardplug.core.loader.prepared import PreparedDataLoader

__all__ = ["prepare_eval_loader"]

logger = logging.getLogger(__name__)


def prepare_eval_loader(
    dataloader: DataLoader[Any], *, drop_padding: bool = False, **kwargs: Any
) -> PreparedDataLoader:
    """This process's evaluation loader (see the module's rule).

    Args:
        dataloader: the evaluation ``DataLoader``.
        drop_padding: hand out only the real rows of each batch (a pure-padding step is a batch of
            0 rows); ``False``: batches keep their padding rows, marked in ``loader.batch_real_count``.
        **kwargs: ``prepare_data_loader`` arguments (``config=`` included); ``dispatch_batches`` and
            ``even_batches`` are decided here (``even_batches=False`` is refused: it would let processes run different
            numbers of evaluation steps).
    """
    if not isinstance(drop_padding, bool):
        raise TypeError(f"drop_padding={drop_padding!r} is invalid: it must be True or False")
    if kwargs.get("even_batches") is False:
        raise ValueError(
            "even_batches=False is invalid for an evaluation loader: processes would run different numbers of "
            "evaluation steps (a process with fewer, or none, leaves the others waiting in a collective). Leave "
            "even_batches out: every process gets the same number of batches, the padding is marked "
            "(loader.batch_real_count) and dropped by drop_padding=True or shardplug.gather_for_metrics"
        )
    config = kwargs.pop("config", None)
    if config is not None:  # the decided options replace the config's; their keywords say nothing more
        for name in ("even_batches", "dispatch_batches", "slice_fn_for_dispatch"):
            kwargs.pop(name, None)
        kwargs["config"] = config.replace(even_batches=True, dispatch_batches=False, slice_fn_for_dispatch=None)
    else:
        kwargs.update(even_batches=True, dispatch_batches=False)
    loader = prepare_data_loader(dataloader, **kwargs)
    reason = plan_traits(loader.plan).untracked_reason
    if reason is not None:
        if loader.plan.layout.num_processes > 1:
            logger.warning("evaluation loader: its padding cannot be told apart (%s)", reason)
        return loader
    if drop_padding:
        loader.drop_padding_rows()
    else:
        loader.track_padding()
    return loader
