"""A Mixture prepared on real gloo process groups, interrupted and resumed on other numbers of processes.

One launch of 4 ranks runs every case (:func:`_cases`): each case is a chain of stages, a stage being a run on
``n`` of the ranks (``num_processes=n``) that takes some steps and saves the loader's ``state_dict()``, which the
next stage (another ``n``, maybe another Mixture: new weights, an added source) loads.  The test puts each chain's
batches back into the global order (step by step, rank by rank) and checks it against the order an uninterrupted
run reads, which one case runs for real.

Sources: web (10,000 samples), code (10,000), math (100: 100 times smaller), weighted 0.5 / 0.3 / 0.2; an item
names its source and sample (source * 1,000,000 + sample).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_gloo, worker_context
from torch.utils.data import DataLoader

import shardplug
from shardplug.core.shuffle.mixture_order import MixtureOrder

SOURCES = {"web": (1, 10_000), "code": (2, 10_000), "math": (3, 100)}
CODES = {**{code: name for name, (code, _) in SOURCES.items()}, 4: "books"}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
NEW_WEIGHTS = {"web": 0.2, "code": 0.3, "math": 0.4, "books": 0.1}
SCHEDULE = [(0, WEIGHTS), (9_000, {"web": 0, "code": 0, "math": 1})]
SEED = 11
S = 20_100
WINDOW = 10_000


def _sources(added: bool = False) -> dict[str, list[int]]:
    sources = {name: [code * 1_000_000 + k for k in range(n)] for name, (code, n) in SOURCES.items()}
    if added:
        sources["books"] = [4_000_000 + k for k in range(50)]
    return sources


def _mixture(weights: Any = "plain") -> shardplug.Mixture:
    if weights == "new":
        return shardplug.Mixture(_sources(added=True), NEW_WEIGHTS, seed=SEED, samples_per_epoch=S)
    return shardplug.Mixture(_sources(), SCHEDULE if weights == "schedule" else WEIGHTS, seed=SEED)


# (name, options, stages: (processes, steps, weights))
CASES: list[tuple[str, dict[str, Any], list[tuple[int, int, str]]]] = [
    ("uninterrupted on 3", {"batch_size": 8}, [(3, 1_000, "plain")]),
    (
        "chain 3 -> 2 -> 4 -> 1",
        {"batch_size": 8},
        [(3, 300, "plain"), (2, 250, "plain"), (4, 200, "plain"), (1, 1_200, "plain")],
    ),
    (
        "3 -> 2, split_batches, 2 workers",
        {"batch_size": 12, "split_batches": True, "workers": 2},
        [(3, 150, "plain"), (2, 150, "plain")],
    ),
    (
        "3 -> 4, stateful loader, 2 workers",
        {"batch_size": 8, "stateful": True, "workers": 2},
        [(3, 150, "plain"), (4, 150, "plain")],
    ),
    (
        "3 -> 4 -> 1, split_batches",
        {"batch_size": 12, "split_batches": True},
        [(3, 100, "plain"), (4, 100, "plain"), (1, 100, "plain")],
    ),
    (
        "4 dispatched -> 3 -> 4 dispatched",
        {"batch_size": 8, "dispatch": True},
        [(4, 100, "plain"), (3, 100, "plain"), (4, 400, "plain")],
    ),
    ("3 -> 2 with new weights and a source added", {"batch_size": 8}, [(3, 300, "plain"), (2, 400, "new")]),
    ("3 -> 2 across a scheduled step", {"batch_size": 8}, [(3, 350, "schedule"), (2, 200, "schedule")]),
]


def _index(name: str) -> int:
    return [case[0] for case in CASES].index(name)


def _stage(
    rank: int, processes: int, steps: int, weights: str, options: dict[str, Any], state: Any
) -> tuple[Any, list]:
    """This rank's batches of one stage (``None`` for a rank outside it) and the stage's saved state."""
    if rank >= processes:
        return None, []
    workers = options.get("workers", 0)
    dispatch = options.get("dispatch", False) and processes == dist.get_world_size()
    loader = shardplug.prepare_data_loader(
        DataLoader(
            _mixture(weights),
            batch_size=options["batch_size"],
            shuffle=rank % 2 == 1,  # shuffle=True and False read the mixture's own order alike
            num_workers=workers,
            multiprocessing_context=worker_context(workers, preload=["shardplug"]),
            persistent_workers=bool(workers),
        ),
        num_processes=processes,
        process_index=rank,
        split_batches=options.get("split_batches", False),
        use_stateful_dataloader=options.get("stateful", False),
        # dispatch: process 0 reads for every process of the group, so only a stage on all the ranks
        **({"dispatch_batches": True, "put_on_device": True, "device": "cpu"} if dispatch else {}),
    )
    loader.track_padding()
    if state is not None:
        loader.load_state_dict(state)
    batches, epoch = [], loader.epoch
    while len(batches) < steps:
        loader.set_epoch(epoch)
        for batch in loader:
            real = loader.batch_real_count
            if dispatch:  # the rows came from process 0: no indices here
                batches.append((epoch, None, batch.tolist()[:real]))
            else:
                sources = loader.batch_sources
                assert [CODES[item // 1_000_000] for item in batch.tolist()] == sources, (
                    "batch_sources names each row's source"
                )
                batches.append((epoch, loader.batch_indices[:real], batch.tolist()[:real]))
            if len(batches) == steps:
                break
        else:
            epoch += 1
    return loader.state_dict(), batches


def _cases(rank: int, world: int) -> list[list[list[Any]]]:
    out = []
    for _, options, stages in CASES:
        state, runs = None, []
        for processes, steps, weights in stages:
            saved, batches = _stage(rank, processes, steps, weights, options, state)
            box = [saved]
            dist.broadcast_object_list(box, src=0)  # every stage's state is the same on its processes: rank 0's
            state = box[0]
            runs.append(batches)
        out.append(runs)
    return out


@pytest.fixture(scope="module")
def runs() -> list[list[list[list[Any]]]]:
    return run_gloo(_cases, world_size=4, timeout=240)


def _global(runs: list[list[list[Any]]], case: int) -> list[tuple[int, int]]:
    """The case's (global position, item) pairs in the job's global order: each stage's steps in turn, each
    step's batches (or slices) rank by rank."""
    out = []
    for stage, (processes, _, _) in enumerate(CASES[case][2]):
        parts = [runs[rank][case][stage] for rank in range(processes)]
        for step in range(max(len(p) for p in parts)):
            for part in parts:
                if step < len(part):
                    epoch, indices, items = part[step]
                    if indices is None:  # a dispatched stage: its rows' items are checked, their places taken in turn
                        indices = [len(out) - epoch * S + k for k in range(len(items))]
                    out += [(epoch * S + i, item) for i, item in zip(indices, items)]
    return out


