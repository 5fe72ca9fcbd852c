"""A prepared loader's own options, in one object from the config to its passes: :class:`LoaderOptions`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardplug.core._internal.arguments import check_prefetch_depth, is_int
from shardplug.core.config import ShardplugConfig
from shardplug.core.loader.prefetch import resolve_prefetch_depth
from shardplug.core.loader.transfer import DeviceTransfer
from shardplug.core.sharding.shard_plan import ShardPlan
from shardplug.core.shuffle.rng import check_rng_types

__all__ = ["LoaderOptions"]


@dataclass(frozen=True)
class LoaderOptions:
    """What a prepared loader holds beyond a ``DataLoader``'s settings, in one object: the ``device`` its
    batches move to (``None``: they stay), the RNGs agreed with process 0 at each pass (``rng_types``, and
    ``synchronized_generator``), the batches its first pass skips (``skip_batches``), ``non_blocking``
    copies, the batches read ahead of the one handed out (``prefetch_depth``, ``None``: 0, prefetching is
    opt-in; see :mod:`~shardplug.core.loader.prefetch`), and the ``plan`` of its rows (``None``: the
    loader's own, from its sampler or dataset).

    ``prepare_data_loader`` builds them from its :class:`~shardplug.core.config.ShardplugConfig`, a loader keeps
    them whole (``loader.options``) and its passes read them there, with what follows from them (the
    ``transfer`` of each batch, the prefetch ``depth``).

    Example::

        >>> LoaderOptions(skip_batches=2).skip_batches
        2
        >>> LoaderOptions(device=torch.device("cpu")).transfer.device, LoaderOptions().depth
        (device(type='cpu'), 0)
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
    transfer: DeviceTransfer | None = field(init=False, repr=False, compare=False, default=None)
    """What a pass moves each batch with (derived from ``device`` and ``non_blocking``)."""
    depth: int = field(init=False, repr=False, compare=False, default=0)
    """The prefetch depth a pass uses (``prefetch_depth`` resolved for ``device``)."""

    def __post_init__(self) -> None:
        if not is_int(self.skip_batches) or self.skip_batches < 0:
            raise ValueError(f"skip_batches={self.skip_batches!r} must be an integer >= 0")
        object.__setattr__(self, "rng_types", check_rng_types(self.rng_types))
        object.__setattr__(self, "non_blocking", bool(self.non_blocking))
        object.__setattr__(self, "prefetch_depth", check_prefetch_depth(self.prefetch_depth))
        object.__setattr__(self, "transfer", DeviceTransfer.to(self.device, self.non_blocking))
        object.__setattr__(self, "depth", resolve_prefetch_depth(self.prefetch_depth, self.device))
