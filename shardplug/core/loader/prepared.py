"""Prepared data loaders: what each process iterates.

:class:`PreparedDataLoader` keeps a prepared loader's settings (its plan, device, the RNGs agreed
with process 0, its epoch) and hands its jobs to collaborators, in the shape of torch's
``DataLoader`` (settings on the loader, the state of one pass on its iterator) and of torchdata's
stateful components (each keeps its own state):

* each pass is a :class:`~shardplug.core.loader.passes.LoaderPass` (``passes.py``): its start, delivery,
  look-ahead, ``end_of_dataloader``, the gradient state's notices and the ``len()`` check;
* the resume state (:attr:`PreparedDataLoader.resume`, a :class:`~shardplug.core.loader.resume_state.ResumeState`):
  the last pass, the start of the next one, the position (build, validate, load; ``state_dict()`` /
  ``load_state_dict()``), with the ``StatefulDataLoader``'s own state beside it (``resume/``);
* padding tracking and the audit (``padding/tracking.py``, ``padding/audit.py``), device transfer
  (``transfer.py``) and the shuffle seeds (``shuffle/agreement.py``);
* which rows this process gets, how many batches and where a pass resumes: its plan (``sharding/``),
  which answers everything that differs between kinds of sharding.

:class:`DataLoaderShard` is the loader whose sampler or dataset is already sharded.  The dispatcher
lives in ``dispatch/dispatcher.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset

from shardplug.core._internal import compat
from shardplug.core._internal.arguments import check_prefetch_depth, is_int
from shardplug.core.config import ShardplugConfig
from shardplug.core.loader.cursor import Cursor, SkipView
from shardplug.core.loader.passes import LengthMismatchWarning, PassListener, run_pass
from shardplug.core.loader.resume_state import ResumeState
from shardplug.core.padding.audit import SampleAudit
from shardplug.core.padding.tracking import PaddingTracker
from shardplug.core.resume.lengths import PassLengths
from shardplug.core.resume.stateful import is_stateful, stateful_dataloader_class
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.local import LocalPlan
from shardplug.core.sharding.map_style import BatchSamplerShard, IndexSamplerShard
from shardplug.core.sharding.marks import TagCollate
from shardplug.core.sharding.read_all import IterableDatasetShard
from shardplug.core.sharding.shard_plan import ShardPlan, plan_traits, sized_length, start_tagging
from shardplug.core.shuffle.agreement import Shuffles, agree_at_prepare
from shardplug.core.shuffle.rng import check_rng_types

__all__ = [
    "LoaderOptions",
    "PreparedDataLoader",
    "DataLoaderShard",
    "LengthMismatchWarning",
    "stateful_dataloader_class",
    "stateful_variant",
]

logger = logging.getLogger(__name__)

_Prepared = TypeVar("_Prepared", bound="PreparedDataLoader")

_VARIANTS: dict[tuple[type, ...], type] = {}


def combined_class(*bases: type) -> type:
    """One cached class deriving from ``bases`` in order (e.g. our loader and the user's subclass)."""
    bases = tuple(dict.fromkeys(b for b in bases if not any(o is not b and issubclass(o, b) for o in bases)))
    if len(bases) == 1:
        return bases[0]
    if bases not in _VARIANTS:
        name = "".join(b.__name__ for b in bases[:1]) + "".join(f"_{b.__name__}" for b in bases[1:])
        _VARIANTS[bases] = type(name, bases, {"__module__": bases[0].__module__})
    return _VARIANTS[bases]


def stateful_variant(cls: type) -> type:
    """``cls`` backed by torchdata's ``StatefulDataLoader``."""
    return combined_class(cls, stateful_dataloader_class())


_EPOCH_LEVELS = ("batch_sampler", "sampler", "dataset")
"""Where a ``set_epoch`` hands the epoch on: a shard's wrapped batch sampler and its sampler, a wrapper's dataset."""


def _stands_at_another_epoch(target: Any, epoch: int) -> bool:
    """Whether ``target``, or a level under it that its ``set_epoch`` reaches, says it stands at another
    epoch than ``epoch``: an ``epoch`` attribute (torch's ``DistributedSampler``, shardplug's samplers,
    Hugging Face's datasets), ``next_epoch`` (streaming's ``StreamingDataset``) or ``current_epoch``
    (litdata's, which starts at 1).  A level that says nothing stands where it was built.  Preparing a
    loader tells its samplers epoch 0 only where this holds, so a framework's own ``set_epoch`` calls
    (Lightning's, once per epoch) are the only ones they get.

    Example::

        >>> from shardplug.core.shuffle.seedable import SeedableRandomSampler
        >>> sampler = SeedableRandomSampler(range(4), data_seed=0)
        >>> _stands_at_another_epoch(sampler, 0)
        False
        >>> sampler.set_epoch(3)
        >>> _stands_at_another_epoch(sampler, 0)
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


def _variant_instance(bases: tuple[type, ...]) -> Any:
    """Unpickling helper: an empty instance of the cached class deriving from ``bases``."""
    return object.__new__(combined_class(*bases))


@dataclass(frozen=True)
class LoaderOptions:
    """What a prepared loader holds beyond a ``DataLoader``'s settings, in one object: the ``device`` its
    batches move to (``None``: they stay), the RNGs agreed with process 0 at each pass (``rng_types``, and
    ``synchronized_generator``), the batches its first pass skips (``skip_batches``), ``non_blocking``
    copies, the batches read ahead of the one handed out (``prefetch_depth``, ``None``: 0, prefetching is
    opt-in; see :mod:`~shardplug.core.loader.prefetch`), and the ``plan`` of its rows (``None``: the
    loader's own, from its sampler or dataset).

    Example::

        >>> LoaderOptions(skip_batches=2).skip_batches
        2
        >>> LoaderOptions(skip_batches=-1)
        Traceback (most recent call last):
        ...
        ValueError: skip_batches=-1 must be an integer >= 0
    """

    device: torch.device | None = None
    rng_types: tuple[str, ...] = ()
    synchronized_generator: torch.Generator | None = None
    skip_batches: int = 0
    non_blocking: bool = ShardplugConfig.non_blocking
    plan: ShardPlan | None = None
    prefetch_depth: int | None = ShardplugConfig.prefetch_depth

    def __post_init__(self) -> None:
        if not is_int(self.skip_batches) or self.skip_batches < 0:
            raise ValueError(f"skip_batches={self.skip_batches!r} must be an integer >= 0")
        object.__setattr__(self, "rng_types", check_rng_types(self.rng_types))
        object.__setattr__(self, "non_blocking", bool(self.non_blocking))
        object.__setattr__(self, "prefetch_depth", check_prefetch_depth(self.prefetch_depth))


class PreparedDataLoader(DataLoader[Any]):
    """What every prepared loader does on top of ``DataLoader``.

    * each pass (:class:`~shardplug.core.loader.passes.LoaderPass`): advance the epoch if the previous
      pass was complete, agree shuffling seeds and synchronise the named RNGs from process 0; per
      batch, move it to ``device``, know whether it is the last one (``end_of_dataloader``), and
      tell the run's gradient state (``gradient_state``, when set);
    * ``state_dict()`` / ``load_state_dict()``: the position in the epoch (a
      :class:`~shardplug.core.resume.position.Position`), kept with the last pass by the loader's
      :attr:`resume` state.

    Which rows this process gets, ``len()`` and where a pass resumes are its :attr:`plan`'s
    (see ``sharding/``); the loader keeps the settings and its collaborators.

    Not part of the API (the reference leaves them out): ``assemble``, ``skipped_copy``,
    ``agree_at_prepare``, ``inner_loader``, ``inner_batches``, ``batch_shard``, ``padding_tracker`` and
    ``source_marks_last`` are the hooks shardplug's own modules (the planner, the dispatcher, the
    front ends) call; they may change without notice.
    """

    plan: ShardPlan

    source_marks_last = False
    """:meth:`inner_batches` yields ``(batch, is_last)`` pairs: the source knows where its pass ends
    (a dispatcher: process 0's end, on every process), so the pass neither counts nor reads ahead."""

    def __new__(
        cls, *args: Any, use_stateful_dataloader: bool = ShardplugConfig.use_stateful_dataloader, **kwargs: Any
    ) -> PreparedDataLoader:
        if use_stateful_dataloader:
            cls = stateful_variant(cls)
        return super().__new__(cls)

    def __reduce_ex__(self, protocol: Any) -> Any:
        state = dict(self.__dict__)
        compat.without_iterator(state)  # an open iterator (and its workers) does not travel
        cls = type(self)
        if _VARIANTS.get(cls.__bases__) is cls:  # a class made by combined_class: rebuilt by its bases
            return _variant_instance, (cls.__bases__,), state
        return _variant_instance, ((cls,),), state

    # -- set-up ---------------------------------------------------------------------------
    @classmethod
    def assemble(
        cls: type[_Prepared],
        base_init: Callable[..., None],
        dataset: Any,
        loader_kwargs: dict[str, Any],
        options: LoaderOptions,
    ) -> _Prepared:
        """A loader of this class built in one call: ``base_init`` (the ``DataLoader``'s or the
        ``StatefulDataLoader``'s ``__init__``, not a user subclass's, whose signature is its own) with
        ``dataset`` and ``loader_kwargs``, then shardplug's part from ``options`` (what
        :func:`~shardplug.core.planner.prepare_data_loader` uses)."""
        new = object.__new__(cls)
        base_init(new, dataset, **loader_kwargs)
        new._setup(options)
        return new

    def _setup(self, options: LoaderOptions) -> None:
        """shardplug's part of the loader, once the ``DataLoader``'s settings are set (subclasses add theirs)."""
        self.device = options.device
        self.non_blocking = options.non_blocking
        self.prefetch_depth = options.prefetch_depth
        self.rng_types = options.rng_types
        self.synchronized_generator = options.synchronized_generator
        self.gradient_state: PassListener | None = None  # the run's GradientState, when one is connected
        self.cursor = Cursor(options.skip_batches)  # where the loader stands; skip_batches shortens its next pass
        self.plan = self._plan_for(options)
        self.shuffles = Shuffles(self.plan.sampler, getattr(self, "sampler", None))  # their seeds and generator
        self._tracker: PaddingTracker | None = None  # padding tracking (track_padding), with the audit

    def _plan_for(self, options: LoaderOptions) -> ShardPlan:
        """The plan of this loader's rows: the planner's, else the loader's own (subclasses wrap it)."""
        return options.plan if options.plan is not None else self._default_plan()

    def _default_plan(self) -> ShardPlan:
        """The plan of a loader built directly (``prepare_data_loader`` passes its own)."""
        shard = self.batch_shard
        if shard is not None:
            return shard.plan
        if isinstance(self.dataset, IterableDatasetShard):
            return self.dataset.plan
        layout = ShardLayout(batch_size=self.batch_size, drop_last=bool(self.drop_last))
        try:
            length: int | None = DataLoader.__len__(self)
        except (TypeError, NotImplementedError):
            length = None
        return LocalPlan(layout, length, stream=isinstance(self.dataset, IterableDataset))

    @property
    def batch_shard(self) -> BatchSamplerShard | None:
        """The batch sampler shard (also when it was passed as ``sampler=``, or under an index shard)."""
        for candidate in (self.batch_sampler, getattr(self, "sampler", None)):
            if isinstance(candidate, BatchSamplerShard):
                return candidate
            if isinstance(candidate, IndexSamplerShard):
                return candidate.shard
        return None

    def inner_loader(self) -> Any:
        """The loader under shardplug's class: ``DataLoader``, a ``StatefulDataLoader`` or the user's
        subclass (its ``__iter__``, ``__len__``, ``state_dict()`` / ``load_state_dict()``)."""
        return super()

    @property
    def end_of_dataloader(self) -> bool:
        """True while the last batch of the current pass is being processed."""
        return self.cursor.now.end_of_dataloader

    @property
    def epoch(self) -> int:
        """The epoch this loader stands in (its cursor's; :meth:`set_epoch` sets it with its samplers')."""
        return self.cursor.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.cursor.epoch = epoch

    @property
    def use_stateful_dataloader(self) -> bool:
        return is_stateful(self)

    # -- epochs and RNG -------------------------------------------------------------------
    def _epoch_targets(self) -> list[Any]:
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
            for target in self._epoch_targets():
                target.set_epoch(self.epoch)

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
        for target in self._epoch_targets():
            target.set_epoch(epoch)

    def agree_at_prepare(self, data: tuple[int | None, int | None] | None) -> None:
        """Agree unset shuffle seeds with process 0 now, comparing every process's ``data`` (dataset
        length, batch size) in the same collective (:func:`shardplug.core.shuffle.agreement.agree_at_prepare`)."""
        agree_at_prepare(self.shuffles.seedable, data)

    # -- lengths --------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches the pass yields: the pass in progress while one is open, else the next one
        (exact also after ``load_state_dict`` and ``skip_first_batches``)."""
        return self.cursor.length(self.lengths())

    def lengths(self) -> PassLengths:
        """The lengths of this loader's passes after a place in the epoch (the plan's, else the
        ``DataLoader``'s own)."""
        return PassLengths(self.plan, self._inner_length, self.dataset)

    def _inner_length(self) -> int:
        return int(self.inner_loader().__len__())

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all processes (``None`` for variable-size batches)."""
        return self.plan.layout.step_batch_size

    @property
    def total_dataset_length(self) -> int | None:
        dataset = self.dataset.dataset if isinstance(self.dataset, IterableDatasetShard) else self.dataset
        return sized_length(dataset)

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch (0 when it is full, as with ``drop_last``; -1 when
        unknown): the last step of the pass in progress, else of the next pass. A pass that resumed a
        position of another number of processes (or was shortened by a skip) starts at another place in the epoch's
        steps, so its last step holds another number of samples than an uninterrupted epoch's."""
        length, total = self.total_dataset_length, self.total_batch_size
        if length is None or not total:
            return -1
        if self.plan.layout.drop_last:
            return 0  # a short last step is dropped: the last one is full
        before = self.plan.samples_before(self.cursor.next_start(self.plan.consumed_per_batch))
        return max(length - (before or 0), 0) % total

    @property
    def epoch_length(self) -> int | None:
        """Batches of a whole epoch on this loader's layout (``None`` when unknown: a stream without
        ``len()``); ``len(loader)`` is the next pass's, shorter after a resume."""
        return self.lengths().epoch_length()

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a pass of its own, not a _BaseDataLoaderIter
        return run_pass(self)

    def inner_batches(self, discard: int) -> Iterator[Any]:
        """The batches of this pass, after ``discard`` of them were read and dropped (subclasses)."""
        raise NotImplementedError

    # -- position -------------------------------------------------------------------------
    @property
    def resume(self) -> ResumeState:
        """Where this loader stands and where its next pass starts (see
        :class:`~shardplug.core.loader.resume_state.ResumeState`): its :meth:`~ResumeState.position`, the
        counters a front end sets its own from (``resumed_batches``, ``resumed_inside_epoch``), and
        :meth:`~ResumeState.resume_at` for a front end that counts batches itself."""
        return ResumeState(self)

    def state_dict(self) -> dict[str, Any]:
        """Resume state: after ``load_state_dict`` iteration continues after the last batch handed out
        (a :class:`~shardplug.core.resume.position.Position` as plain values, identical on every process)."""
        return ResumeState(self).state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue after what ``state_dict`` says at the next pass; it is validated first, and nothing
        changes when it is refused."""
        ResumeState(self).load_state_dict(state_dict)

    def skipped_copy(self, num_batches: int) -> PreparedDataLoader:
        """A copy of this loader whose next pass starts after its first ``num_batches`` batches
        (what :func:`~shardplug.core.planner.skip_first_batches` returns): the same settings,
        plan, epoch and position: the copy shares this loader's cursor (a
        :class:`~shardplug.core.loader.cursor.SkipView` of it, with a skip of its own), so this loader follows
        the copy's passes (its epoch and position) and continues with the next epoch once the copy's pass is
        over.

        Not a pickled copy (which drops what belongs to this process, e.g. a dispatcher's process
        group): every attribute is shared as it is, so what a subclass keeps in one object (a
        dispatcher's wire state) stays one for both, and using the copy for one pass and this loader
        afterwards keeps them in step with the other processes.  Its padding tracking is copied.
        """
        if not is_int(num_batches) or num_batches < 0:
            raise ValueError(f"num_batches={num_batches!r} must be an integer >= 0")
        new = object.__new__(type(self))
        new.__dict__.update(
            self.__dict__,
            cursor=SkipView(self.cursor, num_batches),  # this loader follows the copy's passes
            _tracker=copy.copy(self._tracker),  # the same audit
        )
        compat.forget_iterator(new)  # an open iterator (and its workers) stays this loader's
        return new

    # -- padding and audit ----------------------------------------------------------------
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
            compat.forget_iterator(self)  # persistent workers would keep their untagged copies
        if self._tracker is None:
            self._tracker = PaddingTracker()

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
        self._tracker.dropping = True  # type: ignore[union-attr]
        if cut is not None:
            self._tracker.cut = cut  # type: ignore[union-attr]

    @property
    def batch_indices(self) -> list[int] | None:
        """Dataset indices of the batch being processed (with :meth:`track_padding`)."""
        return self.cursor.now.batch_indices

    @property
    def batch_real_count(self) -> int | None:
        """How many leading samples of the batch being processed are real; the rest are
        wrap-around padding (with :meth:`track_padding`; ``None`` otherwise)."""
        return self.cursor.now.batch_real

    @property
    def padding_tracker(self) -> PaddingTracker | None:
        """The padding tracking of this loader's batches (after :meth:`track_padding`; ``None`` before)."""
        return self._tracker

    @property
    def audit(self) -> SampleAudit | None:
        """The samples this process consumed, per epoch (after :meth:`enable_audit`; ``None`` before)."""
        return self._tracker.audit if self._tracker is not None else None

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
        tracker = self._tracker
        if tracker.audit is None:  # type: ignore[union-attr]
            tracker.audit = SampleAudit(self.total_dataset_length)  # type: ignore[union-attr]
        return tracker.audit  # type: ignore[union-attr]


class DataLoaderShard(PreparedDataLoader):
    """A ``DataLoader`` over an already sharded sampler or dataset, for one process.

    Accepts every ``DataLoader`` keyword.  Batches are moved to ``device``; the first
    ``skip_batches`` batches of the first pass are skipped without loading them (map-style);
    ``end_of_dataloader`` is true while the last batch of a pass is being processed.

    Example::

        >>> loader = DataLoaderShard(range(6), batch_size=2)
        >>> [b.tolist() for b in loader], loader.end_of_dataloader
        ([[0, 1], [2, 3], [4, 5]], True)
    """

    def __init__(
        self,
        dataset: Any,
        device: str | torch.device | None = None,
        rng_types: Iterable[str] | None = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = ShardplugConfig.use_stateful_dataloader,
        non_blocking: bool = ShardplugConfig.non_blocking,
        prefetch_depth: int | None = ShardplugConfig.prefetch_depth,
        **dataloader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, **dataloader_kwargs)
        options = self._options(device, rng_types, synchronized_generator, skip_batches, non_blocking)
        self._setup(dataclasses.replace(options, prefetch_depth=prefetch_depth))

    @staticmethod
    def _options(
        device: str | torch.device | None,
        rng_types: Iterable[str] | None,
        synchronized_generator: torch.Generator | None,
        skip_batches: int,
        non_blocking: bool,
    ) -> LoaderOptions:
        """The constructor's keywords as one options object."""
        return LoaderOptions(
            device=torch.device(device) if device is not None else None,
            rng_types=check_rng_types(rng_types),
            synchronized_generator=synchronized_generator,
            skip_batches=skip_batches,
            non_blocking=non_blocking,
        )

    def _setup(self, options: LoaderOptions) -> None:
        # Own the (batch) sampler so skipping and resuming never load a skipped batch.
        if not isinstance(self.dataset, IterableDataset):
            if self.batch_sampler is not None and not isinstance(self.batch_sampler, BatchSamplerShard):
                object.__setattr__(self, "batch_sampler", BatchSamplerShard(self.batch_sampler))
            elif self.batch_sampler is None and not isinstance(self.sampler, (BatchSamplerShard, IndexSamplerShard)):
                object.__setattr__(self, "sampler", IndexSamplerShard(self.sampler))
            if isinstance(self.batch_sampler, BatchSamplerShard):  # what DataLoader reports for a batch sampler
                object.__setattr__(self, "batch_size", self.batch_sampler.per_process_batch_size)
                object.__setattr__(self, "drop_last", self.batch_sampler.drop_last)
        super()._setup(options)
        for target in self._epoch_targets():  # the loader starts at epoch 0: so do they, told only where needed
            if _stands_at_another_epoch(target, 0):
                target.set_epoch(0)

    def inner_batches(self, discard: int) -> Iterator[Any]:
        with self.plan.start_in_workers(self.num_workers) as pending:
            if pending and self.persistent_workers:
                # persistent workers hold their copies of the plan from when they started: a start set
                # since cannot reach them, so this pass gets new workers (compat.forget_iterator)
                compat.forget_iterator(self)
            batches: Iterator[Any] = self.inner_loader().__iter__()
        for _ in zip(range(discard), batches):
            pass  # read, but never handed out (data that shardplug cannot skip by index)
        return batches
