"""Several processes and no process group (``torchrun`` without ``init_process_group``, or explicit
``num_processes=``): an order the processes could agree on only through the group is refused at
``prepare_data_loader`` with the fix; an order that needs no agreement is prepared as ever."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dist import run_torchrun
from torch.utils.data import DataLoader, RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from shardplug import prepare_data_loader
from shardplug.core.shuffle.seedable import BijectiveRandomSampler, SeedableRandomSampler

NO_GROUP = "no process group is initialised"
INIT = "Initialise the process group first (torch.distributed.init_process_group(...) before prepare_data_loader)"


def _shards(results: list[dict], case: str) -> list[list[list[int]]]:
    """Each rank's rows of ``case`` per epoch (a rank's error fails the test with its message)."""
    for rank, result in enumerate(results):
        assert "rows" in result[case], f"rank {rank}, {case}: {result[case]}"
    return [result[case]["rows"] for result in results]


def _assert_disjoint_and_complete(shards: list[list[list[int]]], n: int) -> None:
    for epoch in zip(*shards):
        assert sorted(row for part in epoch for row in part) == list(range(n))  # each sample once


def test_under_torchrun_without_a_group_only_orders_that_need_no_agreement_are_prepared(tmp_path):
    script = Path(__file__).parents[1] / "scripts" / "no_process_group.py"
    done = run_torchrun(script, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):  # refused on both processes, each naming itself and the fixes
        error = result["shuffle"].get("error", "")
        assert f"num_processes=2 processes (this is process {rank})" in error, result["shuffle"]
        assert NO_GROUP in error and INIT in error and "data_seed=" in error
        error = result["stream_on_device"].get("error", "")
        assert NO_GROUP in error and INIT in error and "dispatch_batches=False" in error, result["stream_on_device"]
    _assert_disjoint_and_complete(_shards(results, "sequential"), 20)  # unshuffled: nothing to agree
    _assert_disjoint_and_complete(_shards(results, "seeded"), 20)  # data_seed: agreed without a group
    seeded = _shards(results, "seeded")[0]
    assert seeded[0] != seeded[1]  # a shuffle all the same: each epoch its own order
    _assert_disjoint_and_complete(_shards(results, "shuffle_with_group"), 20)
    # a script that does not catch it ends with the refusal
    assert done.returncode != 0 and NO_GROUP in done.stderr, done.stderr[-3000:]


def _loader(sampler=None, **kwargs) -> DataLoader:
    return DataLoader(range(12), batch_size=2, sampler=sampler, **kwargs)


# (a DataLoader, prepare_data_loader's options, the fix its refusal names, the options of that fix)
REFUSED = {
    "shuffle": (lambda: _loader(shuffle=True), {}, "pass data_seed=", {"data_seed": 5}),
    "single samples": (
        lambda: DataLoader(range(12), batch_size=None, shuffle=True),
        {},
        "data_seed=",
        {"data_seed": 5},
    ),
    "bijective": (
        lambda: _loader(shuffle=True),
        {"shuffle_algorithm": "bijective"},
        "pass data_seed=",
        {"shuffle_algorithm": "bijective", "data_seed": 5},
    ),
    "seedable, own generator": (
        lambda: _loader(shuffle=True, generator=torch.Generator()),
        {"use_seedable_sampler": True},
        "pass data_seed=",
        {"use_seedable_sampler": True, "data_seed": 5},
    ),
    "subset": (lambda: _loader(SubsetRandomSampler(range(12))), {}, "pass data_seed=", {"data_seed": 5}),
    "weighted": (lambda: _loader(WeightedRandomSampler([1.0] * 12, 12)), {}, "pass data_seed=", {"data_seed": 5}),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_explicit_processes_without_a_group_refuse_an_unagreed_order_and_the_fix_works(case):
    make, options, fix, fixed = REFUSED[case]
    with pytest.raises(ValueError, match="this is process 1") as refused:
        prepare_data_loader(make(), num_processes=2, process_index=1, **options)
    assert NO_GROUP in str(refused.value) and INIT in str(refused.value) and fix in str(refused.value)
    assert prepare_data_loader(make(), **options) is not None  # one process agrees with itself
    whole = [torch.as_tensor(batch).reshape(-1).tolist() for batch in prepare_data_loader(make(), **fixed)]
    for rank in range(2):  # the fix: each process draws that one order without a group, and reads its part
        torch.manual_seed(rank)  # the processes' own RNGs differ
        loader = prepare_data_loader(make(), num_processes=2, process_index=rank, **fixed)
        assert [torch.as_tensor(batch).reshape(-1).tolist() for batch in loader] == whole[rank::2]


def test_without_a_group_an_unseeded_sampler_of_your_own_is_refused_and_a_seeded_one_prepared():
    for sampler in (SeedableRandomSampler(range(12)), BijectiveRandomSampler(range(12))):  # data_seed misses it
        with pytest.raises(ValueError, match=rf"or give the {type(sampler).__name__} a data_seed="):
            prepare_data_loader(_loader(sampler), num_processes=2, process_index=0)
    # unshuffled, or seeded: a seeded sampler, a generator of your own (seeded alike on every process)
    for make in (
        lambda: _loader(),
        lambda: _loader(SeedableRandomSampler(range(12), data_seed=3)),
        lambda: _loader(shuffle=True, generator=torch.Generator().manual_seed(3)),
        lambda: _loader(SubsetRandomSampler(range(12), generator=torch.Generator().manual_seed(3))),
    ):
        shards = [prepare_data_loader(make(), num_processes=2, process_index=r) for r in range(2)]
        assert sorted(int(v) for shard in shards for batch in shard for v in batch) == list(range(12))
    seeded = _loader(RandomSampler(range(12), generator=torch.Generator()))  # the bijection takes its seed
    prepare_data_loader(seeded, num_processes=2, process_index=0, shuffle_algorithm="bijective")
