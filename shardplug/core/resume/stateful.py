"""The ``StatefulDataLoader`` under a prepared loader: its class, its own state and the snapshots of it.

A prepared loader built with ``use_stateful_dataloader=True`` derives from torchdata's
``StatefulDataLoader`` too.  Its own state (where the DataLoader and its workers stand) travels in
``loader.state_dict()`` beside shardplug's position (under :data:`POSITION_KEY`); a pass that reads
one batch ahead takes an :class:`InnerState` snapshot before each look-ahead, so that the state
saved after a batch is the state after that batch, not after the one read ahead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = ["stateful_dataloader_class", "is_stateful", "InnerState", "POSITION_KEY"]

POSITION_KEY = "_shardplug_position"
"""The key of shardplug's position in the state of a loader backed by a ``StatefulDataLoader``."""


def stateful_dataloader_class() -> type[DataLoader[Any]]:
    """torchdata's ``StatefulDataLoader``, or an ``ImportError`` that says what to install."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as exc:
        raise ImportError(
            "use_stateful_dataloader=True needs torchdata>=0.8 (StatefulDataLoader): "
            "pip install 'shardplug[stateful]' or pip install 'torchdata>=0.8'"
        ) from exc
    return cast("type[DataLoader[Any]]", StatefulDataLoader)  # torchdata has no type information


def is_stateful(loader: object) -> bool:
    """Whether ``loader`` is a ``StatefulDataLoader`` (``False`` without torchdata)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return isinstance(loader, StatefulDataLoader)


class InnerState:
    """A prepared loader's view of the ``StatefulDataLoader`` under it (``inner``: the loader seen
    past shardplug's class, see ``PreparedDataLoader.inner_loader``).

    ``snapshot``: its state after the last batch handed out, taken before a look-ahead fetch (``None``
    where nothing was read ahead: the live state is then the place); a pass left early (``break``, an
    exception) keeps it until the next pass begins.  A state of its own, loaded, repositions the next
    pass (the loader's cursor parks that start with the position).
    """

    __slots__ = ("snapshot",)

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] | None = None

    def take_snapshot(self, inner: Any) -> None:
        """Keep the state now: the batch about to be handed out was the last one read."""
        self.snapshot = inner.state_dict()

    def current_snapshot(self) -> dict[str, Any] | None:
        """The snapshot now (a prefetcher hands it out with the batch it was taken after)."""
        return self.snapshot

    def state(self, inner: Any) -> dict[str, Any]:
        """The state after the last batch handed out (a copy: the caller adds to it)."""
        return dict(self.snapshot) if self.snapshot is not None else inner.state_dict()

    def load(self, inner: Any, state: dict[str, Any]) -> None:
        """Load a state of its own: the next pass continues where it says."""
        inner.load_state_dict(state)
        self.snapshot = None  # the loaded state is the place now

    def end_pass(self) -> None:
        """A pass ended: its snapshot no longer describes the place."""
        self.snapshot = None
