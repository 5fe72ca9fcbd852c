"""Where a loader stands in an epoch, with the identity of what it describes (see docs/resume.md).

A :class:`Position` is what ``loader.state_dict()`` returns (as plain values, identical on
every process) and what ``load_state_dict`` takes back.  It records the counters (``epoch``,
``batches_yielded``, ``consumed``: what the whole job consumed of the epoch, in ``unit``), the
identity of the loader (dataset length, batch sizes, options, the sampler's kind) and the shuffle's
state (the seeds of seedable shuffles, or a generator's state at the start of the epoch).
:meth:`Position.from_dict` validates a saved dict before anything changes, and
:meth:`Position.check_resumable` compares it with the loader it is loaded into: every refusal
names the key, the saved value, the current value and the fix.

Example::

    >>> p = Position(epoch=0, batches_yielded=1, consumed=2, unit="global_batches", num_processes=2,
    ...              split_batches=False, even_batches=True, drop_last=False, dataset_length=10,
    ...              batch_size=2, process_batch_size=2, step_batch_size=4, sampler="SequentialSampler")
    >>> Position.from_dict(p.to_dict()) == p
    True
    >>> Position.from_dict({**p.to_dict(), "consumed": -1})
    Traceback (most recent call last):
    ...
    ValueError: the position's consumed=-1 is invalid: it must be an integer >= 0; ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shardplug.core._internal.arguments import is_int
from shardplug.core.sharding.shard_plan import UNITS

__all__ = ["Position", "POSITION_FORMAT"]

POSITION_FORMAT = 3
"""Version of the dict :meth:`Position.to_dict` writes (1: shardplug 0.1, without identity; 2: without
``num_workers``, still read)."""

_FIX = "load the position saved by this loader, or prepare the loader as it was when the position was saved"


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


def _optional_count(value: Any) -> bool:
    return value is None or (is_int(value) and value >= 0)


def _optional_size(value: Any) -> bool:
    return value is None or (is_int(value) and value >= 1)


_CHECKS: dict[str, tuple[Any, str]] = {
    "epoch": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "batches_yielded": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "consumed": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "unit": (lambda v: v in UNITS, f"one of {list(UNITS)}"),
    "num_processes": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "split_batches": (lambda v: isinstance(v, bool), "True or False"),
    "even_batches": (lambda v: isinstance(v, bool), "True or False"),
    "drop_last": (lambda v: isinstance(v, bool), "True or False"),
    "dataset_length": (_optional_count, "an integer >= 0 or None"),
    "batch_size": (_optional_size, "an integer >= 1 or None"),
    "process_batch_size": (_optional_size, "an integer >= 1 or None"),
    "step_batch_size": (_optional_size, "an integer >= 1 or None"),
    "sampler": (lambda v: isinstance(v, str), "a string"),
    "num_workers": (_optional_count, "an integer >= 0 or None"),
    "seeds": (
        lambda v: isinstance(v, (list, tuple)) and all(s is None or is_int(s) for s in v),
        "a list of integers or None",
    ),
    "generator_state": (
        lambda v: v is None or (isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1),
        "None or a 1-d uint8 tensor (torch.Generator.get_state())",
    ),
    "dataset_state": (lambda v: True, "anything"),
    "format": (lambda v: v == POSITION_FORMAT, f"{POSITION_FORMAT}"),
}

IDENTITY = ("unit", "dataset_length", "batch_size", "drop_last", "even_batches", "sampler")
"""Keys that must agree between a saved position and the loader it is loaded into.  The number
of processes and ``split_batches`` may differ (the rest of the epoch is shared out anew)."""


@dataclass(frozen=True)
class Position:
    """A loader's place in its epoch (see the module docstring)."""

    epoch: int
    batches_yielded: int
    consumed: int
    unit: str
    num_processes: int
    split_batches: bool
    even_batches: bool
    drop_last: bool
    dataset_length: int | None
    batch_size: int | None
    process_batch_size: int | None
    step_batch_size: int | None
    sampler: str
    num_workers: int | None = None
    """DataLoader workers of the loader that saved it (``None``: not recorded, format 2)."""
    seeds: tuple[int | None, ...] = ()
    generator_state: torch.Tensor | None = field(default=None, compare=False)
    dataset_state: Any = None
    format: int = POSITION_FORMAT

    def to_dict(self) -> dict[str, Any]:
        """Plain values (the generator state a uint8 tensor): loadable with ``torch.load(weights_only=True)``."""
        state = dataclasses.asdict(self)
        state["seeds"] = list(self.seeds)
        return state

    @classmethod
    def from_dict(cls, state: Any) -> Position:
        """Validate a saved position: a ``ValueError`` names what is wrong and how to fix it."""
        if not isinstance(state, Mapping):
            raise ValueError(f"a loader position must be a dict (from loader.state_dict()), got {type(state).__name__}")
        if "format" not in state:
            raise ValueError(
                "the position has no 'format' key: it was written by shardplug 0.1 or by hand, and records neither "
                "the dataset length nor the batch size, so it cannot be checked; save a new position with "
                "loader.state_dict(), or use skip_first_batches(loader, n) to start after n batches"
            )
        if state["format"] == 2 and "num_workers" not in state:  # format 2 is format 3 without num_workers
            state = {**state, "num_workers": None, "format": POSITION_FORMAT}
        if state["format"] != POSITION_FORMAT:
            raise ValueError(
                f"the position's format={state['format']!r} is unknown (this shardplug reads format "
                f"{POSITION_FORMAT}); load it with the shardplug version that saved it"
            )
        expected = set(_CHECKS)
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or extra:
            raise ValueError(
                f"the position has missing keys {missing} and extra keys {extra}; pass loader.state_dict() "
                "unchanged (wrap it in your own dict to store more)"
            )
        for key, (check, meaning) in _CHECKS.items():
            if not check(state[key]):
                raise ValueError(f"the position's {key}={state[key]!r} is invalid: it must be {meaning}; {_FIX}")
        if (state["consumed"] or state["batches_yielded"]) and None in state["seeds"]:
            raise ValueError(
                f"the position's seeds={list(state['seeds'])} has an unset seed although the epoch is under way "
                f"(consumed={state['consumed']}): the order of the rest of the epoch cannot be known; {_FIX}"
            )
        values = dict(state)
        values["seeds"] = tuple(values["seeds"])
        return cls(**values)

    def check_resumable(self, current: Position, epoch_size: int | None, same_layout_batches: int | None) -> None:
        """Refuse to load into a loader that ``current`` describes when the two would not continue
        at the same place: another identity, another number of shuffle seeds, a counter beyond the
        epoch (``epoch_size`` in ``unit``; ``same_layout_batches``: this process's batches per epoch)."""
        for key in IDENTITY:
            saved, now = getattr(self, key), getattr(current, key)
            if key == "unit" and saved != now:
                if (self.consumed, self.batches_yielded) == (0, 0):
                    continue  # an epoch's start is the same place whatever is counted
                raise ValueError(
                    f"the position counts {saved!r} (a stream on {_processes(self.num_processes)}) and this loader "
                    f"counts {now!r} (on {_processes(current.num_processes)}): a stream is shared out differently on "
                    "one process and on several, so a position inside an epoch cannot move between them; resume with "
                    f"{_processes(self.num_processes)}, or from a position saved at an epoch's end (it loads into any "
                    "number of processes)"
                )
            if saved != now:
                fix = _FIX
                if key == "dataset_length" and self.sampler == current.sampler == "MixtureSampler":
                    fix = (
                        f"a Mixture's dataset_length is its samples_per_epoch: pass samples_per_epoch={saved} "
                        "(adding a source changes the default, the sum of the sources' lengths)"
                    )
                raise ValueError(
                    f"the position's {key}={saved!r} differs from this loader's {key}={now!r}: it would resume at "
                    f"another place; {fix}"
                )
        if len(self.seeds) != len(current.seeds):
            raise ValueError(
                f"the position has {len(self.seeds)} shuffle seeds (seeds={list(self.seeds)}) but this loader has "
                f"{len(current.seeds)} seedable samplers; {_FIX}"
            )
        if (self.generator_state is None) != (current.generator_state is None):
            saved = "a" if self.generator_state is not None else "no"
            now = "a" if current.generator_state is not None else "no"
            raise ValueError(
                f"the position has {saved} generator_state but this loader's shuffle has {now} generator; {_FIX}"
            )
        if epoch_size is not None and self.consumed > epoch_size:
            raise ValueError(
                f"the position's consumed={self.consumed} is beyond this loader's epoch of {epoch_size} {self.unit}; "
                f"{_FIX}"
            )
        same_layout = (self.num_processes, self.split_batches) == (current.num_processes, current.split_batches)
        if same_layout and same_layout_batches is not None and self.batches_yielded > same_layout_batches:
            raise ValueError(
                f"the position's batches_yielded={self.batches_yielded} is beyond this loader's "
                f"{same_layout_batches} batches per epoch; {_FIX}"
            )

    def replace(self, **changes: Any) -> Position:
        return dataclasses.replace(self, **changes)
