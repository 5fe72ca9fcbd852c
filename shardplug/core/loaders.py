"""Prepared data loaders: what each process iterates.

:class:`PreparedDataLoader` holds what every prepared loader does (epochs, RNG agreement,
device transfer, knowing the last batch, the resume position) by asking its plan (``plan.py``)
which rows, how many batches and where to resume; :class:`DataLoaderShard` is the loader whose
sampler or dataset is already sharded.  The dispatcher lives in ``dispatch.py``.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Iterable, Iterator, Optional, Union

import torch
from torch.utils.data import DataLoader, IterableDataset

from .collectives import all_gather_objects, broadcast_object, global_rank, world_size
from .audit import SampleAudit
from .iterable import IterableDatasetShard
from .layout import ShardLayout
from .plan import BatchSamplerPlan, LocalPlan, PassRecord, ShardPlan, TagCollate, sized_length
from .rows import batch_rows, flatten, slice_rows
from .position import Position
from .rng import apply_rng_states, check_rng_types, rng_states
from .samplers import BatchSamplerShard, IndexSamplerShard
from .shuffle import SeedableRandomSampler, sampler_kind
from .transfer import send_to_device

__all__ = [
    "PreparedDataLoader", "DataLoaderShard", "LengthMismatchWarning", "stateful_dataloader_class", "stateful_variant",
    "DATALOADER_PRIVATES",
]

logger = logging.getLogger(__name__)

DATALOADER_PRIVATES: dict[str, str] = {
    "torch.utils.data.DataLoader._iterator": "the iterator a DataLoader with persistent workers keeps between "
    "passes: set to None where a pass needs new workers, and never pickled (also by the Lightning strategy)",
    "torch.utils.data.DataLoader._get_iterator": "compared by identity only: a subclass that overrides it may look "
    "ahead, so dispatch does not collate into shared memory for it",
}
"""Every private part of ``torch.utils.data.DataLoader`` shardplug touches (no public API resets a
persistent iterator); tests/test_loaders.py fails when torch drops one."""

_POSITION_KEY = "_shardplug_position"


def stateful_dataloader_class() -> type:
    """torchdata's ``StatefulDataLoader``, or an ``ImportError`` that says what to install."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as exc:
        raise ImportError(
            "use_stateful_dataloader=True needs torchdata>=0.8 (StatefulDataLoader): "
            "pip install 'shardplug[stateful]' or pip install 'torchdata>=0.8'"
        ) from exc
    return StatefulDataLoader


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


def _variant_instance(bases: tuple[type, ...]) -> Any:
    """Unpickling helper: an empty instance of the cached class deriving from ``bases``."""
    return object.__new__(combined_class(*bases))


class _Pass:
    """The state of one pass (one iteration of the loader), kept off ``DataLoader.__setattr__``
    (slow) on the per-batch path.  A new pass starts from a new object: nothing of a pass left
    early leaks into the next.

    ``batches_yielded`` counts this process's batches of the epoch, including those before a
    resume (``resumed``); ``consumed_at_start`` is how much of the epoch (in the plan's unit) was
    consumed before this pass started; ``total`` the pass's batches counted the same way (when known).
    """

    __slots__ = ("batches_yielded", "end_of_dataloader", "complete", "resumed", "consumed_at_start", "total",
                 "record", "batch_indices", "batch_real", "unlogged", "generator_state", "open", "length", "exhausted")

    def __init__(self, record: Optional[PassRecord] = None) -> None:
        self.open = False  # begun and not yet ended: len() is this pass's
        self.length: Optional[int] = None  # len() when the pass began (None: unknown), checked at its end
        self.exhausted = False  # the loop over it ended by itself (StopIteration)
        self.batches_yielded = 0
        self.end_of_dataloader = False
        self.complete = False
        self.resumed = 0
        self.consumed_at_start = 0
        self.total: Optional[int] = None
        self.record = record if record is not None else PassRecord()
        self.batch_indices: Optional[list[int]] = None
        self.batch_real: Optional[int] = None
        self.unlogged = 0  # records of batches a StatefulDataLoader fast-forwarded past
        self.generator_state: Optional[torch.Tensor] = None  # the shuffle generator's state at the pass start


class LengthMismatchWarning(UserWarning):
    """A pass yielded another number of batches than ``len()`` said when it began (as torch's
    ``DataLoader`` warns for an iterable dataset whose ``len()`` is wrong)."""


def _check_length(current: _Pass) -> None:
    """Compare what the pass ``current`` yielded with its ``len()``: a wrong length never passes silently."""
    yielded = current.batches_yielded - current.resumed
    if current.length is not None and yielded != current.length:
        warnings.warn(
            f"this pass of the prepared loader yielded {yielded} batches, but len() said {current.length} when it "
            "began; if the dataset's __len__ is right, please report this to shardplug (with the options used)",
            LengthMismatchWarning, stacklevel=3,
        )


def _is_stateful(loader: DataLoader) -> bool:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return isinstance(loader, StatefulDataLoader)


