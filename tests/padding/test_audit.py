"""The audit at scale (docs/semantics.md): two bits per sample and epoch, one collective to gather,
reports that summarise; exact about duplicates also across processes."""

from __future__ import annotations

import io

import pytest
import torch
from _dist import run_gloo

from shardplug import SampleAudit


def test_at_most_two_bits_per_sample_and_epoch():
    n = 10_000_003
    audit = SampleAudit(n)
    audit.record(0, [5, n - 1], 2)
    assert audit.nbytes == (n + 7) // 8, "an epoch without duplicates holds one bit a sample"
    audit.record(1, [5, 5], 2)
    assert audit.nbytes == 3 * ((n + 7) // 8), "a duplicate adds the seen-twice bitmap of its epoch"
    state = audit.state_dict()
    sizes = sum(t.numel() * t.element_size() for t in state["epochs"][0].values() if isinstance(t, torch.Tensor))
    assert sizes == 2 * ((n + 7) // 8), "seen + seen-twice bitmaps: n / 4 bytes an epoch"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    loaded = SampleAudit(n)
    loaded.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    report = loaded.report(0)
    assert (report.seen, report.missing_count, report.duplicated_count) == (2, n - 2, 0)
    assert report.missing == list(range(5)) + list(range(6, SampleAudit.report_ids + 1)), "the first missing ids"


def test_duplicates_within_a_batch_and_across_batches_are_seen_twice():
    audit = SampleAudit(20)
    audit.record(0, [1, 1, 2, 9, 9, 9], 6)
    audit.record(0, [2, 3, 0, 0], 2)  # two real, two padding
    report = audit.report(0)
    assert report.duplicated == [1, 2, 9] and report.duplicated_count == 3
    assert (report.seen, report.padding) == (4, 2)
    assert not report.exact


def test_a_saved_count_record_of_shardplug_0_1_still_loads():
    counts = torch.zeros(10, dtype=torch.int32)
    counts[[0, 1, 2]] = 1
    counts[3] = 2
    audit = SampleAudit(10)
    audit.load_state_dict({"dataset_length": 10, "epochs": {0: {"counts": counts, "padding": 1}}})
    report = audit.report(0)
    assert (report.seen, report.duplicated, report.missing, report.padding) == (4, [3], [4, 5, 6, 7, 8, 9], 1)


def test_old_epochs_can_be_dropped():
    audit = SampleAudit(8)
    for epoch in range(3):
        audit.record(epoch, list(range(8)), 8)
    audit.drop_epoch(0)
    assert audit.epochs == [1, 2] and audit.report(1).exact


def _gather(rank, world, records):
    audit = SampleAudit(12)
    for indices in records[rank]:
        audit.record(0, indices, len(indices))
    report = audit.gathered().report(0)
    return report.seen, report.missing, report.duplicated, report.exact


@pytest.mark.parametrize(
    "records, expected",
    [
        ([[[0, 1, 2, 3, 4, 5]], [[6, 7, 8, 9, 10, 11]]], (12, [], [], True)),  # disjoint: one collective
        ([[[0, 1, 2, 3]], [[3, 4, 5]]], (6, list(range(6, 12)), [3], False)),  # seen by two processes
        ([[[0, 1]], [[1, 2]], [[1, 3]]], (4, list(range(4, 12)), [1], False)),  # by three (odd)
    ],
)
def test_gathering_is_exact_about_samples_seen_by_several_processes(records, expected):
    results = run_gloo(_gather, records, world_size=len(records))
    assert all(tuple(r) == expected for r in results)
