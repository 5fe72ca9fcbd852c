"""Old names kept for one release: each warns once per process (a ``DeprecationWarning`` naming the new one).

Example::

    >>> import warnings
    >>> def new_name(x):
    ...     return x + 1
    >>> old_name = renamed_function("old_name", new_name)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     old_name(1), old_name(2)
    (2, 3)
    >>> [str(w.message) for w in caught]
    ['old_name is deprecated, use new_name (same meaning)']
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["warn_renamed", "renamed_function", "renamed_property"]

_warned: set[str] = set()


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn (once per process for ``old``) that ``old`` is deprecated in favour of ``new``."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(f"{old} is deprecated, use {new} (same meaning)", DeprecationWarning, stacklevel=stacklevel)


def renamed_function(old: str, function: Callable[..., Any], new: str = "") -> Callable[..., Any]:
    """``function`` under its deprecated name ``old`` (``new``: how the warning names it, default its name)."""
    new = new or function.__name__

    @functools.wraps(function)
    def deprecated(*args: Any, **kwargs: Any) -> Any:
        warn_renamed(old, new)
        return function(*args, **kwargs)

    deprecated.__name__ = deprecated.__qualname__ = old.split("(")[0].rsplit(".", 1)[-1]
    deprecated.__doc__ = f"Deprecated name of :func:`{new}`."
    return deprecated


def renamed_property(old: str, new: str) -> property:
    """A read-only property ``old`` (``"Class.old"``) that reads the attribute ``new``."""

    def get(self: Any) -> Any:
        warn_renamed(old, f"{old.rsplit('.', 1)[0]}.{new}")
        return getattr(self, new)

    return property(get, doc=f"Deprecated name of :attr:`{new}`.")
