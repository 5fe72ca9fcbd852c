"""Prepared data loaders: what each process iterates.

:class:`PreparedDataLoader` holds what every prepared loader does (epochs, RNG agreement,
device transfer, knowing the last batch, the resume position); :class:`DataLoaderShard` is the
loader whose sampler or dataset is already sharded.  The dispatcher lives in ``dispatch.py``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Optional, Union

import torch
from torch.utils.data import DataLoader, IterableDataset

from .collectives import broadcast_object, global_rank
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
    """Per-pass bookkeeping, kept off ``DataLoader.__setattr__`` (slow) on the per-batch path."""

    __slots__ = ("batches_yielded", "end_of_dataloader", "pass_complete")

    def __init__(self) -> None:
        self.batches_yielded = 0
        self.end_of_dataloader = False
        self.pass_complete = False


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
        self._resume_pending = 0  # continues a pass (load_state_dict); len() stays the epoch's
        self._inner_repositions = False  # a loaded StatefulDataLoader state does the resume skip itself
        self._stateful_snapshot: Optional[dict[str, Any]] = None

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
        """Batches in one full pass of this process."""
        shard = self._batch_shard
        if shard is not None and not self._dataset_kind_is_iterable():
            return shard.full_length()
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

    def _begin_pass(self) -> tuple[int, int]:
        """Start a pass; return (batches already counted in this epoch, batches to skip)."""
        if self._advance_pending:
            self.set_epoch(self.epoch + 1)
        self._synchronize()
        already = self._skip_pending + self._resume_pending
        skip = 0 if self._inner_repositions else already  # a loaded StatefulDataLoader positions itself
        self._skip_pending = self._resume_pending = 0
        self._inner_repositions = False
        self._progress.batches_yielded = already
        self._progress.end_of_dataloader = False
        return already, skip

    def _iterate(self) -> Iterator[Any]:
        already, skip = self._begin_pass()
        total = self._pass_length()
        state = self.gradient_state
        if state is not None:
            state._loader_started(self)
        try:
            batches = self._inner_batches(skip)
            if total is not None:
                yield from self._deliver_counted(batches, already, total)
            else:
                yield from self._deliver_lookahead(batches, already)
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
        if self.gradient_state is not None:
            self.gradient_state._batch_ready(self, last)
        return send_to_device(batch, self.device, self.non_blocking) if self.device is not None else batch

    def _deliver_counted(self, batches: Iterator[Any], count: int, total: int) -> Iterator[Any]:
        if self.gradient_state is None and self.device is None:  # the hot path: bookkeeping only
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

    def position(self) -> dict[str, Any]:
        """Where this loader stands: plain values, identical on every process."""
        progress = self._progress
        epoch, done = (self.epoch + 1, 0) if progress.pass_complete else (self.epoch, progress.batches_yielded)
        seeds = [s.seed for s in self._seedable_samplers()]
        return {"epoch": epoch, "batches_yielded": done, "seeds": seeds}

    def load_position(self, position: dict[str, Any]) -> None:
        for sampler, seed in zip(self._seedable_samplers(), position.get("seeds", [])):
            sampler.seed = seed
        self.set_epoch(int(position["epoch"]))
        self._resume_pending = int(position["batches_yielded"])
        self._skip_pending = 0

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