def _checked_first_batch(batches: Iterator[Any], shard: IterableDatasetShard) -> Iterator[Any]:
    """``batches``, with the processes' first global batches compared once the first one was read."""
    iterator = iter(batches)
    try:
        first = next(iterator)
    except StopIteration:
        shard.check_first_batch()
        return
    shard.check_first_batch()
    yield first
    yield from iterator


def _check_same_data(data: list[Any], rank: int) -> None:
    """Refuse processes whose (dataset length, batch size) differ (``data`` by rank): their passes would
    yield different numbers of batches, and the first collective after the shorter one would block
    until the process group's timeout."""
    other = next((j for j, theirs in enumerate(data) if theirs != data[0]), None)
    if other is None:
        return
    first, second = 0, other  # the same pair named on every process
    (n1, b1), (n2, b2) = data[first], data[second]
    what = (f"a dataset of {n1} samples on process {first} and of {n2} on process {second}" if n1 != n2 else
            f"batch_size={b1} on process {first} and batch_size={b2} on process {second}")
    raise ValueError(
        f"prepare_data_loader was given {what} (this is process {rank}); the processes would yield different "
        "numbers of batches and the first collective after the shorter pass (a DDP all-reduce) would block until "
        "the process group's timeout. Give every process the same dataset and batch size: shardplug gives each "
        "process its part"
    )