def _expected(case: int, count: int) -> list[int]:
    """The items an uninterrupted run reads at the first ``count`` positions (for a case whose weights
    change at its resume: the saved order up to the resume, then the new weights, as a Mixture computes it)."""
    stages = CASES[case][2]
    mixture = _mixture(stages[0][2])
    if stages[-1][2] == "new":
        at = stages[0][0] * stages[0][1] * CASES[case][1]["batch_size"]
        new = _mixture("new")
        new.continue_from(at, mixture.order.state())
        mixture = new
    return [mixture[p] for p in range(count)]


def _source_streams(items: list[int]) -> dict[str, list[int]]:
    streams: dict[str, list[int]] = {}
    for item in items:
        streams.setdefault(CODES[item // 1_000_000], []).append(item % 1_000_000)
    return streams


@pytest.mark.parametrize("case", range(len(CASES)), ids=[name for name, _, _ in CASES])
def test_the_global_sequence_is_the_uninterrupted_runs(runs: Any, case: int) -> None:
    consumed = _global(runs, case)
    positions = [p for p, _ in consumed]
    assert positions == list(range(len(positions))), "every position once, in order, across every resize"
    assert [item for _, item in consumed] == _expected(case, len(consumed))
    if case:  # the real uninterrupted run reads what the chains read
        reference = [item for _, item in _global(runs, 0)]
        same = min(len(reference), len(consumed), 3 * 8 * 300 if CASES[case][2][-1][2] == "new" else len(consumed))
        if CASES[case][2][0][2] == "plain":
            assert [item for _, item in consumed][:same] == reference[:same]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[name for name, _, _ in CASES])
def test_every_sample_once_per_source_cycle(runs: Any, case: int) -> None:
    items = [item for _, item in _global(runs, case)]
    order = MixtureOrder.from_state(_mixture("new" if CASES[case][2][-1][2] == "new" else "plain").order.state())
    for name, samples in _source_streams(items).items():
        length = order.lengths[name]
        stream = []
        for cycle in range(-(-len(samples) // length)):
            stream += order.permutation(name, cycle)(torch.arange(length)).tolist()
        assert samples == stream[: len(samples)], f"{name}: its cycles' permutations, each sample once per cycle"


def test_the_windowed_shares_hold_over_the_chain(runs: Any) -> None:
    items = [item for _, item in _global(runs, 1)]
    assert len(items) > 2 * WINDOW
    names = [CODES[item // 1_000_000] for item in items]
    for name, weight in WEIGHTS.items():
        running = names[:WINDOW].count(name)
        for p in range(WINDOW, len(names) + 1):
            assert abs(running / WINDOW - weight) <= 0.001, (name, p)
            if p < len(names):
                running += (names[p] == name) - (names[p - WINDOW] == name)


def test_new_weights_and_an_added_source_go_on_from_the_saved_position(runs: Any) -> None:
    case = _index("3 -> 2 with new weights and a source added")
    at = 3 * 300 * 8
    consumed = _global(runs, case)
    after = [CODES[item // 1_000_000] for _, item in consumed[at:]]
    assert "books" in after and "books" not in [CODES[i // 1_000_000] for _, i in consumed[:at]]
    for name, weight in NEW_WEIGHTS.items():
        assert abs(after.count(name) / len(after) - weight) <= 0.002, name


def test_a_scheduled_step_takes_effect_at_exactly_its_position_across_a_resize(runs: Any) -> None:
    consumed = _global(runs, _index("3 -> 2 across a scheduled step"))
    step = SCHEDULE[1][0]
    assert 3 * 350 * 8 < step < len(consumed), "the step falls after the resume"
    assert all(item // 1_000_000 == 3 for _, item in consumed[step:]), "only math from the step on"
    assert {item // 1_000_000 for _, item in consumed[step - 200 : step]} == {1, 2, 3}
