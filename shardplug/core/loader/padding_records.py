"""A prepared loader's padding records and sample audit: what ``track_padding()``, ``drop_padding_rows()`` and
``enable_audit()`` switch on, and the record of the batch being processed (``batch_indices``,
``batch_real_count``).  The records themselves are kept by :class:`~shardplug.core.padding.tracking.PaddingTracker`
as each pass hands a batch out; which rows pad is the layout's and the plan's."""

from __future__ import annotations

from typing import Any, cast

from torch.utils.data import DataLoader

from shardplug.core._internal import compat
from shardplug.core.loader.cursor import Cursor
from shardplug.core.padding.audit import SampleAudit
from shardplug.core.padding.tracking import PaddingTracker
from shardplug.core.sharding.map_style import IndexSamplerShard
from shardplug.core.sharding.marks import TagCollate
from shardplug.core.sharding.mixture import Mixture
from shardplug.core.sharding.shard_plan import ShardPlan, plan_traits, start_tagging

__all__ = ["PaddingRecords"]


class PaddingRecords:
    """The padding records of a prepared loader's batches (a part of
    :class:`~shardplug.core.loader.prepared.PreparedDataLoader`)."""

    cursor: Cursor
    plan: ShardPlan
    collate_fn: Any
    batch_size: Any
    batch_sampler: Any
    tracker: PaddingTracker | None

    @property
    def total_dataset_length(self) -> int | None:
        raise NotImplementedError  # the loader's (PreparedDataLoader.total_dataset_length)

    def track_padding(self) -> None:
        """Record, for every batch, its indices and how many of them are real (not padding):
        :attr:`batch_indices`, :attr:`batch_real_count`.

        Map-style data: dataset indices.  A sized iterable dataset sharded by shardplug: positions
        in the stream.  Other loaders cannot tell padding apart (a ``ValueError`` says so).
        """
        if getattr(self, "in_order", True) is False:
            raise ValueError("padding tracking needs batches in sampler order: build the DataLoader with in_order=True")
        reason = plan_traits(self.plan).untracked_reason
        if reason is not None:
            raise ValueError(reason)
        if start_tagging(self.plan):
            # the plan's readers tag each element where the batches' places cannot be computed (a stream
            # without len(), or one that splits itself across workers): the collation hands the tags on
            self.collate_fn = TagCollate(self.collate_fn)
            compat.forget_iterator(cast("DataLoader[Any]", self))  # persistent workers would keep their untagged copies
        if self.tracker is None:
            self.tracker = PaddingTracker()

    def drop_padding_rows(self) -> None:
        """Hand out only the real rows of every batch (:meth:`track_padding` first): the padding rows
        that even out the last step are cut off before the batch leaves the loader, so a step whose
        rows are all padding is a batch of 0 rows (the same structure). Every process still gets
        the same number of batches. A loader of single samples (``batch_size=None``) has no rows to
        cut: a ``ValueError``.
        """
        if isinstance(getattr(self, "sampler", None), IndexSamplerShard) or (
            self.batch_size is None and self.batch_sampler is None
        ):
            raise ValueError(
                "drop_padding_rows() needs batches with rows; this loader hands out single samples "
                "(DataLoader(batch_size=None)): keep them and skip those with loader.batch_real_count == 0"
            )
        cut = getattr(self, "padding_cut", None)  # a loader whose batches are lists of samples says how to cut them
        self.track_padding()
        self.tracker.dropping = True  # type: ignore[union-attr]
        if cut is not None:
            self.tracker.cut = cut  # type: ignore[union-attr]

    @property
    def batch_indices(self) -> list[int] | None:
        """Dataset indices of the batch being processed (with :meth:`track_padding`)."""
        return self.cursor.now.batch_indices

    @property
    def batch_sources(self) -> list[str] | None:
        """For a loader over a :class:`~shardplug.core.sharding.mixture.Mixture`: the source of each row of the
        batch being processed (with :meth:`track_padding`; ``None`` before, or for other data), for per-source
        metrics.  Its :attr:`batch_indices` are positions in the epoch (``epoch * len(mixture) + i`` is the
        global position ``mixture.locate`` reads)."""
        indices, dataset = self.cursor.now.batch_indices, getattr(self, "dataset", None)
        if indices is None or not isinstance(dataset, Mixture):
            return None
        start = self.cursor.epoch * len(dataset)
        return dataset.sources_of([start + i for i in indices])

    @property
    def batch_real_count(self) -> int | None:
        """How many leading samples of the batch being processed are real; the rest are
        wrap-around padding (with :meth:`track_padding`; ``None`` otherwise)."""
        return self.cursor.now.batch_real

    @property
    def padding_tracker(self) -> PaddingTracker | None:
        """The padding tracking of this loader's batches (after :meth:`track_padding`; ``None`` before)."""
        return self.tracker

    @property
    def audit(self) -> SampleAudit | None:
        """The samples this process consumed, per epoch (after :meth:`enable_audit`; ``None`` before)."""
        return self.tracker.audit if self.tracker is not None else None

    def enable_audit(self) -> SampleAudit:
        """Start recording which samples this process consumes, per epoch (opt-in; see :class:`SampleAudit`)."""
        self.track_padding()
        if not plan_traits(self.plan).identifies_samples:
            raise ValueError(
                "this loader's batches carry no sample ids shardplug knows (a stream that shards itself, one without "
                "len(), or one that splits itself across DataLoader workers): padding is marked in "
                "loader.batch_real_count, but an audit needs ids; audit a map-style dataset or a sized stream read by "
                "every process"
            )
        tracker = self.tracker
        if tracker.audit is None:  # type: ignore[union-attr]
            tracker.audit = SampleAudit(self.total_dataset_length)  # type: ignore[union-attr]
        return tracker.audit  # type: ignore[union-attr]
