"""The classes of prepared loaders: one per base (a user's ``DataLoader`` subclass, torchdata's
``StatefulDataLoader``) combined with shardplug's, cached, and how such a loader pickles.

Example::

    >>> from torch.utils.data import DataLoader
    >>> class Mine(DataLoader):
    ...     pass
    >>> combined_class(Mine, DataLoader) is Mine
    True
"""

from __future__ import annotations

from typing import Any

from shardplug.core._internal import compat
from shardplug.core.resume.stateful import stateful_dataloader_class

__all__ = ["combined_class", "stateful_variant", "Rebuilt"]

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


class Rebuilt:
    """How a prepared loader pickles: by the bases of its class (a class made by :func:`combined_class` is
    made again where it is unpickled), without an open iterator (and its workers)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        state = dict(self.__dict__)
        compat.without_iterator(state)  # an open iterator (and its workers) does not travel
        cls = type(self)
        if _VARIANTS.get(cls.__bases__) is cls:  # a class made by combined_class: rebuilt by its bases
            return _variant_instance, (cls.__bases__,), state
        return _variant_instance, ((cls,),), state
