"""The audit gathers and reports in bounded chunks (issue item 6; memory: benchmarks/run.py P7):
its reports are those of a plain count per sample, for one process and for gloo groups, across
chunk boundaries (the chunks are made tiny here)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_gloo
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplug import SampleAudit
from shardplug.core.padding import audit as audit_module


def _expected(n, records, limit=SampleAudit.report_ids):
    """(seen, missing, duplicated, padding, missing_count, duplicated_count) from plain counts."""
    counts = torch.zeros(n, dtype=torch.int64)
    padding = 0
    for indices, real in records:
        counts.index_add_(0, torch.tensor(indices[:real], dtype=torch.int64), torch.ones(real, dtype=torch.int64))
        padding += len(indices) - real
    missing = (counts == 0).nonzero().flatten().tolist()
    duplicated = (counts > 1).nonzero().flatten().tolist()
    return int((counts > 0).sum()), missing[:limit], duplicated[:limit], padding, len(missing), len(duplicated)


def _summary(report):
    return (
        report.seen,
        report.missing,
        report.duplicated,
        report.padding,
        report.missing_count,
        report.duplicated_count,
    )


@st.composite
def audits(draw):
    n = draw(st.integers(1, 300))
    batches = draw(st.lists(st.tuples(st.lists(st.integers(0, n - 1), max_size=40), st.integers(0, 40)), max_size=12))
    return n, [(ids, min(real, len(ids))) for ids, real in batches]


@settings(max_examples=200, deadline=None)
@given(case=audits(), limit=st.sampled_from([1, 3, 100]))
def test_report_equals_plain_counts_across_chunk_boundaries(case, limit):
    n, records = case
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(audit_module, "_CHUNK", 3)
        patch.setattr(audit_module, "_GATHER_CHUNK", 5)
        patch.setattr(SampleAudit, "report_ids", limit)
        audit = SampleAudit(n)
        for ids, real in records:
            audit.record(0, ids, real)
        assert _summary(audit.report(0)) == _expected(n, records, limit)
        assert _summary(audit.gathered().report(0)) == _expected(n, records, limit), "one process: a copy"
        again = SampleAudit(n)
        again.load_state_dict(audit.state_dict())
        again.load_state_dict(audit.state_dict())  # loading adds: everything seen is now seen twice
        doubled = records + records
        assert _summary(again.report(0)) == _expected(n, doubled, limit)


def _gather_in_chunks(rank, world, n, cases):
    audit_module._CHUNK, audit_module._GATHER_CHUNK = 3, 5
    results = []
    for per_rank in cases:
        audit = SampleAudit(n)
        for ids, real in per_rank[rank]:
            audit.record(0, ids, real)
        audit.record(1, [rank], 1)  # an epoch every process has
        if rank == 0:
            audit.record(2, [n - 1, n - 1], 2)  # an epoch only process 0 has, with a duplicate
        gathered = audit.gathered()
        results.append([_summary(gathered.report(e)) for e in range(3)])
    return results


def test_gathered_reports_equal_plain_counts_over_gloo():
    n, world = 203, 3
    disjoint = [[(list(range(r, n, world)), len(range(r, n, world)))] for r in range(world)]
    overlapping = [list(records) for records in disjoint]
    overlapping[1].append(([0, 5, 5, 7], 3))  # 0 and 5 were process 0's / seen twice here; 7 is padding
    results = run_gloo(_gather_in_chunks, n, [disjoint, overlapping], world_size=world)
    for case, per_rank in enumerate([disjoint, overlapping]):
        every = [record for records in per_rank for record in records]
        expected = [
            _expected(n, every),
            _expected(n, [([r], 1) for r in range(world)]),
            _expected(n, [([n - 1] * 2, 2)]),
        ]
        assert all(result[case] == expected for result in results), case
