"""Shared-memory rings and collation straight into a ring slot (one process; the dispatch tests
run them across real gloo processes)."""

from __future__ import annotations

import pickle
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from shardplug.core._internal.rows import flatten
from shardplug.core.dispatch.shm import CollateIntoRing, RingReader, SharedRing

Pair = namedtuple("Pair", "left right")

SAMPLES = {
    "tensors": lambda i: torch.full((3, 2), float(i)),
    "dict with numbers and text": lambda i: {"x": torch.arange(5) + i, "label": i, "score": i / 2, "text": f"s{i}"},
    "unaligned dtypes": lambda i: (torch.ones(3, dtype=torch.uint8) * i, torch.arange(2, dtype=torch.int64) + i),
    "numpy": lambda i: (np.full((2,), i, dtype=np.float32), np.int16(i)),
    "namedtuple of lists": lambda i: Pair([torch.tensor([i, i])], [torch.tensor(float(i))]),
    "bools": lambda i: {"mask": torch.tensor([True, i % 2 == 0]), "flag": bool(i % 2)},
}


def _same(a, b) -> bool:
    leaves_a, skeleton_a = flatten(a)
    leaves_b, skeleton_b = flatten(b)
    if skeleton_a != skeleton_b or len(leaves_a) != len(leaves_b):
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _tensors(batch) -> list[torch.Tensor]:
    return [leaf for leaf in flatten(batch)[0] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]


@pytest.fixture
def ring():
    ring = SharedRing(slots=3, slot_bytes=4096)
    yield ring
    ring.close()


@pytest.mark.parametrize("kind", list(SAMPLES))
def test_collating_into_a_slot_gives_what_default_collate_gives_and_leaves_nothing_to_copy(ring, kind):
    samples = [SAMPLES[kind](i) for i in range(4)]
    collate = CollateIntoRing()
    collate.target = (ring, 1)
    batch = collate(samples)
    assert _same(batch, default_collate(samples))
    tensors = _tensors(batch)
    assert tensors and all(ring.holds(t) for t in tensors), "every tensor with rows is in the slot"
    assert ring.write(1, tensors) == 0, "nothing left to copy: each tensor is where the write puts it"
    reader = RingReader(ring.path, ring.slots, ring.slot_bytes)
    try:
        read = reader.read(1, [(t.dtype, tuple(t.shape)) for t in tensors])
        assert all(torch.equal(r, t) for r, t in zip(read, tensors))
    finally:
        reader.close()


def test_without_a_target_it_is_default_collate_and_the_target_serves_one_batch(ring):
    samples = [SAMPLES["dict with numbers and text"](i) for i in range(4)]
    collate = CollateIntoRing()
    plain = collate(samples)
    assert _same(plain, default_collate(samples)) and not any(ring.holds(t) for t in _tensors(plain))
    collate.target = (ring, 0)
    first, second = collate(samples), collate(samples)
    assert all(ring.holds(t) for t in _tensors(first))
    assert not any(ring.holds(t) for t in _tensors(second))
    assert collate.target is None


@pytest.mark.parametrize(
    "samples",
    [
        [torch.ones(3, requires_grad=True) for _ in range(2)],  # autograd: stack(out=) would refuse
        [torch.ones(3, dtype=torch.float32), torch.ones(3, dtype=torch.float64)],  # promotion
        [torch.zeros(2048) for _ in range(2)],  # 16 KiB: larger than the slot
    ],
    ids=["requires_grad", "mixed_dtypes", "too_big"],
)
def test_tensors_it_cannot_place_are_collated_as_default_collate_does(ring, samples):
    collate = CollateIntoRing()
    collate.target = (ring, 2)
    batch = collate(samples)
    expected = default_collate(samples)
    assert batch.dtype == expected.dtype and torch.equal(batch, expected)
    assert batch.requires_grad == expected.requires_grad
    assert not ring.holds(batch)


def test_unequal_shapes_fail_as_in_default_collate(ring):
    collate = CollateIntoRing()
    collate.target = (ring, 0)
    samples = [torch.ones(2), torch.ones(3)]
    with pytest.raises(RuntimeError) as ours:
        collate(samples)
    with pytest.raises(RuntimeError) as theirs:
        default_collate(samples)
    assert type(ours.value) is type(theirs.value)


def test_a_write_whose_sources_lie_elsewhere_in_the_ring_copies_them_out_first(ring):
    collate = CollateIntoRing()
    collate.target = (ring, 0)
    a, b = collate([(torch.full((4,), 1.0), torch.full((4,), 2.0)) for _ in range(3)])
    expected_a, expected_b = a.clone(), b.clone()
    assert ring.write(0, [b, a]) == a.numel() * 4 + b.numel() * 4  # swapped: both overlap their targets
    reader = RingReader(ring.path, ring.slots, ring.slot_bytes)
    try:
        got_b, got_a = reader.read(0, [(torch.float32, (3, 4)), (torch.float32, (3, 4))])
    finally:
        reader.close()
    assert torch.equal(got_a, expected_a) and torch.equal(got_b, expected_b)


def test_a_copy_of_the_collate_holds_no_ring(ring):
    collate = CollateIntoRing()
    collate.target = (ring, 0)
    copy = pickle.loads(pickle.dumps(collate))
    assert copy.target is None
    assert not ring.holds(copy([torch.ones(2), torch.ones(2)]))
