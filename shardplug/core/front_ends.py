"""What the front ends (``shardplug_lightning``, ``shardplug_ignite``) use of the core's shared helpers.

The helpers live in :mod:`shardplug.core._internal`, which only the core imports
(``tests/api/test_front_ends.py`` fails on a front end that imports it); a front end takes them from here:

* :func:`check_int`: the one integer check (errors name the argument, the value and the fix);
* :func:`iter_leaves`: the one walker over a nested batch's leaves;
* :func:`forget_iterator`: drop a ``DataLoader``'s persistent iterator (a private name of torch, guarded with
  the others in :mod:`~shardplug.core._internal.compat`);
* :data:`CHECKED_AGAINST`: the versions of torch, torchdata and ``datasets`` the core's private names were
  checked against.

Example::

    >>> check_int("every_n_steps", 2, minimum=1), list(iter_leaves({"x": [1, 2], "y": 3}))
    (2, [1, 2, 3])
"""

from __future__ import annotations

from shardplug.core._internal.arguments import check_int
from shardplug.core._internal.compat import CHECKED_AGAINST, forget_iterator
from shardplug.core._internal.rows import iter_leaves

__all__ = ["CHECKED_AGAINST", "check_int", "forget_iterator", "iter_leaves"]
