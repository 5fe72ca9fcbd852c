"""Every private name of Lightning (and torch) that shardplug_lightning reads or writes, and its accessors.

No public Lightning API turns the ``DistributedSampler`` injection off for one strategy, puts a
shard inside the predict loop's index-recording batch sampler, applies a loader state after the
loaders were built, or sets the length of a resumed epoch. The strategy reaches those names only
through the functions below: each checks that the name exists and raises a ``RuntimeError``
naming it when a Lightning release lacks it, and ``integrations/lightning/tests/test_lightning_compat.py``
fails on such a release. The same names exist in ``lightning.pytorch`` and ``pytorch_lightning``.

* :data:`PRIVATES`: each name (dotted from the ``lightning.pytorch`` root), with its use;
* :data:`CHECKED_AGAINST`: the library versions the list was checked against.

Example::

    >>> from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
    >>> from torch.utils.data import BatchSampler
    >>> inner = BatchSampler(range(4), 2, False)
    >>> wrapped_batch_sampler(_IndexBatchSamplerWrapper(inner)) is inner
    True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, cast

from shardplug.core import front_ends

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = [
    "PRIVATES",
    "CHECKED_AGAINST",
    "turn_off_distributed_sampler",
    "user_distributed_sampler",
    "index_batch_sampler_wrapper",
    "wrapped_batch_sampler",
    "set_wrapped_batch_sampler",
    "inner_batch_sampler",
    "apply_late_loader_states",
    "combined_loader",
    "batch_progress",
    "set_epoch_length",
    "forget_iterator",
    "open_the_next_epoch",
    "repair_epoch_progress",
    "finish_the_epoch",
]

CHECKED_AGAINST: dict[str, str] = {"lightning": "2.6.6", "torch": front_ends.CHECKED_AGAINST["torch"]}
"""The versions of the libraries whose private names :data:`PRIVATES` lists, as last checked."""

_LOOPS = "lightning.pytorch.loops"
PRIVATES: dict[str, str] = {
    "lightning.pytorch.trainer.Trainer._accelerator_connector": "the Trainer's accelerator connector, which holds "
    "the DistributedSampler switch",
    "lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector.use_distributed_sampler": (
        "the user's Trainer(use_distributed_sampler=...), read (False: the loaders are used as they are), then "
        "turned off so that Lightning never injects a DistributedSampler (shardplug shards every loader)"
    ),
    "lightning.pytorch.overrides.distributed._IndexBatchSamplerWrapper": "the predict loop's index-recording batch "
    "sampler: the shard goes inside it, so that batch_indices are right",
    "lightning.pytorch.overrides.distributed._IndexBatchSamplerWrapper._batch_sampler": "the batch sampler inside "
    "it: read (and a loader's DistributedSampler looked for there), then replaced by the shard",
    f"{_LOOPS}.fit_loop._FitLoop._combined_loader": "the training CombinedLoader (its state loading, its limits)",
    f"{_LOOPS}.fit_loop._FitLoop._combined_loader_states_to_load": "the loader states of a checkpoint that "
    "Lightning never applies when estimated_stepping_batches built the loaders first (Lightning issue #20550)",
    "lightning.pytorch.utilities.combined_loader.CombinedLoader._load_state_dicts": "applies those states late",
    f"{_LOOPS}.fit_loop._FitLoop.epoch_loop": "the training epoch loop (an internal loop object)",
    f"{_LOOPS}.training_epoch_loop._TrainingEpochLoop.batch_progress": "its batch counters (current / total: ready, "
    "started, processed, completed), shifted to the loader's view after a resume on another layout",
    f"{_LOOPS}.fit_loop._FitLoop.max_batches": "the length of the running epoch, set back to the loader's after a "
    "resume (Lightning takes it from the resumed pass)",
    f"{_LOOPS}.fit_loop._FitLoop._data_fetcher": "the training data fetcher",
    f"{_LOOPS}.fetchers._DataFetcher.length": "its count of the epoch's batches, set with max_batches",
    "lightning.pytorch.trainer.Trainer._val_check_time_interval": "a time-based validation interval (then "
    "val_check_batch is not derived from the epoch's length)",
    "lightning.pytorch.trainer.Trainer.val_check_batch": "the batch of the epoch after which validation runs, "
    "derived again from the epoch's length set after a resume",
    f"{_LOOPS}.fit_loop._FitLoop.epoch_progress": "its epoch counters, counted on after a resume where Lightning "
    "leaves them as no uninterrupted run has them",
    f"{_LOOPS}.fit_loop._FitLoop.restarted_mid_epoch": "its restart stage after a resume inside an epoch",
    f"{_LOOPS}.fit_loop._FitLoop.reset_restart_stage": "clears it, so that the next epoch opens as in a run",
    f"{_LOOPS}.training_epoch_loop._TrainingEpochLoop.restarted_on_train_batch_end": "whether the checkpoint was "
    "saved in on_train_batch_end (then Lightning finishes an epoch whose last batch it saw)",
    f"{_LOOPS}.fit_loop._FitLoop.state_dict": "the fit loop's part of a checkpoint (checkpoint['loops']['fit_loop']: "
    "'epoch_progress', 'epoch_loop.batch_progress', 'state_dict' / 'combined_loader'), repaired when loaded",
    "torch.utils.data.DataLoader._iterator": "dropped on the shallow copy of a predict loader made for "
    "prepare_data_loader (see shardplug.core._internal.compat)",
}
"""Every private name above, with its use (``integrations/lightning/tests/test_lightning_compat.py`` guards each)."""


def _required(obj: Any, name: str, what: str) -> Any:
    """Read a private Lightning attribute, or fail loudly if this Lightning version lacks it."""
    if not hasattr(obj, name):
        raise RuntimeError(
            f"shardplug_lightning relies on Lightning's private attribute {type(obj).__name__}.{name} ({what}), "
            "which this Lightning version does not have; please report this with your Lightning version"
        )
    return getattr(obj, name)


_USER_CHOICE = "_shardplug_use_distributed_sampler"  # shardplug's own note on the connector (not Lightning's)


def turn_off_distributed_sampler(trainer: Any) -> bool:
    """Keep ``trainer`` from injecting a ``DistributedSampler`` into any loader; return what the user
    passed as ``Trainer(use_distributed_sampler=...)`` (noted on the connector the first time, so
    later calls, after the switch is off, return it too)."""
    connector = _required(trainer, "_accelerator_connector", "the Trainer's accelerator connector")
    user = bool(_required(connector, "use_distributed_sampler", "switch for Lightning's DistributedSampler injection"))
    user = connector.__dict__.setdefault(_USER_CHOICE, user)
    connector.use_distributed_sampler = False
    return cast(bool, user)


def user_distributed_sampler(trainer: Any) -> bool:
    """The user's ``Trainer(use_distributed_sampler=...)``, also after :func:`turn_off_distributed_sampler`
    (``False``: the user's loaders shard themselves and are used as they are)."""
    connector = _required(trainer, "_accelerator_connector", "the Trainer's accelerator connector")
    noted = connector.__dict__.get(_USER_CHOICE)
    if noted is None:
        noted = _required(connector, "use_distributed_sampler", "switch for Lightning's DistributedSampler injection")
    return bool(noted)


def index_batch_sampler_wrapper(namespace: str) -> type:
    """The predict loop's index-recording batch sampler class of ``namespace`` (``lightning.pytorch`` /
    ``pytorch_lightning``)."""
    module = importlib.import_module(f"{namespace}.overrides.distributed")
    return cast(
        "type", _required(module, "_IndexBatchSamplerWrapper", "the predict loop's index-recording batch sampler")
    )


def wrapped_batch_sampler(wrapper: Any) -> Any:
    """The batch sampler inside Lightning's predict index wrapper."""
    return _required(wrapper, "_batch_sampler", "the batch sampler inside Lightning's predict index wrapper")


def set_wrapped_batch_sampler(wrapper: Any, batch_sampler: Any) -> None:
    """Put ``batch_sampler`` inside Lightning's predict index wrapper (and its ``sampler`` with it)."""
    wrapped_batch_sampler(wrapper)
    wrapper._batch_sampler = batch_sampler
    wrapper.sampler = getattr(batch_sampler, "sampler", None)


def inner_batch_sampler(batch_sampler: Any) -> Any:
    """The batch sampler inside ``batch_sampler`` when it is Lightning's predict index wrapper, else ``None``."""
    return getattr(batch_sampler, "_batch_sampler", None)


def combined_loader(fit_loop: Any) -> Any:
    """The training ``CombinedLoader`` of ``fit_loop`` (``None`` before the loaders are set up)."""
    return _required(fit_loop, "_combined_loader", "the training CombinedLoader")


def apply_late_loader_states(fit_loop: Any) -> int:
    """Apply the checkpoint's loader states Lightning left waiting (Lightning issue #20550); how many."""
    states = _required(fit_loop, "_combined_loader_states_to_load", "loader states waiting to be loaded")
    combined = combined_loader(fit_loop)
    if not states or combined is None:
        return 0
    _required(combined, "_load_state_dicts", "CombinedLoader state loading")(states)
    fit_loop._combined_loader_states_to_load = []
    return len(states)


def batch_progress(fit_loop: Any) -> Any:
    """The batch counters of the training epoch loop (``current`` / ``total``)."""
    return _required(fit_loop, "epoch_loop", "the training epoch loop").batch_progress


def set_epoch_length(trainer: Any, fit_loop: Any, limit: int) -> None:
    """Make Lightning's running training epoch ``limit`` batches long: the loop's ``max_batches``, the
    validation batch of a fractional ``val_check_interval`` and the data fetcher's length."""
    if fit_loop.max_batches != limit:
        fit_loop.max_batches = limit
        if isinstance(trainer.val_check_interval, float) and getattr(trainer, "_val_check_time_interval", None) is None:
            trainer.val_check_batch = max(1, int(limit * trainer.val_check_interval))
    fetcher = _required(fit_loop, "_data_fetcher", "the training data fetcher")
    if getattr(fetcher, "length", None) is not None:
        fetcher.length = limit  # it adds the batches done to what it fetched: they count against the epoch


def forget_iterator(loader: DataLoader[Any]) -> None:
    """Drop the persistent iterator of a (copied) ``DataLoader``."""
    front_ends.forget_iterator(loader)


def open_the_next_epoch(fit_loop: Any) -> bool:
    """After Lightning's ``_FitLoop.reset`` finished the epoch whose last batch a checkpoint of
    ``on_train_batch_end`` saw (its epoch progress: processed == ready), its restart stage still says
    "restarted mid-epoch", so ``on_advance_start`` would not count the next epoch as ready and started (nor call
    ``on_train_epoch_start``): every later checkpoint would then hold an epoch progress no uninterrupted run
    holds. Clear that stage, as an uninterrupted run opens the next epoch; whether it was cleared."""
    current = fit_loop.epoch_progress.current
    if (
        not _required(fit_loop, "restarted_mid_epoch", "the fit loop's restart stage")
        or current.ready != current.processed
    ):
        return False
    fit_loop.reset_restart_stage()
    return True


def repair_epoch_progress(checkpoint: dict[str, Any], loader_epoch: Any) -> bool:
    """Repair, in a loaded ``checkpoint``, the epoch progress a resume from an epoch's last batch left in every
    later checkpoint before :func:`open_the_next_epoch` (epoch ``k`` running, counted as not started: ready =
    started = processed = completed = ``k``): where the batch counters and the saved loader position
    (``loader_epoch(state)``: its epoch inside which it stands, else ``None``) both stand inside epoch ``k``,
    epoch ``k`` is counted ready and started, as an uninterrupted run counts it; whether it was repaired."""
    fit = checkpoint.get("loops", {}).get("fit_loop")
    if not isinstance(fit, dict) or "epoch_progress" not in fit or "epoch_loop.batch_progress" not in fit:
        return False
    epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
    current = epochs["current"]
    k = current["processed"]
    if len({current["ready"], current["started"], k, current["completed"]}) != 1:
        return False
    if batches["current"]["ready"] <= 0 or batches.get("is_last_batch", False):
        return False
    states = fit.get("state_dict", {}).get("combined_loader") or []
    if not states or any(loader_epoch(state) != k for state in states):
        return False
    for counts in epochs.values():
        counts["ready"] = counts["started"] = counts["processed"] + 1
    return True


def finish_the_epoch(fit_loop: Any) -> bool:
    """Finish Lightning's running epoch as ``_FitLoop.reset`` finishes one whose last batch a checkpoint of
    ``on_train_batch_end`` saw (its batches counted done, the epoch processed and completed), where the
    checkpoint saw another batch that is the last one on this layout (no batch of it left); whether it did.
    Only for such a checkpoint: one saved after the epoch's validation is finished by Lightning itself."""
    epoch_loop = _required(fit_loop, "epoch_loop", "the training epoch loop")
    progress = epoch_loop.batch_progress
    if progress.is_last_batch or not _required(epoch_loop, "restarted_on_train_batch_end", "its restart stage"):
        return False
    progress.is_last_batch = True
    fit_loop.epoch_progress.increment_processed()
    fit_loop.epoch_progress.increment_completed()
    return True
