"""Prepared data loaders: what each process iterates.

:class:`PreparedDataLoader` keeps a prepared loader's settings (its plan, device, the RNGs agreed
with process 0, its epoch) and hands its jobs to collaborators, in the shape of torch's
``DataLoader`` (settings on the loader, the state of one pass on its iterator) and of torchdata's
stateful components (each keeps its own state):

* its options, whole (:class:`~shardplug.core.loader.options.LoaderOptions`, ``options.py``);
* its place (:attr:`PreparedDataLoader.cursor`, a :class:`~shardplug.core.loader.cursor.Cursor`): the epoch,
  the start of the next pass, the counters of the pass, as values;
* each pass (:func:`~shardplug.core.loader.passes.run_pass`, ``passes.py``): a short chain of stages over
  the cursor and the loader's source;
* its saved positions (:attr:`PreparedDataLoader.resume`, a
  :class:`~shardplug.core.loader.resume_state.ResumeState`: ``state_dict()`` / ``load_state_dict()``);
* its epochs handed on (``epochs.py``), its padding records and audit (``padding_records.py``), its class
  and pickling (``variants.py``);
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
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset

from shardplug.core._internal import compat
from shardplug.core._internal.arguments import is_int
from shardplug.core.config import ShardplugConfig
from shardplug.core.loader.cursor import Cursor, PassLengths, SkipView
from shardplug.core.loader.epochs import EpochFanOut
from shardplug.core.loader.options import LoaderOptions
from shardplug.core.loader.padding_records import PaddingRecords
from shardplug.core.loader.passes import LengthMismatchWarning, PassListener, run_pass
from shardplug.core.loader.resume_state import ResumeState
from shardplug.core.loader.variants import Rebuilt, combined_class, stateful_variant
from shardplug.core.padding.tracking import PaddingTracker
from shardplug.core.resume.stateful import is_stateful, stateful_dataloader_class
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.local import LocalPlan
from shardplug.core.sharding.map_style import BatchSamplerShard, IndexSamplerShard
from shardplug.core.sharding.read_all import IterableDatasetShard
from shardplug.core.sharding.shard_plan import ShardPlan, last_step_real, plan_traits, sized_length
from shardplug.core.shuffle.agreement import Shuffles, agree_at_prepare
from shardplug.core.shuffle.rng import check_rng_types

__all__ = [
    "LoaderOptions",
    "PreparedDataLoader",
    "DataLoaderShard",
    "LengthMismatchWarning",
    "stateful_dataloader_class",
    "stateful_variant",
    "combined_class",
]

logger = logging.getLogger(__name__)

_Prepared = TypeVar("_Prepared", bound="PreparedDataLoader")


def _option(name: str, doc: str) -> Any:
    """A loader attribute that reads (and, set, replaces) one field of its :class:`LoaderOptions`."""

    def read(self: PreparedDataLoader) -> Any:
        return getattr(self.options, name)

    def write(self: PreparedDataLoader, value: Any) -> None:
        self.options = dataclasses.replace(self.options, **{name: value})

    return property(read, write, doc=doc)


class PreparedDataLoader(Rebuilt, EpochFanOut, PaddingRecords, DataLoader[Any]):
    """What every prepared loader does on top of ``DataLoader``.

    * each pass (:func:`~shardplug.core.loader.passes.run_pass`): advance the epoch if the previous
      pass was complete, agree shuffling seeds and synchronise the named RNGs from process 0; per
      batch, move it to ``device``, know whether it is the last one (``end_of_dataloader``), and
      tell the run's gradient state (``gradient_state``, when set);
    * ``state_dict()`` / ``load_state_dict()``: the position in the epoch (a
      :class:`~shardplug.core.resume.position.Position`), built from the loader's :attr:`cursor` by its
      :attr:`resume` state.

    Which rows this process gets, ``len()`` and where a pass resumes are its :attr:`plan`'s
    (see ``sharding/``); the loader keeps its settings (:attr:`options`, whole), its plan and its cursor.

    Not part of the API (the reference leaves them out): ``assemble``, ``skipped_copy``,
    ``agree_at_prepare``, ``inner_loader``, ``inner_batches``, ``batch_shard``, ``padding_tracker``,
    ``source_marks_last``, ``cursor``, ``options``, ``lengths``, ``shuffles``, ``traits``, ``tracker`` and
    ``sampler_plan`` are the hooks shardplug's own modules (the planner, the dispatcher, the
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
        self.options = options  # whole: the passes read it
        self.gradient_state: PassListener | None = None  # the run's GradientState, when one is connected
        self.cursor = Cursor(options.skip_batches)  # where the loader stands; skip_batches shortens its next pass
        self.plan = self._plan_for(options)
        self.traits = plan_traits(self.plan)  # what the plan can do (read by each pass)
        self.shuffles = Shuffles(self.plan.sampler, getattr(self, "sampler", None))  # their seeds and generator
        self.tracker: PaddingTracker | None = None  # padding tracking (track_padding), with the audit
        self.sampler_plan = shard.plan if (shard := self.batch_shard) is not None else None
        """The plan of the batch sampler torch's ``DataLoader`` draws from, where a pass parks its record."""

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
    def use_stateful_dataloader(self) -> bool:
        return is_stateful(self)

    device = _option("device", "Where batches move (``None``: they stay).")
    non_blocking = _option("non_blocking", "Copies to the device are non-blocking.")
    prefetch_depth = _option("prefetch_depth", "Batches read ahead of the one handed out (``None``: 0).")
    rng_types = _option("rng_types", "The RNGs agreed with process 0 at each pass.")
    synchronized_generator = _option("synchronized_generator", "A generator agreed with process 0 at each pass.")

    def renumber_epoch(self, epoch: int) -> None:
        """Number the loader's epoch ``epoch`` without entering it: the pass in progress (or, outside a pass,
        the next one) counts in ``epoch`` in the loader's position, and a complete pass moves on from it.

        Nothing else changes: no ``set_epoch`` on the sampler, batch sampler or dataset (the pass reads on
        in the order it began with), and a loaded position stays as it is. For a front end whose loop numbers
        its epochs and already set them on the samplers, where a pass it cut short (``limit_train_batches``,
        ``max_steps``) ended none of the loader's epochs; :meth:`set_epoch` would also end no epoch with the
        pass in progress, and set the epoch again on every level."""
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch={epoch!r} must be an integer >= 0")
        self.epoch = epoch

    def agree_at_prepare(self, data: tuple[int | None, int | None] | None) -> None:
        """Agree unset shuffle seeds with process 0 now, comparing every process's ``data`` (dataset
        length, batch size) in the same collective (:func:`shardplug.core.shuffle.agreement.agree_at_prepare`)."""
        agree_at_prepare(self.shuffles.seedable, data)

    # -- lengths --------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches the pass yields: the pass in progress while one is open (also while its last batch is
        processed: :meth:`end_finished_pass`), else the next one (exact also after ``load_state_dict`` and
        ``skip_first_batches``)."""
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
        consumed = self.cursor.next_start(self.plan)
        counted = last_step_real(self.plan, consumed)
        if counted is not None:
            return counted  # the plan's own count (padding, or a cut, inside the last step)
        if self.plan.layout.drop_last:
            return 0  # a short last step is dropped: the last one is full
        before = self.plan.samples_before(consumed)
        return max(length - (before or 0), 0) % total

    @property
    def epoch_length(self) -> int | None:
        """Batches of a whole epoch on this loader's layout (``None`` when unknown: a stream without
        ``len()``); ``len(loader)`` is the next pass's, shorter after a resume."""
        return self.lengths().epoch_length()

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a pass of its own, not a _BaseDataLoaderIter
        self.cursor.end_finished_pass()  # the next pass is asked for: the last one's loop is done with it
        return run_pass(self)

    def end_finished_pass(self) -> bool:
        """End the pass in progress if its last batch was handed out while its loop asks for no more (a loop that
        stops at ``len()``): a front end calls it where its epoch ends, before the next one begins (as
        ``set_epoch`` of the next epoch and ``iter()`` of the next pass do). ``len()`` is then the next pass's
        (a whole epoch after a resumed one), not the finished pass's, which it stays while the last batch is
        processed; the position and the next pass are unchanged. Whether a pass was ended (see
        :meth:`~shardplug.core.loader.cursor.Cursor.end_finished_pass`)."""
        return self.cursor.end_finished_pass()

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
            tracker=copy.copy(self.tracker),  # the same audit
        )
        compat.forget_iterator(new)  # an open iterator (and its workers) stays this loader's
        return new


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
        if self.traits.follows_sampler_epoch:  # a user's DistributedSampler: the loader stands at its epoch
            self.follow_sampler_epoch()
        else:
            self.start_epochs_at_zero()

    def inner_batches(self, discard: int) -> Iterator[Any]:
        with self.plan.start_in_workers(self.num_workers) as pending:
            if pending and self.persistent_workers:
                # persistent workers hold their copies of the plan from when they started: a start set
                # since cannot reach them, so this pass gets new workers (compat.forget_iterator)
                compat.forget_iterator(self)
            batches: Iterator[Any] = super(PreparedDataLoader, self).__iter__()  # inner_loader()'s, asked inline
        for _ in zip(range(discard), batches):
            pass  # read, but never handed out (data that shardplug cannot skip by index)
        return batches
