"""A prepared loader's cursor: its place as values, with no way back to the loader, shared by a
``skip_first_batches`` copy."""

from __future__ import annotations

import gc
import pickle
from typing import Any

from torch.utils.data import DataLoader

from shardplug import prepare_data_loader, skip_first_batches


def _reaches(start: Any, target: Any, limit: int = 10_000) -> bool:
    """Whether ``target`` is reachable from ``start`` by references (modules and classes not followed)."""
    seen, stack = {id(start)}, [start]
    while stack and len(seen) < limit:
        for ref in gc.get_referents(stack.pop()):
            if ref is target:
                return True
            if id(ref) not in seen and not isinstance(ref, type) and type(ref).__name__ != "module":
                seen.add(id(ref))
                stack.append(ref)
    return False


def _loader(**kwargs: Any) -> Any:
    return prepare_data_loader(
        DataLoader(range(20), batch_size=2, shuffle=True), num_processes=2, process_index=1, data_seed=3, **kwargs
    )


def test_the_cursor_holds_values_only_before_during_and_after_a_pass() -> None:
    loader = _loader()
    assert not _reaches(loader.cursor, loader)
    batches = iter(loader)
    next(batches)
    assert not _reaches(loader.cursor, loader), "a running pass keeps its loader; the cursor does not"
    list(batches)
    assert not _reaches(loader.cursor, loader)


def test_a_skip_copy_shares_the_cursor_and_the_loader_follows_its_pass() -> None:
    loader = _loader()
    loader.set_epoch(2)
    skipped = skip_first_batches(loader, 3)
    assert (skipped.epoch, len(skipped), len(loader)) == (2, 2, 5)  # the skip is the copy's own
    first = next(iter(skipped))
    assert loader.state_dict() == skipped.state_dict()  # the loader stands where its copy's pass stands
    assert loader.state_dict()["batches_yielded"] == 4 and first.numel() == 2
    skipped.set_epoch(5)
    assert loader.epoch == 5  # one epoch for both: the cursor's


def test_a_pickled_skip_copy_travels_with_a_cursor_of_its_own() -> None:
    loader = _loader()
    skipped = pickle.loads(pickle.dumps(skip_first_batches(loader, 3)))
    assert len(skipped) == 2 and [b.tolist() for b in skipped] == [b.tolist() for b in loader][3:]
    assert loader.state_dict()["epoch"] == 1 and skipped.epoch == 0  # the loader's own pass, not the copy's
