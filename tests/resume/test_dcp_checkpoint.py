"""torch.distributed.checkpoint (DCP) on real gloo process groups: save with 2 processes, load with 3 and 2.

A prepared loader has ``state_dict()`` / ``load_state_dict()``, so DCP treats it as ``Stateful``: put it
in the state dict of ``dcp.save`` / ``dcp.load`` as it is. Two processes consume part of a shuffled
epoch and save; three processes load and finish the epoch (a resize, with padding at its end), and
two processes load and continue with exactly the batches the uninterrupted run yielded.

DCP writes a value that is not a sharded tensor once, from one process: every process loads that one
copy (``writer`` below shows it). That is safe for the loader because its position is the same on every
process.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run_gloo
from torch.utils.data import DataLoader

from shardplug import SampleAudit, prepare_data_loader

N, B, STOP = 22, 2, 2  # two processes stop after 2 batches each: 8 samples; 14 are left for the resumed runs
KINDS = ("seed", "generator", "workers")  # the shuffle's seed drawn by shardplug, a torch.Generator, DataLoader workers


def _loader(kind: str):
    options: dict[str, Any] = {
        "seed": {},
        "generator": {"generator": torch.Generator().manual_seed(7)},  # its state is a tensor in the position
        "workers": {"num_workers": 2},
    }[kind]
    loader = prepare_data_loader(DataLoader(range(N), batch_size=B, shuffle=True, **options))
    loader.enable_audit()
    return loader


def _model_state(fill: float) -> dict[str, torch.Tensor]:
    return {"weight": torch.full((2, 3), fill), "bias": torch.full((2,), fill)}


def _next(loader, batches) -> tuple[list[int], int]:
    batch = next(batches)
    return batch.tolist(), loader.batch_real_count  # the samples of the batch after the first real_count are padding


def _first_run(rank: int, world: int, root: str) -> dict[str, dict]:
    out = {}
    for kind in KINDS:
        loader = _loader(kind)
        batches = iter(loader)
        first = [_next(loader, batches) for _ in range(STOP)]
        audit = loader.audit.gathered()  # a collective: every process's record
        position = loader.state_dict()
        state = {"loader": loader, "model": _model_state(1.5), "writer": rank}
        dcp.save(state, checkpoint_id=os.path.join(root, kind))
        rest = []  # the uninterrupted run goes on
        for _ in range(len(loader) - STOP):
            rest.append(_next(loader, batches))
        out[kind] = {"first": first, "rest": rest, "audit": audit.state_dict(), "position": position}
    return out


def _resumed_run(rank: int, world: int, root: str) -> dict[str, dict]:
    out = {}
    for kind in KINDS:
        loader = _loader(kind)  # a fresh loader in a job of `world` processes
        state = {"loader": loader, "model": _model_state(0.0), "writer": -1}
        dcp.load(state, checkpoint_id=os.path.join(root, kind))
        length = len(loader)
        batches = iter(loader)
        rest = [_next(loader, batches) for _ in range(length)]
        assert next(batches, None) is None, "the resumed pass yielded more than len(loader)"
        audit = loader.audit.gathered()
        model = {k: v.tolist() for k, v in state["model"].items()}
        out[kind] = {
            "length": length,
            "rest": rest,
            "audit": audit.state_dict(),
            "model": model,
            "writer": state["writer"],
        }
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    return root, run_gloo(_first_run, root, world_size=2, timeout=120)


@pytest.fixture(scope="module")
def resized(checkpoints):
    root, _ = checkpoints
    return run_gloo(_resumed_run, root, world_size=3, timeout=120)


@pytest.fixture(scope="module")
def same_size(checkpoints):
    root, _ = checkpoints
    return run_gloo(_resumed_run, root, world_size=2, timeout=120)


def _plain(position: dict) -> dict:
    state = position["generator_state"]
    return {**position, "generator_state": None if state is None else state.tolist()}


def _real(batches: list[tuple[list[int], int]]) -> list[int]:
    return [i for batch, real in batches for i in batch[:real]]


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_load_with_three_processes_finishes_the_epoch_exactly_once(kind, checkpoints, resized):
    _, first_run = checkpoints
    first = [r[kind] for r in first_run]
    after = [r[kind] for r in resized]
    assert _plain(first[0]["position"]) == _plain(first[1]["position"]), "the position is the same on every process"
    # equal batch counts on the three processes: ceil(14 / (3 * 2)) = 3 steps, 4 of their 18 samples padding
    assert [a["length"] for a in after] == [3, 3, 3]
    assert [len(a["rest"]) for a in after] == [3, 3, 3]
    consumed = [i for r in first for i in _real(r["first"])] + [i for a in after for i in _real(a["rest"])]
    assert sorted(consumed) == list(range(N)), "every sample of the epoch exactly once, padding apart"
    assert sum(B - real for a in after for _, real in a["rest"]) == 4
    audit = SampleAudit(N)
    audit.load_state_dict(first[0]["audit"])  # the gathered records are the same on every process
    audit.load_state_dict(after[0]["audit"])
    report = audit.report(0)
    assert report.exact and report.padding == 4, report
    assert all(a["model"] == {"weight": [[1.5] * 3] * 2, "bias": [1.5] * 2} for a in after)


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_load_with_the_same_processes_continues_the_uninterrupted_run(kind, checkpoints, same_size):
    _, first_run = checkpoints
    for rank in range(2):
        uninterrupted, resumed = first_run[rank][kind], same_size[rank][kind]
        assert resumed["length"] == len(uninterrupted["rest"]) == 4  # 6 steps of 2 x 2 samples, 2 of them consumed
        assert resumed["rest"] == uninterrupted["rest"], f"process {rank}"


def test_dcp_keeps_one_copy_of_a_value_every_process_writes(checkpoints, resized, same_size):
    # not a sharded tensor: DCP deduplicates it, and every process loads the copy of one of the writers
    for run in (resized, same_size):
        writers = {r[kind]["writer"] for r in run for kind in KINDS}
        assert len({r["seed"]["writer"] for r in run}) == 1 and writers <= {0, 1}
