"""How many batches a pass yields after a place in its epoch (what ``len()`` of a loader answers).

The plan counts them (:meth:`~shardplug.core.sharding.shard_plan.ShardPlan.num_batches`); where it
cannot, the ``DataLoader``'s own count is the answer, except where the plan agrees its step counts
while reading (the ``DataLoader``'s count is then not the agreed one): a ``TypeError`` says how to
iterate without ``len()``.

Example::

    >>> from shardplug.core.sharding.layout import ShardLayout
    >>> from shardplug.core.sharding.local import LocalPlan
    >>> lengths = PassLengths(LocalPlan(ShardLayout(batch_size=2), length=5), inner_length=lambda: 5, dataset=None)
    >>> lengths.batches_after(2), lengths.epoch_length()
    (3, 5)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import IterableDataset

from shardplug.core.sharding.shard_plan import ShardPlan, plan_traits

__all__ = ["PassLengths"]

_WITHOUT_LEN = "iterate without len() (for batch in loader: ..., with a step budget of your own where one is needed)"


def _user_stream(dataset: Any) -> Any:
    """The user's stream under shardplug's wrappers of it (each keeps it as ``.dataset``)."""
    while type(dataset).__module__.startswith("shardplug.") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    return dataset


class PassLengths:
    """The lengths of the passes of a loader with ``plan``: ``inner_length`` is the ``DataLoader``'s own
    ``len()`` (it may raise ``TypeError``), ``dataset`` the loader's dataset (named in the refusal)."""

    __slots__ = ("plan", "inner_length", "dataset")

    def __init__(self, plan: ShardPlan, inner_length: Callable[[], int], dataset: Any) -> None:
        self.plan = plan
        self.inner_length = inner_length
        self.dataset = dataset

    def batches_after(self, consumed: int) -> int:
        """Batches of a pass that starts after ``consumed`` (``TypeError`` when unknown)."""
        plan = self.plan
        length = plan.num_batches(consumed)
        if length is not None:
            return length
        if plan_traits(plan).agrees_steps:  # the DataLoader's count is not the agreed one
            raise TypeError(
                "the number of batches of this natively sharded stream is agreed while it is read (its parts "
                "have no len(), or DataLoader workers split them in a way shardplug cannot count), so len() is "
                f"unknown; {_WITHOUT_LEN}"
            )
        try:
            return self.inner_length()  # the DataLoader's own answer
        except TypeError:
            stream = _user_stream(self.dataset)
            if not isinstance(stream, IterableDataset) or hasattr(stream, "__len__"):
                raise  # a sampler without len() (torch's message names it), or a __len__ that failed
            name = type(stream).__name__
            raise TypeError(
                f"len() of this loader needs the length of its stream, and the {name} has no __len__; give {name} "
                f"a __len__ (the number of elements the whole stream yields), or {_WITHOUT_LEN}"
            ) from None

    def epoch_length(self) -> int | None:
        """Batches of a whole epoch on this loader's layout (``None`` when unknown)."""
        try:
            return self.batches_after(0)
        except TypeError:
            return None