class PreparedDataLoader(DataLoader):
    """What every prepared loader does on top of ``DataLoader``.

    * at the start of each pass: advance the epoch if the previous pass was complete, agree
      shuffling seeds and synchronise the named RNGs from process 0;
    * per batch: move it to ``device``, know whether it is the last one (``end_of_dataloader``),
      and tell the run's gradient state (``gradient_state``, when set);
    * ``state_dict()`` / ``load_state_dict()``: the position in the epoch (a :class:`Position`).

    Which rows this process gets, ``len()`` and where a pass resumes are its :attr:`plan`'s
    (see ``plan.py``); the loader counts and delivers.
    """

    plan: ShardPlan

    def __new__(cls, *args: Any, use_stateful_dataloader: bool = False, **kwargs: Any) -> "PreparedDataLoader":
        if use_stateful_dataloader:
            cls = stateful_variant(cls)
        return super().__new__(cls)

    def __reduce_ex__(self, protocol: Any) -> Any:
        state = dict(self.__dict__)
        state["_iterator"] = None  # an open iterator (and its workers) does not travel
        state["_skipped_from"] = None  # a copy travels alone
        cls = type(self)
        if _VARIANTS.get(cls.__bases__) is cls:  # a class made by combined_class: rebuilt by its bases
            return _variant_instance, (cls.__bases__,), state
        return _variant_instance, ((cls,),), state

    # -- set-up ---------------------------------------------------------------------------
    def _setup_prepared(
        self,
        device: Union[str, torch.device, None] = None,
        rng_types: Optional[Iterable[str]] = None,
        synchronized_generator: Optional[torch.Generator] = None,
        skip_batches: int = 0,
        non_blocking: bool = False,
        plan: Optional[ShardPlan] = None,
    ) -> None:
        if not isinstance(skip_batches, int) or skip_batches < 0:
            raise ValueError(f"skip_batches={skip_batches!r} must be an integer >= 0")
        self.device = torch.device(device) if device is not None else None
        self.non_blocking = bool(non_blocking)
        self.rng_types = check_rng_types(rng_types)
        self.synchronized_generator = synchronized_generator
        self.gradient_state: Any = None
        self.epoch = 0
        self.plan = plan if plan is not None else self._default_plan()
        self._pass = _Pass()
        self._skip_pending = skip_batches  # shortens the next pass (skip_first_batches)
        self._skipped_from: Optional[PreparedDataLoader] = None  # the loader this one is a skip_first_batches copy of
        self._pending: Optional[Position] = None  # loaded, applied when the next pass starts
        self._inner_repositions = False  # a loaded StatefulDataLoader state does the resume skip itself
        self._stateful_snapshot: Optional[dict[str, Any]] = None
        self.audit: Optional[SampleAudit] = None
        self._tracking = False  # record indices and padding of every batch (track_padding)
        self._dropping_padding = False  # hand out the real rows only (drop_padding_rows)

    def _default_plan(self) -> ShardPlan:
        """The plan of a loader built directly (``prepare_data_loader`` passes its own)."""
        shard = self._batch_shard
        if shard is not None:
            return shard.plan
        if isinstance(self.dataset, IterableDatasetShard):
            return self.dataset.plan
        layout = ShardLayout(batch_size=self.batch_size, drop_last=bool(self.drop_last))
        try:
            length: Optional[int] = DataLoader.__len__(self)
        except (TypeError, NotImplementedError):
            length = None
        return LocalPlan(layout, length)

    @property
    def _batch_shard(self) -> Optional[BatchSamplerShard]:
        """The batch sampler shard (also when it was passed as ``sampler=``, or under an index shard)."""
        for candidate in (self.batch_sampler, getattr(self, "sampler", None)):
            if isinstance(candidate, BatchSamplerShard):
                return candidate
            if isinstance(candidate, IndexSamplerShard):
                return candidate.shard
        return None

    @property
    def end_of_dataloader(self) -> bool:
        """True while the last batch of the current pass is being processed."""
        return self._pass.end_of_dataloader

    @property
    def use_stateful_dataloader(self) -> bool:
        return _is_stateful(self)

    # -- epochs and RNG -------------------------------------------------------------------
    def _epoch_targets(self) -> list[Any]:
        """Every object under this loader with a ``set_epoch`` (a batch sampler's, its sampler's, the dataset's)."""
        candidates = [self.batch_sampler, getattr(self, "sampler", None), self.dataset]
        unique: list[Any] = []
        for target in candidates:
            if target is not None and hasattr(target, "set_epoch") and all(target is not u for u in unique):
                unique.append(target)
        return unique

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of this loader, its sampler, its batch sampler and its dataset."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch={epoch!r} must be an integer >= 0")
        self.epoch = epoch
        self._pass.complete = False
        for target in self._epoch_targets():
            target.set_epoch(epoch)

    def _seedable_samplers(self) -> list[SeedableRandomSampler]:
        candidates = [getattr(self, "sampler", None), getattr(self.plan, "sampler", None)]
        found: list[SeedableRandomSampler] = []
        for sampler in candidates:
            if isinstance(sampler, SeedableRandomSampler) and all(sampler is not f for f in found):
                found.append(sampler)
        return found

    def _shuffle_generator(self) -> Optional[torch.Generator]:
        """The generator a shuffling index sampler draws its order from (its ``generator``), if any."""
        sampler = getattr(self.plan, "sampler", None)
        if sampler is None or isinstance(sampler, SeedableRandomSampler):
            return None
        generator = getattr(sampler, "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    def _synchronize(self) -> None:
        """Agree unset shuffle seeds and the named RNG states with process 0 (one broadcast)."""
        unseeded = [s for s in self._seedable_samplers() if s.seed is None]
        names = self.rng_types
        if self.synchronized_generator is not None and "generator" not in names:
            names = names + ("generator",)
        if not unseeded and not names:
            return
        payload = None
        if global_rank() == 0:
            seeds = [s.resolve_seed() for s in unseeded]
            payload = (seeds, rng_states(names, self.synchronized_generator))
        seeds, states = broadcast_object(payload)
        for sampler, seed in zip(unseeded, seeds):
            sampler.seed = seed
        apply_rng_states(states, self.synchronized_generator)

    def agree_at_prepare(self, data: Optional[tuple[Optional[int], Optional[int]]]) -> None:
        """Agree unset shuffle seeds with process 0 now, in one all-gather that also compares every
        process's ``data`` (dataset length, batch size): a mismatch is a ``ValueError`` on every process.

        Only where a seed must be agreed (an unseeded shuffle and a process group): the collective then
        replaces the one the first pass would make (:meth:`_synchronize`), so there is none extra; without
        one nothing is compared (``data=None``: also where only process 0 reads, i.e. dispatch)."""
        unseeded = [s for s in self._seedable_samplers() if s.seed is None]
        if not unseeded or world_size() == 1:
            return
        seeds = [s.resolve_seed() for s in unseeded] if global_rank() == 0 else None
        everyone = all_gather_objects((seeds, data))
        for sampler, seed in zip(unseeded, everyone[0][0]):
            sampler.seed = seed
        if data is not None:
            _check_same_data([theirs for _, theirs in everyone], global_rank())

    # -- lengths --------------------------------------------------------------------------
    def _plan_length(self, consumed: int) -> int:
        """Batches of a pass that starts after ``consumed`` (``TypeError`` when unknown)."""
        length = self.plan.num_batches(consumed)
        if length is None:
            if self.plan.reads_ahead:  # the DataLoader's count is not the agreed one
                raise TypeError(
                    "the number of batches of this natively sharded stream is agreed while it is read (its parts "
                    "have no len(), or DataLoader workers split them in a way shardplug cannot count), so len() is "
                    "unknown"
                )
            return super().__len__()  # the DataLoader's own answer, or its TypeError
        return length

    def __len__(self) -> int:
        """Batches the pass yields: the pass in progress while one is open, else the next one
        (exact also after ``load_state_dict`` and ``skip_first_batches``)."""
        current = self._pass
        if current.open:
            return max(self._plan_length(current.consumed_at_start), 0)
        consumed = self._pending.consumed if self._pending is not None else 0
        return max(self._plan_length(consumed) - self._skip_pending, 0)

    @property
    def total_batch_size(self) -> Optional[int]:
        """Samples per step over all processes (``None`` for variable-size batches)."""
        return self.plan.layout.step_batch_size

    @property
    def total_dataset_length(self) -> Optional[int]:
        dataset = self.dataset.dataset if isinstance(self.dataset, IterableDatasetShard) else self.dataset
        return sized_length(dataset)

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch (0 when it is full, as with ``drop_last``; -1 when
        unknown): the last step of the pass in progress, else of the next pass. A pass that resumed a position of another
        number of processes (or was shortened by a skip) starts at another place in the epoch's
        steps, so its last step holds another number of samples than an uninterrupted epoch's."""
        length, total = self.total_dataset_length, self.total_batch_size
        if length is None or not total:
            return -1
        if self.plan.layout.drop_last:
            return 0  # a short last step is dropped: the last one is full
        before = self.plan.samples_before(self._pass_start())
        return max(length - (before or 0), 0) % total

    def _pass_start(self) -> int:
        """Where (in the plan's unit) the pass in progress started, or where the next one starts."""
        if self._pass.open:
            return self._pass.consumed_at_start
        consumed = self._pending.consumed if self._pending is not None else 0
        return consumed + self._skip_pending * self.plan.consumed_per_batch

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _inner_batches(self, discard: int) -> Iterator[Any]:
        """The batches of this pass, after ``discard`` of them were read and dropped (subclasses)."""
        raise NotImplementedError

    def _begin_pass(self) -> tuple[_Pass, int]:
        """Start a pass: its state, and how many batches to read and drop before the first one."""
        if self._pass.complete:
            self.set_epoch(self.epoch + 1)
        self._synchronize()
        if isinstance(self.dataset, IterableDatasetShard):
            self.dataset.begin_pass()
        current = _Pass(PassRecord(track=self._tracking))
        generator = self._shuffle_generator()
        if generator is not None:
            current.generator_state = generator.get_state()
        discard = 0
        pending, self._pending = self._pending, None
        if pending is not None:
            discard = self._start_after(pending, current)
        skip, self._skip_pending = self._skip_pending, 0
        if skip:  # skip_first_batches: this pass starts that many batches later still
            current.consumed_at_start += skip * self.plan.consumed_per_batch
            current.resumed += skip
            if self.use_stateful_dataloader and self._inner_state_resumes():  # read through it: its state counts them
                discard += skip
                if current.record.batches is not None:
                    current.unlogged += skip  # their records are not the batches handed out
            elif self._workers_split_stream():  # only whole batches tell where each worker is: read and drop them
                discard += skip
            else:
                discard = self.plan.start_after(current.consumed_at_start)
        current.batches_yielded = current.resumed
        current.open = True
        current.record.started_at = current.consumed_at_start
        current.total = self._pass_total(current)
        shard = self._batch_shard
        if shard is not None:
            shard.record_next_pass(current.record)
        self._pass = current
        origin = self._skipped_from
        while origin is not None:  # the loader it was skipped from follows this pass (its epoch, its position)
            origin.epoch, origin._pass, origin._pending, origin._skip_pending = self.epoch, current, None, 0
            origin = origin._skipped_from
        try:
            current.length = len(self)
        except TypeError:
            current.length = None
        return current, discard

    def _pass_total(self, current: _Pass) -> Optional[int]:
        """The epoch's batches counted up to the end of pass ``current``, when known without
        looking ahead (map-style data with a sized batch sampler)."""
        if isinstance(self.dataset, IterableDataset):
            return None
        try:
            return current.resumed + self._plan_length(current.consumed_at_start)
        except TypeError:  # a batch sampler without __len__
            return None

    def _iterate(self) -> Iterator[Any]:
        current, discard = self._begin_pass()
        self._inner_repositions = False
        state = self.gradient_state
        if state is not None:
            state._loader_started(self)
        try:
            batches = self.plan.pass_batches(self._inner_batches(discard), current.record)
            if isinstance(self.dataset, IterableDatasetShard) and self.dataset.num_processes > 1 and world_size() > 1:
                batches = _checked_first_batch(batches, self.dataset)
            yield from self._deliver(batches, current)
            current.complete = current.exhausted = True
            _check_length(current)
        finally:
            current.open = False
            self._stateful_snapshot = None
            if state is not None:
                state._loader_stopped(self)

    def _deliver(self, batches: Iterator[Any], current: _Pass) -> Iterator[Any]:
        """The pass's batches as handed out: the last one known from the exact length, else by
        reading one ahead."""
        if current.total is not None:
            return self._deliver_counted(batches, current)
        return self._deliver_lookahead(batches, current)

    def _hand_out(self, batch: Any, current: _Pass, count: int, last: bool) -> Any:
        current.batches_yielded = count
        if last:
            current.end_of_dataloader = current.complete = True
        if self._tracking:
            current.batch_indices, current.batch_real = self._batch_record(current)
            if self.audit is not None:
                self.audit.record(self.epoch, current.batch_indices, current.batch_real)
            if self._dropping_padding:
                batch = _leading_rows(batch, current.batch_real)
        if self.gradient_state is not None:
            self.gradient_state._batch_ready(self, last)
        return send_to_device(batch, self.device, self.non_blocking) if self.device is not None else batch

    def _deliver_counted(self, batches: Iterator[Any], current: _Pass) -> Iterator[Any]:
        count, total = current.batches_yielded, current.total
        if self.gradient_state is None and self.device is None and not self._tracking:
            # the hot path: bookkeeping only
            for batch in batches:
                count += 1
                current.batches_yielded = count
                if count >= total:  # type: ignore[operator]
                    current.end_of_dataloader = current.complete = True
                yield batch
            return
        for batch in batches:
            count += 1
            yield self._hand_out(batch, current, count, count >= total)  # type: ignore[operator]

    def _deliver_lookahead(self, batches: Iterator[Any], current: _Pass) -> Iterator[Any]:
        iterator = iter(batches)
        stateful = self.use_stateful_dataloader
        count = current.batches_yielded
        for upcoming in iterator:
            break
        else:
            return
        while True:
            batch = upcoming
            if stateful:  # the state after ``batch``, before the look-ahead fetch
                self._stateful_snapshot = self._inner_state_dict()
            try:
                upcoming = next(iterator)
            except StopIteration:
                yield self._hand_out(batch, current, count + 1, True)
                return
            count += 1
            yield self._hand_out(batch, current, count, False)

    # -- position -------------------------------------------------------------------------
    def _inner_state_dict(self) -> dict[str, Any]:
        return super(PreparedDataLoader, self).state_dict()  # type: ignore[misc]

    def _sampler_kind(self) -> str:
        if isinstance(self.dataset, IterableDataset):
            return "stream"
        return sampler_kind(getattr(self.plan, "sampler", None) or getattr(self, "sampler", None))

    def position(self) -> dict[str, Any]:
        """Where this loader stands, as plain values identical on every process (what
        :meth:`state_dict` returns without a ``StatefulDataLoader``; see :class:`Position`)."""
        return self.current_position().to_dict()

    def current_position(self) -> Position:
        """Where this loader stands: identical on every process (see :class:`Position`).

        ``consumed`` counts what the whole job consumed of the epoch (in the plan's unit: global
        batches, stream elements or batches), so a position saved with N processes can be loaded with M.
        """
        if self._pending is not None:  # loaded but not iterated yet: still that position
            return self._pending
        return self._pass_position()

    def _pass_position(self) -> Position:
        """Where the last pass stands, in this loader's own layout (a loaded position aside)."""
        current, layout = self._pass, self.plan.layout
        generator = self._shuffle_generator()
        epoch, done, dataset_state = self.epoch, current.batches_yielded, None
        consumed = current.consumed_at_start + (done - current.resumed) * self.plan.consumed_per_batch
        generator_state = current.generator_state
        # A pass is over for every process once none has a batch left. A process with fewer batches
        # (even_batches=False) reports the same place as the others until its loop has ended by itself,
        # then the epoch's end (the others finish theirs before they meet it again).
        finished = self.plan.finished(consumed)
        if finished is None:  # unknown lengths: where every process yields as many batches, all end together
            finished = layout.pads or layout.drop_last or layout.num_processes == 1
        if current.complete and (current.exhausted or finished):
            epoch, done, consumed = epoch + 1, 0, 0
            generator_state = generator.get_state() if generator is not None else None
        elif isinstance(self.dataset, IterableDatasetShard) and self.dataset.repositions_itself:
            dataset_state = self.dataset.state_at(consumed)  # the dataset's own position
        if generator_state is None and generator is not None:
            generator_state = generator.get_state()
        return Position(
            epoch=epoch, batches_yielded=done, consumed=consumed, unit=self.plan.unit,
            num_processes=layout.num_processes, split_batches=layout.split_batches,
            even_batches=layout.even_batches, drop_last=layout.drop_last,
            dataset_length=None if isinstance(self.dataset, IterableDataset) else self.total_dataset_length,
            batch_size=layout.batch_size, process_batch_size=layout.process_batch_size, step_batch_size=layout.step_batch_size,
            sampler=self._sampler_kind(), num_workers=self.num_workers,
            seeds=tuple(s.seed for s in self._seedable_samplers()), generator_state=generator_state,
            dataset_state=dataset_state,
        )

    def _same_layout_length(self) -> Optional[int]:
        try:
            return self._plan_length(0)
        except TypeError:
            return None

    @property
    def epoch_length(self) -> Optional[int]:
        """Batches of a whole epoch on this loader's layout (``None`` when unknown: a stream without
        ``len()``); ``len(loader)`` is the next pass's, shorter after a resume."""
        return self._same_layout_length()

    @property
    def resumed_batches(self) -> int:
        """Batches of the epoch that a resumed pass does not yield, counted on this layout: after
        ``load_state_dict`` (also of a position saved with another number of processes),
        ``epoch_length - len(loader)``, and the same while that pass runs; 0 for a pass that
        started at the epoch's beginning. Front ends set their own counters from it (an engine's
        iteration, a trainer's batch progress)."""
        total = self.epoch_length
        if total is None:
            return 0
        try:
            rest = len(self) if self._pending is not None else self._plan_length(self._pass.consumed_at_start)
        except TypeError:
            return 0
        return max(total - rest, 0)

    def load_position(self, position: Union[Position, dict[str, Any]]) -> None:
        """Continue from ``position`` at the next pass (see :meth:`position`); it is validated
        first, and nothing changes when it is refused."""
        if not isinstance(position, Position):
            position = Position.from_dict(position)
        self._check_loadable(position, stateful=False)
        self._apply_position(position)

    def _apply_position(self, position: Position) -> None:
        """Continue from ``position`` (already checked) at the next pass."""
        for sampler, seed in zip(self._seedable_samplers(), position.seeds):
            sampler.seed = seed
        generator = self._shuffle_generator()
        if generator is not None and position.generator_state is not None:
            generator.set_state(position.generator_state.clone())
        self.set_epoch(position.epoch)
        self._pending = position
        self._skip_pending = 0

    def resume_at(self, epoch: int, batches_yielded: int, seeds: Optional[Iterable[Optional[int]]] = None) -> None:
        """Continue in ``epoch`` after this process's first ``batches_yielded`` batches, with this
        loader's layout (a front end that counts batches itself, e.g. an engine's iteration)."""
        here = self.current_position()
        self.load_position(here.replace(
            epoch=epoch, batches_yielded=batches_yielded, consumed=batches_yielded * self.plan.consumed_per_batch,
            seeds=tuple(here.seeds if seeds is None else seeds), dataset_state=None,
        ))

    def _check_loadable(self, position: Position, stateful: bool) -> None:
        """Everything that refuses ``position`` for this loader, before anything changes."""
        current, processes = self._pass_position(), self.plan.layout.num_processes
        at_start = (position.consumed, position.batches_yielded) == (0, 0)  # nothing to share out anew
        if position.num_processes != processes and position.unit == current.unit and not at_start:
            self._refuse_resize(position, stateful and self._inner_state_resumes())
        self._check_workers(position)
        if self._workers_split_stream():
            if position.consumed and not stateful:
                raise ValueError(
                    f"with num_workers={self.num_workers} each DataLoader worker reads its own part of this stream, so "
                    f"the place after {position.consumed} elements cannot be found by skipping elements; resume at an "
                    "epoch's start (a position saved after a complete pass), save and resume with num_workers=0, or "
                    "build both loaders with use_stateful_dataloader=True (each worker's place is saved; same numbers "
                    "of processes and workers)"
                )
        position.check_resumable(current, self.plan.epoch_size(), self._same_layout_length())

    def _check_workers(self, position: Position) -> None:
        """Refuse a position inside an epoch whose place depends on the number of DataLoader workers
        (the loader's batches are read again and dropped, and the workers make them in their own
        order: a natively sharded stream, a stream that splits itself across workers) when it was saved
        with another number of workers than this loader's."""
        inside = (position.consumed, position.batches_yielded) != (0, 0)
        dataset = self.dataset
        splits = isinstance(dataset, IterableDatasetShard) and dataset.splits_by_worker
        if not inside or not (splits or position.unit == "batches") or position.num_workers == self.num_workers:
            return
        if position.num_workers is None:
            raise ValueError(
                "the position was saved by a shardplug that did not record its DataLoader's num_workers, and this "
                "stream's place inside an epoch depends on it (each worker makes its own batches); resume from a "
                "position saved at an epoch's end, or with a position saved by this shardplug"
            )
        raise ValueError(
            f"the position was saved with num_workers={position.num_workers} and this loader has "
            f"num_workers={self.num_workers}: each DataLoader worker makes its own batches of this stream, so its "
            f"place inside an epoch depends on the number of workers; resume with num_workers={position.num_workers}, "
            "or from a position saved at an epoch's end"
        )

    def _workers_split_stream(self) -> bool:
        """A stream read by every process that splits itself across this loader's DataLoader workers:
        where each worker is cannot be found by skipping stream elements."""
        dataset = self.dataset
        return isinstance(dataset, IterableDatasetShard) and dataset.splits_by_worker and self.num_workers > 0

    def _refuse_resize(self, position: Position, inner_state: bool) -> None:
        """Refuse a position inside an epoch, of another number of processes, where this loader cannot resize
        (``inner_state``: a StatefulDataLoader's own state, each process's, is what resumes it)."""
        moves = f"cannot move from {position.num_processes} to {self.plan.layout.num_processes} processes"
        anew = (f"resume with num_processes={position.num_processes}, or from a position saved at an epoch's end (it "
                "loads into any number of processes)")
        if self.plan.reads_ahead or self.plan.unit == "batches":
            raise ValueError(
                "this stream is sharded natively (each process reads its own shards) or read by one process, so its "
                f"position counts this process's batches, and a position inside an epoch {moves}; {anew}"
            )
        if self._workers_split_stream():
            raise ValueError(
                f"with num_workers={self.num_workers} each DataLoader worker reads its own part of this stream (it splits "
                "itself across workers), so its place is found by reading whole batches of the layout that saved it, "
                f"and a position inside an epoch {moves}; {anew}"
            )
        if inner_state:
            raise ValueError(
                "use_stateful_dataloader=True resumes this stream from each process's own saved state (its "
                f"DataLoader workers' places), which {moves}; {anew}"
            )

    def _start_after(self, position: Position, current: _Pass) -> int:
        """Position the pass ``current`` after what ``position`` consumed; return batches to read and drop."""
        layout = self.plan.layout
        same_layout = (position.num_processes, position.split_batches) == (layout.num_processes, layout.split_batches)
        current.consumed_at_start = position.consumed
        if self._inner_repositions:  # a StatefulDataLoader that loaded its own state
            current.resumed = position.batches_yielded
            if current.record.batches is not None and isinstance(self.plan, BatchSamplerPlan):
                current.unlogged = current.resumed  # its batch sampler logged the batches it fast-forwarded past
            return 0
        if same_layout:
            current.resumed = position.batches_yielded
            if self._workers_split_stream():  # only whole batches tell where each worker is: read and drop them
                return position.batches_yielded
        else:
            full, rest = self.plan.num_batches(0), self.plan.num_batches(position.consumed)
            current.resumed = full - rest if full is not None and rest is not None else (
                position.consumed // self.plan.consumed_per_batch
            )
        return self.plan.start_after(position.consumed, position.dataset_state)

    def _skipped_copy(self, num_batches: int) -> "PreparedDataLoader":
        """A copy of this loader whose next pass starts after its first ``num_batches`` batches
        (what :func:`~shardplug.core.prepare.skip_first_batches` returns): the same settings,
        plan, epoch and position. This loader follows the copy's passes (its epoch and position), so
        it continues with the next epoch once the copy's pass is over.

        Not a pickled copy (which drops what belongs to this process, e.g. a dispatcher's process
        group): every attribute is shared as it is, so what a subclass keeps in one object (a
        dispatcher's wire state) stays one for both, and using the copy for one pass and this loader
        afterwards keeps them in step with the other processes.
        """
        if not isinstance(num_batches, int) or isinstance(num_batches, bool) or num_batches < 0:
            raise ValueError(f"num_batches={num_batches!r} must be an integer >= 0")
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__["_iterator"] = None  # an open iterator (and its workers) stays this loader's
        new._pass = copy.copy(self._pass)
        new._pass.open = False
        new._skip_pending = num_batches
        new._skipped_from = self  # this loader follows the copy's passes (the next epoch comes after the copy's)
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
        if self.plan.untracked_reason is not None:
            raise ValueError(self.plan.untracked_reason)
        self._tag_padding()
        self._tracking = True

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
        self.track_padding()
        self._dropping_padding = True

    def _tag_padding(self) -> None:
        """Where the plan cannot compute the batches' places (a stream without ``len()``, or one that
        splits itself across workers), its readers tag each element and the collation hands the tags on."""
        plan = self.plan
        if not plan.needs_tags or plan.tags:  # type: ignore[attr-defined]
            return
        plan.tags = True  # type: ignore[attr-defined]
        self.collate_fn = TagCollate(self.collate_fn)
        self._iterator = None  # persistent workers would keep their untagged copies

    def _batch_record(self, current: _Pass) -> tuple[list[int], int]:
        """(indices, real count) of the batch being handed out."""
        record = current.record
        if record.batches is not None:
            while current.unlogged:  # batches a StatefulDataLoader fast-forwarded past
                record.batches.popleft()
                current.unlogged -= 1
        return self.plan.batch_record(record, current.batches_yielded - current.resumed - 1)

    @property
    def batch_indices(self) -> Optional[list[int]]:
        """Dataset indices of the batch being processed (with :meth:`track_padding`)."""
        return self._pass.batch_indices

    @property
    def batch_real_count(self) -> Optional[int]:
        """How many leading samples of the batch being processed are real; the rest are
        wrap-around padding (with :meth:`track_padding`; ``None`` otherwise)."""
        return self._pass.batch_real

    def enable_audit(self) -> SampleAudit:
        """Start recording which samples this process consumes, per epoch (opt-in; see :class:`SampleAudit`)."""
        self.track_padding()
        if not self.plan.identifies_samples:
            raise ValueError(
                "this loader's batches carry no sample ids shardplug knows (a stream that shards itself, one without "
                "len(), or one that splits itself across DataLoader workers): padding is marked in "
                "loader.batch_real_count, but an audit needs ids; audit a map-style dataset or a sized stream read by "
                "every process"
            )
        if self.audit is None:
            self.audit = SampleAudit(self.total_dataset_length)
        return self.audit

    def state_dict(self) -> dict[str, Any]:
        """Resume state: after ``load_state_dict`` iteration continues after the last batch handed out."""
        position = self.position()
        if not self.use_stateful_dataloader:
            return position
        if (position["consumed"], position["batches_yielded"]) == (0, 0):
            # an epoch's start: the position alone resumes it (asking the StatefulDataLoader would start an
            # iterator, which draws from the shuffle's generator)
            return {_POSITION_KEY: position}
        snapshot = self._stateful_snapshot
        inner = dict(snapshot) if snapshot is not None else self._inner_state_dict()
        inner[_POSITION_KEY] = position
        return inner

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.use_stateful_dataloader:  # a StatefulDataLoader's state too: its position
            self.load_position(state_dict.get(_POSITION_KEY, state_dict) if isinstance(state_dict, dict) else state_dict)
            return
        state = dict(state_dict)
        if _POSITION_KEY not in state:
            raise ValueError(
                f"this loader is backed by a StatefulDataLoader and its state has no {_POSITION_KEY!r} key; "
                "pass what its state_dict() returned"
            )
        position = Position.from_dict(state.pop(_POSITION_KEY))
        self._check_loadable(position, stateful=True)
        if self._position_suffices(position):
            self._apply_position(position)  # shardplug's own skip (exact) repositions the next pass
            return
        super(PreparedDataLoader, self).load_state_dict(state)  # type: ignore[misc]
        self._apply_position(position)
        self._inner_repositions = True

    def _position_suffices(self, position: Position) -> bool:
        """Whether ``position`` alone resumes this StatefulDataLoader exactly (its own state is then not
        loaded, and the position may come from another number of processes): at an epoch's start (the
        state may still describe the end of the previous pass), and wherever the inner state does not
        resume a pass (:meth:`_inner_state_resumes`)."""
        return (position.consumed, position.batches_yielded) == (0, 0) or not self._inner_state_resumes()

    def _inner_state_resumes(self) -> bool:
        """Whether the StatefulDataLoader's own state is where a resumed pass continues (else it is not
        loaded, and the position's own skip, which is exact, repositions the pass).  Not for:

        * map-style data without a ``state_dict()`` of its own: the plan starts after any batch by index;
        * a stream whose state only counts batches (:meth:`_inner_state_only_counts`): torchdata (0.11)
          counts them twice after a resume, so a second resume would skip batches;
        * a plan that reads batches ahead of those handed out (a natively sharded stream agrees its step
          counts a few batches ahead: the inner state is past the place).
        """
        if not isinstance(self.dataset, IterableDataset) and not callable(getattr(self.dataset, "state_dict", None)):
            return False
        return not self._inner_state_only_counts() and not self.plan.reads_ahead

    def _inner_state_only_counts(self) -> bool:
        """A stream without ``state_dict()`` (also each worker's copy): the StatefulDataLoader's state
        holds nothing but how many batches it (each worker) yielded."""
        return isinstance(self.dataset, IterableDataset) and not callable(getattr(self.dataset, "state_dict", None))


def _leading_rows(batch: Any, real: Optional[int]) -> Any:
    """The first ``real`` rows of ``batch`` (unchanged when it has no more)."""
    if real is None:
        return batch
    rows = batch_rows(flatten(batch)[0])
    if rows is None or rows <= real:
        return batch
    return slice_rows(batch, slice(0, real))


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
        device: Union[str, torch.device, None] = None,
        rng_types: Optional[Iterable[str]] = None,
        synchronized_generator: Optional[torch.Generator] = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        non_blocking: bool = False,
        **dataloader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, **dataloader_kwargs)
        self._finish_init(device, rng_types, synchronized_generator, skip_batches, non_blocking)

    def _finish_init(
        self,
        device: Union[str, torch.device, None],
        rng_types: Optional[Iterable[str]],
        synchronized_generator: Optional[torch.Generator],
        skip_batches: int,
        non_blocking: bool,
        plan: Optional[ShardPlan] = None,
    ) -> None:
        # Own the (batch) sampler so skipping and resuming never load a skipped batch.
        if not isinstance(self.dataset, IterableDataset):
            if self.batch_sampler is not None and not isinstance(self.batch_sampler, BatchSamplerShard):
                object.__setattr__(self, "batch_sampler", BatchSamplerShard(self.batch_sampler))
            elif self.batch_sampler is None and not isinstance(self.sampler, (BatchSamplerShard, IndexSamplerShard)):
                object.__setattr__(self, "sampler", IndexSamplerShard(self.sampler))
            if isinstance(self.batch_sampler, BatchSamplerShard):  # what DataLoader reports for a batch sampler
                object.__setattr__(self, "batch_size", self.batch_sampler.per_process_batch_size)
                object.__setattr__(self, "drop_last", self.batch_sampler.drop_last)
        self._setup_prepared(device, rng_types, synchronized_generator, skip_batches, non_blocking, plan)
        for target in self._epoch_targets():
            target.set_epoch(0)

    def _inner_batches(self, discard: int) -> Iterator[Any]:
        in_workers = self.num_workers > 0 and isinstance(self.dataset, IterableDatasetShard)
        if in_workers and self.persistent_workers and self.dataset.plan.pending_start != (0, None):
            # persistent workers hold their copies of the stream shard from when they started: a resume
            # point set since cannot reach them, so this pass gets new workers (DataLoader's _iterator)
            self._iterator = None
        batches = super(PreparedDataLoader, self).__iter__()
        if in_workers:
            # The workers started with their copies of the stream shard, and its one-shot start
            # with them: this process's copy must not carry it into the next pass.
            self.dataset.plan.take_start()
        for _ in zip(range(discard), batches):
            pass  # read, but never handed out (data that shardplug cannot skip by index)
        return batches
