"""How one process's share is cut out of the global batches: the layout, validated once.

:class:`ShardLayout` is the one place where ``num_processes``, ``process_index``,
``split_batches``, ``even_batches``, ``drop_last`` and the batch size are checked, and where the
batch sizes that follow from them (per process, per step) are computed.

Example::

    >>> layout = ShardLayout.for_batches(8, num_processes=2, process_index=1, split_batches=True)
    >>> layout.process_batch_size, layout.step_batch_size, layout.batches_per_step
    (4, 8, 1)
    >>> ShardLayout.for_batches(3, num_processes=2, split_batches=True)
    Traceback (most recent call last):
    ...
    ValueError: split_batches=True needs a batch size that is a multiple of num_processes, ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardplug.core._internal.arguments import is_int
from shardplug.core._internal.topology import check_processes
from shardplug.core.config import ShardplugConfig

__all__ = ["ShardLayout"]

_FLAGS = ("split_batches", "even_batches", "drop_last")


@dataclass(frozen=True)
class ShardLayout:
    """The topology and the options that decide which rows a process gets.

    Args:
        num_processes: processes sharing the data (``>= 1``).
        process_index: this process, in ``[0, num_processes)``.
        split_batches: each global batch is cut in ``num_processes`` slices (else each process
            takes whole global batches in turn).
        even_batches: the end of an epoch is padded so every process yields as many batches.
        drop_last: the global batches' ``drop_last`` (nothing short is ever yielded).
        batch_size: the size of one global batch of the user's loader (``None``: variable or
            unknown); when splitting, the global batch, else one process's batch.
    """

    num_processes: int = 1
    process_index: int = 0
    split_batches: bool = ShardplugConfig.split_batches
    even_batches: bool = ShardplugConfig.even_batches
    drop_last: bool = False
    batch_size: int | None = None

    def __post_init__(self) -> None:
        check_processes(self.num_processes, self.process_index)
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} is invalid: it must be True or False")
        size = self.batch_size
        if size is not None and (not is_int(size) or size < 1):
            raise ValueError(
                f"batch_size={size!r} is invalid: it must be an integer >= 1, or None for variable-size batches"
            )
        if self.splits and size is not None and size % self.num_processes:
            raise ValueError(
                f"split_batches=True needs a batch size that is a multiple of num_processes, got batch_size={size} "
                f"and num_processes={self.num_processes}; use batch_size="
                f"{(size // self.num_processes + 1) * self.num_processes} or pass split_batches=False"
            )

    @classmethod
    def for_batches(
        cls,
        batch_size: int | None,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = ShardplugConfig.split_batches,
        even_batches: bool = ShardplugConfig.even_batches,
        drop_last: bool = False,
    ) -> ShardLayout:
        """The layout of a loader whose global batches hold ``batch_size`` samples (``None``:
        variable size, which cannot be split)."""
        if split_batches and num_processes > 1 and batch_size is None:
            raise ValueError(
                "split_batches=True needs a batch size to split, but the batches have batch_size=None (variable "
                f"size); give the DataLoader or its batch sampler a batch_size that is a multiple of "
                f"num_processes={num_processes}, or pass split_batches=False"
            )
        return cls(num_processes, process_index, split_batches, even_batches, drop_last, batch_size)

    def reader(self) -> ShardLayout:
        """The layout of one process reading every global batch (a dispatcher's process 0):
        the same batches, one process, nothing split or padded.

        Example::

            >>> ShardLayout.for_batches(8, 2, 1, split_batches=True).reader()
            ShardLayout(num_processes=1, process_index=0, split_batches=False, even_batches=True, drop_last=False, batch_size=8)
        """  # noqa: E501 (the doctest's output is one line)
        return dataclasses.replace(self, num_processes=1, process_index=0, split_batches=False, even_batches=True)

    @property
    def splits(self) -> bool:
        """Global batches are cut in slices (``split_batches`` with more than one process)."""
        return self.split_batches and self.num_processes > 1

    @property
    def pads(self) -> bool:
        """The end of an epoch is padded so every process yields as many batches."""
        return self.num_processes > 1 and self.even_batches and not self.drop_last

    @property
    def batches_per_step(self) -> int:
        """Global batches consumed each time every process takes one batch."""
        return 1 if self.splits else self.num_processes

    @property
    def process_batch_size(self) -> int | None:
        """Samples in one batch of this process (``None`` for variable-size batches)."""
        if self.batch_size is None:
            return None
        return self.batch_size // self.num_processes if self.splits else self.batch_size

    @property
    def step_batch_size(self) -> int | None:
        """Samples all processes take together in one step (``None`` for variable-size batches)."""
        if self.batch_size is None:
            return None
        return self.batch_size if self.splits else self.batch_size * self.num_processes
