"""A prepared loader's epochs: where ``set_epoch`` hands the epoch on (its batch sampler, sampler and dataset),
the two policies a front end sets (:attr:`EpochFanOut.keeps_own_epoch`, :attr:`EpochFanOut.epochs_set_by_framework`),
and the next epoch after a complete pass.  The epoch itself is the loader's cursor's
(:class:`~shardplug.core.loader.cursor.Cursor`)."""

from __future__ import annotations

from typing import Any

from shardplug.core._internal.arguments import is_int
from shardplug.core.loader.cursor import Cursor
from shardplug.core.sharding.shard_plan import ShardPlan, sampler_epoch

__all__ = ["EpochFanOut", "stands_at_another_epoch"]

_EPOCH_LEVELS = ("batch_sampler", "sampler", "dataset")
"""Where a ``set_epoch`` hands the epoch on: a shard's wrapped batch sampler and its sampler, a wrapper's dataset."""


def stands_at_another_epoch(target: Any, epoch: int) -> bool:
    """Whether ``target``, or a level under it that its ``set_epoch`` reaches, says it stands at another
    epoch than ``epoch``: an ``epoch`` attribute (torch's ``DistributedSampler``, shardplug's samplers,
    Hugging Face's datasets), ``next_epoch`` (streaming's ``StreamingDataset``) or ``current_epoch``
    (litdata's, which starts at 1).  A level that says nothing stands where it was built.  Preparing a
    loader tells its samplers epoch 0 only where this holds, so a framework's own ``set_epoch`` calls
    (Lightning's, once per epoch) are the only ones they get.

    Example::

        >>> from shardplug.core.shuffle.seedable import SeedableRandomSampler
        >>> sampler = SeedableRandomSampler(range(4), data_seed=0)
        >>> stands_at_another_epoch(sampler, 0)
        False
        >>> sampler.set_epoch(3)
        >>> stands_at_another_epoch(sampler, 0)
        True
    """
    seen: list[Any] = []
    pending = [target]
    while pending and len(seen) < 8:  # a few levels: samplers and wrappers, never a cycle
        level = pending.pop()
        if level is None or any(level is s for s in seen):
            continue
        seen.append(level)
        for name in ("epoch", "next_epoch", "current_epoch"):
            said = getattr(level, name, None)
            if is_int(said) and said != epoch:
                return True
        pending.extend(getattr(level, name, None) for name in _EPOCH_LEVELS)
    return False


class EpochFanOut:
    """The epoch of a prepared loader, handed on to what is under it (a part of
    :class:`~shardplug.core.loader.prepared.PreparedDataLoader`)."""

    cursor: Cursor
    batch_sampler: Any
    dataset: Any
    plan: ShardPlan

    @property
    def epoch(self) -> int:
        """The epoch this loader stands in (its cursor's; :meth:`set_epoch` sets it with its samplers'; over a user's
        ``DistributedSampler``, the sampler's: :meth:`follow_sampler_epoch`)."""
        self.follow_sampler_epoch()
        return self.cursor.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.cursor.epoch = epoch

    def epoch_targets(self) -> list[Any]:
        """Every object under this loader with a ``set_epoch`` (a batch sampler's, its sampler's, the dataset's)."""
        candidates = [self.batch_sampler, getattr(self, "sampler", None), self.dataset]
        unique: list[Any] = []
        for target in candidates:
            if target is not None and hasattr(target, "set_epoch") and all(target is not u for u in unique):
                unique.append(target)
        return unique

    keeps_own_epoch = False
    """Set the loader's epoch again on its sampler, batch sampler and dataset at the start of every pass,
    over a ``set_epoch`` called on them directly. Fabric's loader wrapper calls ``set_epoch`` on the samplers
    with its own count of passes, which a resumed run starts at 0 whatever epoch the loaded position is in:
    shardplug's Fabric strategy sets this, so the loader's epoch (advanced after each complete pass, or
    the loaded position's) decides the order."""

    def pin_epoch(self) -> None:
        """With :attr:`keeps_own_epoch`: the loader's epoch, set on every level that has one (a pass begins)."""
        if self.keeps_own_epoch:
            for target in self.epoch_targets():
                target.set_epoch(self.epoch)

    def follow_sampler_epoch(self, pass_begins: bool = False) -> None:
        """Over a plan whose order is drawn from its sampler's own epoch (a user's ``DistributedSampler``): the
        loader stands at the epoch the sampler stands at, as if ``set_epoch`` of it had been called on the loader
        (the sampler's ``set_epoch``, called by the user or a front end, moves both alike). Read where the loader's
        epoch is read: as a pass begins, as a position is saved, ``loader.epoch``; inside a pass nothing changes.
        As a pass begins after a complete one, it is that epoch again unless the sampler was set to another, as
        native DDP reads its sampler: the loader never advances it by itself. Other plans, and a loader that
        :attr:`keeps_own_epoch` (Fabric's, whose wrapper sets its own count on the samplers): nothing."""
        traits = getattr(self, "traits", None)
        if traits is None or not traits.follows_sampler_epoch or self.keeps_own_epoch:
            return
        if self.cursor.now.open and not pass_begins:
            return
        said = sampler_epoch(self.plan)
        if said is not None and (said != self.cursor.epoch or (pass_begins and self.cursor.now.complete)):
            self.cursor.enter_epoch(said)
            if hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(said)

    epochs_set_by_framework = False
    """A framework sets the epoch of the loader's samplers itself before every pass (Lightning's loops call
    ``set_epoch`` on ``loader.sampler`` and ``loader.batch_sampler.sampler``, once per epoch): after a
    complete pass the loader then advances its own epoch and its dataset's (:meth:`next_epoch`), not its
    samplers' a second time. shardplug's Lightning strategy sets this on the loaders it prepares."""

    def next_epoch(self) -> None:
        """After a complete pass, as the next one begins: the next epoch (:meth:`set_epoch`); with
        :attr:`epochs_set_by_framework`, on the loader and its dataset only."""
        epoch = self.cursor.epoch + 1
        if not self.epochs_set_by_framework:
            self.set_epoch(epoch)
            return
        self.cursor.enter_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of this loader, its sampler, its batch sampler and its dataset.

        Outside a pass, the loader then stands at that epoch's start (its position says so), or where a
        loaded position places it: its own epoch keeps it, and the epoch before a position at an epoch's
        start (that epoch's end) makes the next pass that epoch's empty rest; a position inside another
        epoch is refused (see :meth:`~shardplug.core.loader.cursor.Cursor.enter_epoch`)."""
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch={epoch!r} must be an integer >= 0")
        self.cursor.enter_epoch(epoch)
        for target in self.epoch_targets():
            target.set_epoch(epoch)

    def start_epochs_at_zero(self) -> None:
        """The loader starts at epoch 0: so do the levels under it, told only where one stands at another."""
        for target in self.epoch_targets():
            if stands_at_another_epoch(target, 0):
                target.set_epoch(0)
