"""The one walker over nested batches (shardplug.core._internal.rows) and the modules that walk with it."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import torch

from shardplug.core._internal.rows import first_leaf, iter_leaves, map_leaves
from shardplug.core.loader.transfer import send_to_device
from shardplug.core.padding.metrics import drop_padding
from shardplug.core.sharding.native import _detached, _rows

Pair = namedtuple("Pair", ["x", "y"])


class Batch(dict):
    """A dict subclass, as a dataset's collate_fn may return."""


class Movable:
    def __init__(self) -> None:
        self.moved_to = None

    def to(self, device, non_blocking=False):
        self.moved_to = (device, non_blocking)
        return self


def _nested():
    return Batch(pair=Pair(torch.ones(2), [torch.zeros(2), "a"]), ids=OrderedDict(i=(1, 2)), source="web")


def test_map_leaves_keeps_every_container_type_and_passes_other_leaves_on():
    seen = []
    out = map_leaves(_nested(), lambda leaf: seen.append(leaf) or leaf)
    assert type(out) is Batch and type(out["pair"]) is Pair and type(out["ids"]) is OrderedDict
    assert type(out["pair"].y) is list and out["pair"].y[1] == "a" and out["ids"]["i"] == (1, 2)
    assert [type(leaf).__name__ for leaf in seen] == ["Tensor", "Tensor", "str", "int", "int", "str"]


def test_map_leaves_copies_lists_of_plain_values_and_falls_back_to_dict():
    words = ["a", "b"]
    assert map_leaves({"w": words}, lambda leaf: leaf)["w"] is not words
    grouped = defaultdict(list, {"x": torch.ones(1)})  # cannot be built from a dict
    assert type(map_leaves(grouped, lambda leaf: leaf)) is dict


def test_iter_leaves_and_first_leaf():
    assert [leaf for leaf in iter_leaves(_nested()) if not isinstance(leaf, torch.Tensor)] == ["a", 1, 2, "web"]
    assert first_leaf({"text": ["a", "b", "c"], "x": torch.zeros(2)}) == ["a", "b", "c"]
    assert torch.equal(first_leaf([{"x": torch.zeros(3)}, 1]), torch.zeros(3))
    assert first_leaf({}) == {} and first_leaf(5) == 5


def test_send_to_device_moves_tensors_and_objects_with_to_and_skips_keys():
    movable, kept = Movable(), torch.ones(1)
    out = send_to_device(Batch(x=torch.ones(2), m=movable, keep=kept, pair=Pair(1, "s")), "cpu", True, skip_keys="keep")
    assert type(out) is Batch and out["pair"] == Pair(1, "s") and out["keep"] is kept
    assert movable.moved_to == ("cpu", True)
    assert send_to_device({"x": 1}, None) == {"x": 1}


def test_the_native_plan_counts_and_copies_batches_with_the_walker():
    assert _rows({"x": torch.zeros(3, 2)}) == 3 and _rows([["a", "b"], torch.zeros(5)]) == 2 and _rows(7) == 1
    assert _rows([]) == 0
    batch = _nested()
    copy = _detached(batch)
    batch["pair"].x.add_(1)
    assert type(copy["pair"]) is Pair and torch.equal(copy["pair"].x, torch.ones(2))


class _Loader:
    batch_real_count = 1


def test_drop_padding_keeps_named_tuples():
    out = drop_padding(Pair(torch.arange(3), {"y": torch.arange(3)}), _Loader())
    assert type(out) is Pair and out.x.tolist() == [0] and out.y["y"].tolist() == [0]
