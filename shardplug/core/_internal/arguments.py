"""The argument checks written once: an integer that is not a ``bool``, in a range.

``True`` is an ``int`` to Python; every count, index and size shardplug takes refuses it.

Example::

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    >>> check_int("num_processes", 2, minimum=1)
    2
    >>> check_int("num_processes", 0, minimum=1, fix="(leave it None to read it from the job)")
    Traceback (most recent call last):
    ...
    ValueError: num_processes=0 is invalid: it must be an integer >= 1 (leave it None to read it from the job)
    >>> check_int("state_dict['step']", 2, minimum=0, below=2)
    Traceback (most recent call last):
    ...
    ValueError: state_dict['step']=2 is invalid: it must be an integer in [0, 2)
"""

from __future__ import annotations

from typing import Any, TypeGuard

__all__ = ["is_int", "check_int", "check_prefetch_depth", "DEFAULT_CUDA_DEPTH"]

DEFAULT_CUDA_DEPTH = 0
"""The prefetch depth ``prefetch_depth=None`` gives on a CUDA device (0 elsewhere).

0 (prefetching is opt-in: pass ``prefetch_depth > 0``) until the GPU checks (``tests/gpu/``,
``benchmarks/gpu.py``) have passed on a real GPU; whoever sees them pass may make it 2, with the figures
in docs/gpu.md in the same commit."""


def is_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, minimum: int, below: int | None = None, fix: str = "") -> int:
    """``value`` if it is an integer (not a ``bool``) ``>= minimum`` (and ``< below``), else ``ValueError``.

    The message: ``"<name>=<value!r> is invalid: it must be an integer >= <minimum>"`` (``in [<minimum>,
    <below>)`` with ``below``), then ``fix`` after a space when given.
    """
    if is_int(value) and value >= minimum and (below is None or value < below):
        return value
    wanted = f">= {minimum}" if below is None else f"in [{minimum}, {below})"
    raise ValueError(f"{name}={value!r} is invalid: it must be an integer {wanted}" + (f" {fix}" if fix else ""))


def check_prefetch_depth(depth: Any) -> int | None:
    """``depth`` if it is ``None`` or an integer ``>= 0``; else a ``ValueError`` naming the fix.

    Example::

        >>> check_prefetch_depth(None), check_prefetch_depth(2)
        (None, 2)
    """
    if depth is not None and (not is_int(depth) or depth < 0):
        raise ValueError(
            f"prefetch_depth={depth!r} is invalid: pass an integer >= 0 (0 = no look-ahead) or None "
            "(the default: 0, no look-ahead)"
        )
    return None if depth is None else int(depth)
