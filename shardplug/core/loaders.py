"""Prepared data loaders: what each process iterates.

:class:`PreparedDataLoader` holds what every prepared loader does (epochs, RNG agreement,
device transfer, knowing the last batch, the resume position); :class:`DataLoaderShard` is the
loader whose sampler or dataset is already sharded.  The dispatcher lives in ``dispatch.py``.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Iterable, Iterator, Optional, Union

import torch
from torch.utils.data import DataLoader, IterableDataset

from .collectives import broadcast_object, global_rank
from .audit import SampleAudit
from .iterable import IterableDatasetShard
from .rng import apply_rng_states, check_rng_types, rng_states
from .samplers import BatchSamplerShard, SeedableRandomSampler
from .transfer import send_to_device

__all__ = ["PreparedDataLoader", "DataLoaderShard", "stateful_dataloader_class", "stateful_variant"]

logger = logging.getLogger(__name__)

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


class _Progress:
    """Per-pass bookkeeping, kept off ``DataLoader.__setattr__`` (slow) on the per-batch path.

    ``batches_yielded`` counts this process's batches of the epoch, including those before a
    resume (``resumed``); ``consumed_at_start`` is how much of the epoch (in the position's unit)
    was consumed before this pass started.
    """

    __slots__ = ("batches_yielded", "end_of_dataloader", "pass_complete", "resumed", "consumed_at_start",
                 "batch_indices", "batch_real", "unlogged")

    def __init__(self) -> None:
        self.batches_yielded = 0
        self.end_of_dataloader = False
        self.pass_complete = False
        self.resumed = 0
        self.consumed_at_start = 0
        self.batch_indices: Optional[list[int]] = None
        self.batch_real: Optional[int] = None
        self.unlogged = 0  # log entries of batches a StatefulDataLoader fast-forwarded past


def _is_stateful(loader: DataLoader) -> bool:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return isinstance(loader, StatefulDataLoader)


class PreparedDataLoader(DataLoader):
    """What every prepared loader does on top of ``DataLoader``.

    * at the start of each pass: advance the epoch if the previous pass was complete, agree
      shuffling seeds and synchronise the named RNGs from process 0;
    * per batch: move it to ``device``, know whether it is the last one (``end_of_dataloader``),
      and tell the run's gradient state (``gradient_state``, when set);
    * ``state_dict()`` / ``load_state_dict()``: the position in the epoch.
    """

    def __new__(cls, *args: Any, use_stateful_dataloader: bool = False, **kwargs: Any) -> "PreparedDataLoader":
        if use_stateful_dataloader:
            cls = stateful_variant(cls)
        return super().__new__(cls)

    # -- set-up ---------------------------------------------------------------------------
    def _setup_prepared(
        self,
        device: Union[str, torch.device, None] = None,
        rng_types: Optional[Iterable[str]] = None,
        synchronized_generator: Optional[torch.Generator] = None,
        skip_batches: int = 0,
        non_blocking: bool = False,
    ) -> None:
        if not isinstance(skip_batches, int) or skip_batches < 0:
            raise ValueError(f"skip_batches={skip_batches!r} must be an integer >= 0")
        self.device = torch.device(device) if device is not None else None
        self.non_blocking = bool(non_blocking)
        self.rng_types = check_rng_types(rng_types)
        self.synchronized_generator = synchronized_generator
        self.gradient_state: Any = None
        self.epoch = 0
        self._progress = _Progress()
        self._skip_pending = skip_batches  # shortens this pass (skip_first_batches)
        self._resume: Optional[dict[str, Any]] = None  # continues a pass (load_state_dict); len() stays the epoch's
        self._inner_repositions = False  # a loaded StatefulDataLoader state does the resume skip itself
        self._stateful_snapshot: Optional[dict[str, Any]] = None
        self.audit: Optional[SampleAudit] = None
        self._tracking = False  # record indices and padding of every batch (track_padding)

    @property
    def end_of_dataloader(self) -> bool:
        """True while the last batch of the current pass is being processed."""
        return self._progress.end_of_dataloader

    @property
    def _advance_pending(self) -> bool:
        return self._progress.pass_complete

    @property
    def use_stateful_dataloader(self) -> bool:
        return _is_stateful(self)

    # -- epochs and RNG -------------------------------------------------------------------
    def _epoch_targets(self) -> list[Any]:
        targets = [self.batch_sampler, getattr(self, "sampler", None), self.dataset]
        seen: set[int] = set()
        unique = []
        for target in targets:
            if target is not None and id(target) not in seen and hasattr(target, "set_epoch"):
                seen.add(id(target))
                unique.append(target)
        return unique

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of this loader, its sampler, its batch sampler and its dataset."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch={epoch!r} must be an integer >= 0")
        self.epoch = epoch
        self._progress.pass_complete = False
        for target in self._epoch_targets():
            target.set_epoch(epoch)

    def _seedable_samplers(self) -> list[SeedableRandomSampler]:
        candidates = [getattr(self, "sampler", None), getattr(self.batch_sampler, "sampler", None)]
        found: list[SeedableRandomSampler] = []
        for sampler in candidates:
            if isinstance(sampler, SeedableRandomSampler) and all(sampler is not f for f in found):
                found.append(sampler)
        return found

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

    # -- lengths and bookkeeping ----------------------------------------------------------
    @property
    def _batch_shard(self) -> Optional[BatchSamplerShard]:
        """The batch sampler shard (also when it was passed as ``sampler=`` with ``batch_size=None``)."""
        for candidate in (self.batch_sampler, getattr(self, "sampler", None)):
            if isinstance(candidate, BatchSamplerShard):
                return candidate
        return None

    def _full_length(self) -> int:
        """Batches in one pass of this process (from a resume point set on the shard, if any)."""
        shard = self._batch_shard
        if shard is not None and not self._dataset_kind_is_iterable():
            return len(shard)
        return super().__len__()

    def __len__(self) -> int:
        return max(self._full_length() - self._skip_pending, 0)

    def _pass_length(self) -> Optional[int]:
        """Exact batches per pass when known without looking ahead, else ``None``."""
        if self._dataset_kind_is_iterable():
            return None
        try:
            return self._full_length()
        except TypeError:  # a batch sampler without __len__
            return None

    def _dataset_kind_is_iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)

    @property
    def total_batch_size(self) -> Optional[int]:
        """Samples per optimizer step over all processes (``None`` for variable-size batches)."""
        sampler = self._batch_shard
        if sampler is not None:
            if sampler.batch_size is None:
                return None
            return sampler.batch_size if sampler.split_batches else sampler.batch_size * sampler.num_processes
        if isinstance(self.dataset, IterableDatasetShard):
            return self.dataset.global_batch_size
        return self.batch_size

    @property
    def total_dataset_length(self) -> Optional[int]:
        dataset = self.dataset.dataset if isinstance(self.dataset, IterableDatasetShard) else self.dataset
        return len(dataset) if hasattr(dataset, "__len__") else None

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch (0 when it is full, -1 when unknown)."""
        length, total = self.total_dataset_length, self.total_batch_size
        if length is None or not total:
            return -1
        return length % total

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _inner_batches(self, skip: int) -> Iterator[Any]:
        """The batches of this pass, after ``skip`` of them were left out (subclasses)."""
        raise NotImplementedError

    def _begin_pass(self) -> tuple[int, int, int]:
        """Start a pass; return (batches of the epoch counted before the first one, batches to
        discard, batches this pass's length leaves out because a resume point was set)."""
        if self._advance_pending:
            self.set_epoch(self.epoch + 1)
        self._synchronize()
        progress = self._progress
        progress.resumed = progress.consumed_at_start = progress.unlogged = 0
        discard = offset = 0
        resume, self._resume = self._resume, None
        if resume is not None:
            discard, offset = self._apply_resume(resume)
        skip, self._skip_pending = self._skip_pending, 0
        progress.batches_yielded = progress.resumed + skip
        progress.end_of_dataloader = False
        return progress.batches_yielded + discard, skip + discard, offset

    def _iterate(self) -> Iterator[Any]:
        count, skip, offset = self._begin_pass()
        total = self._pass_length()
        if total is not None:
            total += offset
        state = self.gradient_state
        if state is not None:
            state._loader_started(self)
        try:
            batches = self._inner_batches(skip)
            if total is not None:
                yield from self._deliver_counted(batches, count, total)
            else:
                yield from self._deliver_lookahead(batches, count)
            self._progress.pass_complete = True
        finally:
            self._stateful_snapshot = None
            if state is not None:
                state._loader_stopped(self)

    def _hand_out(self, batch: Any, count: int, last: bool) -> Any:
        progress = self._progress
        progress.batches_yielded = count
        if last:
            progress.end_of_dataloader = progress.pass_complete = True
        if self._tracking:
            progress.batch_indices, progress.batch_real = self._batch_record(last)
            if self.audit is not None:
                self.audit.record(self.epoch, progress.batch_indices, progress.batch_real)
        if self.gradient_state is not None:
            self.gradient_state._batch_ready(self, last)
        return send_to_device(batch, self.device, self.non_blocking) if self.device is not None else batch

    def _deliver_counted(self, batches: Iterator[Any], count: int, total: int) -> Iterator[Any]:
        if self.gradient_state is None and self.device is None and not self._tracking:
            # the hot path: bookkeeping only
            progress = self._progress
            for batch in batches:
                count += 1
                progress.batches_yielded = count
                if count >= total:
                    progress.end_of_dataloader = progress.pass_complete = True
                yield batch
            return
        for batch in batches:
            count += 1
            yield self._hand_out(batch, count, count >= total)

    def _deliver_lookahead(self, batches: Iterator[Any], count: int) -> Iterator[Any]:
        iterator = iter(batches)
        stateful = self.use_stateful_dataloader
        for current in iterator:
            break
        else:
            return
        while True:
            if stateful:  # the state after ``current``, before the look-ahead fetch
                self._stateful_snapshot = self._inner_state_dict()
            try:
                upcoming = next(iterator)
            except StopIteration:
                count += 1
                yield self._hand_out(current, count, True)
                return
            count += 1
            yield self._hand_out(current, count, False)
            current = upcoming

    # -- position -------------------------------------------------------------------------
    def _inner_state_dict(self) -> dict[str, Any]:
        return super(PreparedDataLoader, self).state_dict()  # type: ignore[misc]

    def _position_unit(self) -> str:
        """What the position counts: global batches (map-style), stream elements (a sharded
        iterable dataset) or this loader's batches (anything else; not resizable)."""
        if isinstance(self.dataset, IterableDatasetShard):
            return "elements"
        if self._batch_shard is not None and not self._dataset_kind_is_iterable():
            return "global_batches"
        return "batches"

    def _consumed_per_batch(self) -> int:
        """How much of the epoch, in the position's unit, one batch of this process stands for."""
        if isinstance(self.dataset, IterableDatasetShard):
            return self.dataset.global_batch_size
        shard = self._batch_shard
        if shard is not None and not self._dataset_kind_is_iterable():
            return shard.batches_per_step
        return 1

    def _layout_key(self) -> tuple[int, bool]:
        """(data processes, split_batches) of this loader, as recorded in a position."""
        prepared = self.__dict__.get("_data_layout")  # set by prepare_data_loader
        if prepared is not None:
            return prepared
        for source in (self, self._batch_shard, self.dataset):
            if source is not None and hasattr(source, "num_processes") and hasattr(source, "split_batches"):
                return int(source.num_processes), bool(source.split_batches)
        return 1, False

    def position(self) -> dict[str, Any]:
        """Where this loader stands, as plain values identical on every process.

        ``consumed`` counts what the whole job consumed of the epoch (``unit``: global batches,
        stream elements or batches), so a position saved with N processes can be loaded with M.
        """
        if self._resume is not None:  # loaded but not iterated yet: still that position
            return dict(self._resume)
        progress = self._progress
        num_processes, split = self._layout_key()
        position = {"epoch": self.epoch, "batches_yielded": 0, "consumed": 0, "unit": self._position_unit(),
                    "num_processes": num_processes, "split_batches": split,
                    "seeds": [s.seed for s in self._seedable_samplers()]}
        if progress.pass_complete:
            position["epoch"] = self.epoch + 1
        else:
            done = progress.batches_yielded
            position["batches_yielded"] = done
            position["consumed"] = progress.consumed_at_start + (done - progress.resumed) * self._consumed_per_batch()
            if isinstance(self.dataset, IterableDatasetShard) and self.dataset.repositions_itself:
                state = self.dataset.state_at(position["consumed"])  # the dataset's own position
                if state is not None:
                    position["dataset_state"] = state
        return position

    def load_position(self, position: dict[str, Any]) -> None:
        """Continue from ``position`` at the next pass (see :meth:`position`)."""
        for sampler, seed in zip(self._seedable_samplers(), position.get("seeds", [])):
            sampler.seed = seed
        self.set_epoch(int(position["epoch"]))
        num_processes, split = self._layout_key()
        resume = {"unit": self._position_unit(), "num_processes": num_processes, "split_batches": split}
        resume.update(position)
        if "consumed" not in position:  # a minimal position: the same layout as this loader
            resume["consumed"] = int(position["batches_yielded"]) * self._consumed_per_batch()
        self._resume = resume
        self._skip_pending = 0

    def _apply_resume(self, position: dict[str, Any]) -> tuple[int, int]:
        """Position this pass after what ``position`` consumed.

        Returns (batches to discard, batches of the epoch the pass length no longer includes).
        """
        progress = self._progress
        unit, consumed = self._position_unit(), int(position["consumed"])
        same_layout = (position["num_processes"], position["split_batches"]) == self._layout_key()
        if position["unit"] != unit:
            raise ValueError(
                f"the position counts {position['unit']} but this loader counts {unit}: it was saved from a "
                "differently prepared loader; prepare the loader the same way (map-style or iterable) as the saved one"
            )
        progress.consumed_at_start = consumed
        if self._inner_repositions:  # a StatefulDataLoader that loaded its own state
            self._inner_repositions = False
            if not same_layout:
                raise ValueError(
                    "use_stateful_dataloader=True resumes each process from its own saved state, which cannot be "
                    f"resized from {position['num_processes']} to {self._layout_key()[0]} processes; resume "
                    "without use_stateful_dataloader (the position resizes), or with the same number of processes"
                )
            progress.resumed = int(position["batches_yielded"])
            if self._batch_shard is not None and self._batch_shard.log is not None:
                progress.unlogged = progress.resumed
            return 0, 0
        if unit == "global_batches":
            shard = self._batch_shard
            full = self._full_length()
            shard.start_at_global(consumed)  # type: ignore[union-attr]
            progress.resumed = int(position["batches_yielded"]) if same_layout else full - self._full_length()
            return 0, progress.resumed
        if unit == "elements":
            self.dataset.resume_from(consumed, position.get("dataset_state"))
            progress.resumed = int(position["batches_yielded"]) if same_layout else consumed // self._consumed_per_batch()
            return 0, 0
        if not same_layout:
            raise ValueError(
                f"this loader's data is not sharded by shardplug (unit 'batches'), so its position cannot move from "
                f"{position['num_processes']} to {self._layout_key()[0]} processes; resume with the same number of "
                "processes, or prepare the data with prepare_data_loader on more than one process"
            )
        return consumed, 0

    # -- padding and audit ----------------------------------------------------------------
    def track_padding(self) -> None:
        """Record, for every batch, its indices and how many of them are real (not padding):
        :attr:`batch_indices`, :attr:`batch_real_count`.

        Map-style data: dataset indices.  A sized iterable dataset sharded by shardplug: positions
        in the stream.  Other loaders cannot tell padding apart (a ``ValueError`` says so).
        """
        if getattr(self, "in_order", True) is False:
            raise ValueError("padding tracking needs batches in sampler order: build the DataLoader with in_order=True")
        shard = self._batch_shard
        if shard is not None and not self._dataset_kind_is_iterable():
            if shard.log is None:
                shard.log = deque()
        elif not (isinstance(self.dataset, IterableDatasetShard) and hasattr(self.dataset.dataset, "__len__")):
            raise ValueError(
                "this loader cannot tell padding apart: padding is tracked for map-style data and for sized "
                "iterable datasets sharded by shardplug; use loader.remainder for the last global batch"
            )
        self._tracking = True

    def _batch_record(self, last: bool) -> tuple[list[int], int]:
        """(indices, real count) of the batch being handed out."""
        progress = self._progress
        shard = self._batch_shard
        if shard is not None and shard.log is not None:
            while progress.unlogged:  # batches a StatefulDataLoader fast-forwarded past
                shard.log.popleft()
                progress.unlogged -= 1
            return shard.log.popleft()
        # A sharded stream: this batch is process i's slice of global batch j after the resume point.
        dataset = self.dataset
        n, size, width = len(dataset.dataset), dataset.global_batch_size, dataset.process_slice_size
        j = progress.batches_yielded - progress.resumed - 1
        first = progress.consumed_at_start + j * size + dataset.process_index * width
        real = min(max(n - first, 0), width)
        return [(first + k) % n for k in range(width)] if n else [], real

    @property
    def batch_indices(self) -> Optional[list[int]]:
        """Dataset indices of the batch being processed (with :meth:`track_padding`)."""
        return self._progress.batch_indices

    @property
    def batch_real_count(self) -> Optional[int]:
        """How many leading samples of the batch being processed are real; the rest are
        wrap-around padding (with :meth:`track_padding`; ``None`` otherwise)."""
        return self._progress.batch_real

    def enable_audit(self) -> SampleAudit:
        """Start recording which samples this process consumes, per epoch (opt-in; see :class:`SampleAudit`)."""
        self.track_padding()
        if self.audit is None:
            self.audit = SampleAudit(self.total_dataset_length)
        return self.audit

    def state_dict(self) -> dict[str, Any]:
        """Resume state: after ``load_state_dict`` iteration continues after the last batch handed out."""
        if not self.use_stateful_dataloader:
            return self.position()
        snapshot = self._stateful_snapshot
        inner = dict(snapshot) if snapshot is not None else self._inner_state_dict()
        inner[_POSITION_KEY] = self.position()
        return inner

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.use_stateful_dataloader:
            self.load_position(state_dict)
            return
        state = dict(state_dict)
        position = state.pop(_POSITION_KEY)
        super(PreparedDataLoader, self).load_state_dict(state)  # type: ignore[misc]
        self.load_position(position)
        self._inner_repositions = True


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
    ) -> None:
        # Own the batch sampler so skipping and resuming never load a skipped batch.
        iterable = isinstance(self.dataset, IterableDataset)
        if not iterable and self.batch_sampler is not None and not isinstance(self.batch_sampler, BatchSamplerShard):
            object.__setattr__(self, "batch_sampler", BatchSamplerShard(self.batch_sampler))
        shard = self._batch_shard
        if shard is not None and not iterable:  # what DataLoader reports when given a batch sampler: None / False
            object.__setattr__(self, "batch_size", shard.per_process_batch_size)
            object.__setattr__(self, "drop_last", shard.drop_last)
        self._setup_prepared(device, rng_types, synchronized_generator, skip_batches, non_blocking)
        for target in self._epoch_targets():
            target.set_epoch(0)

    def _inner_batches(self, skip: int) -> Iterator[Any]:
        shard = self._batch_shard
        if skip and shard is not None:
            shard.skip_next(skip)
            skip = 0
        batches = super(PreparedDataLoader, self).__iter__()
        for _ in zip(range(skip), batches):
            pass  # iterable data: these elements are read, but never handed out
        return batches
