"""Real gloo process groups (2 and 3 processes): shuffles, dispatch, iterable data with workers (one spawn
per number of processes runs every scenario; a dispatching loader resumed: tests/resume/test_dispatch_resume.py)."""

from __future__ import annotations

import _distributed_sampler as ddp
import pytest
import torch
from _datasets import NO_LEN, Pair, Records, Stream, Unsized, rows
from _dist import run_gloo, worker_context
from test_samplers import EvenRandomSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import shardplug
from shardplug.core.shuffle.seedable import BijectiveRandomSampler, SeedableRandomSampler


class Named(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        return {"x": torch.tensor(i), "name": f"item{i}"}


class Ragged(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.zeros((1,) * (1 + (i // 2) % 2))  # batches of 2: shape (2, 1) then (2, 1, 1)


def _ids(batch):
    return batch["x"][:, 0].tolist()


USER_GENERATOR_SHUFFLES = {  # prepare_data_loader's options (None: a SeedableRandomSampler of your own)
    "randperm": {},
    "seedable": {"use_seedable_sampler": True},
    "bijective": {"shuffle_algorithm": "bijective"},  # with 2 DataLoader workers
    "own_seedable_sampler": None,  # SeedableRandomSampler(range(40), generator=the generator)
}


def _scenarios(rank: int, world: int) -> dict:
    torch.manual_seed(100 + rank)  # processes seeded differently on purpose
    out: dict = {}

    loader = shardplug.prepare_data_loader(DataLoader(range(40), batch_size=4, shuffle=True))
    out["shuffle"] = [[b.tolist() for b in loader] for _ in range(3)]

    out["shuffle_user_generator"] = {}
    for name, options in USER_GENERATOR_SHUFFLES.items():
        gen = torch.Generator().manual_seed(rank)  # a user generator, seeded differently per process
        workers = 2 if name == "bijective" else 0
        sampling = (
            {"shuffle": True, "generator": gen}
            if options is not None
            else {"sampler": SeedableRandomSampler(range(40), generator=gen)}
        )
        loader = shardplug.prepare_data_loader(
            DataLoader(
                range(40),
                batch_size=4,
                num_workers=workers,
                persistent_workers=workers > 0,
                multiprocessing_context=worker_context(workers),
                **sampling,
            ),
            **(options or {}),
        )
        out["shuffle_user_generator"][name] = [[b.tolist() for b in loader] for _ in range(2)]

    sampler = EvenRandomSampler(range(40))  # a user's RandomSampler subclass (even indices) without a generator
    loader = shardplug.prepare_data_loader(DataLoader(range(40), batch_size=4, sampler=sampler))
    out["subclass"] = [[b.tolist() for b in loader] for _ in range(2)]
    out["subclass_epochs"] = sampler.epochs

    loader = shardplug.prepare_data_loader(
        DataLoader(Records(11), batch_size=3), put_on_device=True, device="cpu", dispatch_batches=True
    )
    batches = list(loader)
    out["dispatch"] = [_ids(b) for b in batches]
    out["dispatch_nested_ok"] = all(
        b["parts"][1].tolist() == [-v for v in b["parts"][0].tolist()]
        and isinstance(b["pair"], Pair)
        and b["pair"].b.tolist() == [2 * v for v in b["pair"].a.tolist()]
        for b in batches
    )
    out["dispatch_len"] = len(loader)

    loader = shardplug.prepare_data_loader(
        DataLoader(Records(10), batch_size=2 * world), put_on_device=True, dispatch_batches=True, split_batches=True
    )
    out["dispatch_split"] = [_ids(b) for b in loader]

    loader = shardplug.prepare_data_loader(DataLoader(Named(), batch_size=2), put_on_device=True, dispatch_batches=True)
    out["dispatch_strings"] = [(b["x"].tolist(), b["name"]) for b in loader]
    for name, dataset in (("dispatch_error_ragged", Ragged()),):
        loader = shardplug.prepare_data_loader(
            DataLoader(dataset, batch_size=2), put_on_device=True, dispatch_batches=True
        )
        try:
            list(loader)
            out[name] = None
        except Exception as exc:  # the same clear error must reach every process
            out[name] = f"{type(exc).__name__}: {exc}"

    loader = shardplug.prepare_data_loader(
        DataLoader(Stream(23), batch_size=2, num_workers=2, multiprocessing_context=worker_context(2))
    )
    out["iterable_workers"] = [b.tolist() for b in loader]
    out["iterable_workers_len"] = len(loader)
    out["unsized_len"] = {}
    for name, options in (("read_all", {}), ("dispatch", {"put_on_device": True})):
        unsized = shardplug.prepare_data_loader(DataLoader(Unsized(5), batch_size=2, num_workers=2), **options)
        try:
            out["unsized_len"][name] = len(unsized)
        except TypeError as exc:  # the type torch and len() callers expect
            out["unsized_len"][name] = str(exc)

    loader = shardplug.prepare_data_loader(DataLoader(range(11), batch_size=2))
    loader.track_padding()
    out["gathered"] = [shardplug.gather_for_metrics(batch, loader).tolist() for batch in loader]

    from torch.distributed.device_mesh import init_device_mesh

    replicated = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "tp"))
    sharded = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_shard", "tp"))
    out["mesh_tp"] = rows(
        shardplug.prepare_data_loader(DataLoader(range(6), batch_size=2), torch_device_mesh=replicated)
    )
    out["mesh_dp"] = rows(shardplug.prepare_data_loader(DataLoader(range(6), batch_size=1), torch_device_mesh=sharded))

    loader = shardplug.prepare_data_loader(DataLoader(Stream(9), batch_size=2), put_on_device=True)
    out["iterable_dispatch"] = [(b.tolist(), loader.end_of_dataloader) for b in loader]
    out["iterable_dispatch_class"] = type(loader).__name__

    try:  # a user's DistributedSampler adopted (its own failure fails its own tests only)
        out["distributed_sampler"] = ddp.scenarios(rank, world, worker_context)
    except Exception as exc:
        out["distributed_sampler"] = f"{type(exc).__name__}: {exc}"
    out["token_budget"] = _token_budget(rank, world)
    return out


BUDGET_LENGTHS = [int(v) for v in torch.randint(1, 100, (60,), generator=torch.Generator().manual_seed(5))]


def _budget_loader(**where):
    sampler = shardplug.TokenBudgetBatchSampler(BUDGET_LENGTHS, 400, cost="attention", seed=3)
    return shardplug.prepare_data_loader(DataLoader(range(60), batch_sampler=sampler), **where)


def _token_budget(rank: int, world: int) -> dict:
    """Token budgets on a real group: an epoch with each step's totals beside their all-reduced sums (accumulation
    2), and the rest of an epoch whose position another number of processes saved (built without a group)."""
    import torch.distributed as dist

    out: dict = {}
    loader = _budget_loader()
    out["len"], out["batches"], out["totals"], out["reduced"] = len(loader), [], [], []
    group: list[torch.Tensor] = []
    for batch in loader:
        out["batches"].append(batch.tolist())
        out["totals"].append(tuple(shardplug.step_totals(loader, accumulation_steps=2)))
        counts = torch.tensor([sum(BUDGET_LENGTHS[i] for i in batch.tolist()), len(batch)])
        dist.all_reduce(counts)
        group.append(counts)
        if len(group) == 2 or len(out["batches"]) == out["len"]:
            out["reduced"] += [tuple(int(v) for v in sum(group).tolist())] * len(group)
            group = []
    other = 3 if world == 2 else 2
    saved = [_budget_loader(num_processes=other, process_index=i) for i in range(other)]
    iterators = [iter(part) for part in saved]
    out["seen"] = [i for _ in range(2) for it in iterators for i in next(it).tolist()]
    resumed = _budget_loader()
    resumed.load_state_dict(saved[0].state_dict())
    out["resumed_len"] = len(resumed)
    out["resumed"] = [batch.tolist() for batch in resumed]
    sampler = shardplug.TokenBudgetBatchSampler(BUDGET_LENGTHS, 400, seed=3 + (rank == world - 1))
    try:  # the last process seeded otherwise: refused on every process, before any step
        shardplug.prepare_data_loader(DataLoader(range(60), batch_sampler=sampler))
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    try:  # its own failure fails its own tests only (a refusal when the loader is prepared: on every process)
        out["dispatch"] = _token_budget_dispatch(world, saved[0].state_dict())
    except Exception as exc:
        out["dispatch"] = f"{type(exc).__name__}: {exc}"
    return out


DISPATCH = {"dispatch_batches": True, "put_on_device": True, "device": "cpu"}
PADDED_LENGTHS = [390] * 7  # a micro-batch each: the last step pads all processes but one (2 and 3 processes)


class Tokens(Dataset):
    """Sample i: lengths[i] tokens, each the id i."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.lengths[i],), i)


def _handed_out(loader, stop: int | None = None) -> list[dict]:
    """Each batch (as lists) with what the loader says of it: its real count, samples and step's totals."""
    seen = []
    for batch in loader:
        values = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        totals = tuple(shardplug.step_totals(loader, accumulation_steps=2))
        seen.append(
            {"batch": values, "real": loader.batch_real_count, "indices": loader.batch_indices, "totals": totals}
        )
        if len(seen) == stop:
            break
    return seen


def _token_budget_dispatch(world: int, other_position: dict) -> dict:
    """A token budget dispatched (process 0 reads, with 2 DataLoader workers in the first epoch; each process
    receives its own micro-batch, packed) beside the same loader read by every process itself: an epoch with
    padding, marks, totals and the audit; a position saved after 2 steps, resumed on as many processes and on the
    other number (3 -> 2, 2 -> 3, that side built without a group), and the other number's position resumed here;
    a StatefulDataLoader's position resumed on as many processes."""
    out: dict = {}

    def budget(lengths: list[int], dispatch: bool, workers: int = 0, **options):
        sampler = shardplug.TokenBudgetBatchSampler(lengths, 400, cost="attention", seed=3)
        reading = {"num_workers": workers, "multiprocessing_context": worker_context(workers)}
        data = DataLoader(Tokens(lengths), batch_sampler=sampler, collate_fn=shardplug.PackingCollate(400), **reading)
        loader = shardplug.prepare_data_loader(data, **(DISPATCH if dispatch else {}), **options)
        loader.track_padding()
        return loader

    for name, lengths in (("budget", BUDGET_LENGTHS), ("padded", PADDED_LENGTHS)):
        plain, sent = budget(lengths, False), budget(lengths, True, workers=2 if name == "budget" else 0)
        audit = sent.enable_audit()
        out[name] = {"class": type(sent).__name__, "len": (len(plain), len(sent))}
        out[name]["plain"], out[name]["sent"] = _handed_out(plain), _handed_out(sent)
        report = audit.gathered().report(0)
        out[name]["audit"] = (report.exact, report.seen, report.padding)
    plain, sent = budget(BUDGET_LENGTHS, False), budget(BUDGET_LENGTHS, True)
    out["first"], _ = _handed_out(sent, stop=2), _handed_out(plain, stop=2)
    out["position"], out["plain_position"] = sent.state_dict(), plain.state_dict()
    resumed = budget(BUDGET_LENGTHS, True)
    resumed.load_state_dict(out["position"])
    out["resumed_len"], out["resumed"] = len(resumed), _handed_out(resumed)
    saving = budget(BUDGET_LENGTHS, True, use_stateful_dataloader=True)  # its own position format
    _handed_out(saving, stop=2)
    resumed = budget(BUDGET_LENGTHS, True, use_stateful_dataloader=True)
    resumed.load_state_dict(saving.state_dict())
    out["stateful_resumed"] = _handed_out(resumed)
    other = 5 - world  # the position dispatched here, resumed on the other number of processes
    rest = [budget(BUDGET_LENGTHS, False, num_processes=other, process_index=i) for i in range(other)]
    for loader in rest:
        loader.load_state_dict(out["position"])
    out["resized_lens"] = [len(loader) for loader in rest]
    out["resized"] = [_handed_out(loader) for loader in rest]
    resumed = budget(BUDGET_LENGTHS, True)  # the other number's position, resumed dispatched here
    resumed.load_state_dict(other_position)
    out["other_len"], out["other"] = len(resumed), _handed_out(resumed)
    return out


_SAVED: dict[int, dict] = {}  # what each number of processes saved (the DistributedSampler's positions)


@pytest.fixture(scope="module", params=[2, 3], ids=["2procs", "3procs"])
def runs(request):
    results = run_gloo(_scenarios, world_size=request.param, timeout=180)
    if isinstance(results[0]["distributed_sampler"], dict):
        _SAVED[request.param] = results[0]["distributed_sampler"]["saved"]
    return request.param, results


def test_token_budgets_plan_equal_steps_on_every_process_with_their_global_totals(runs):
    world, results = runs
    parts = [r["token_budget"] for r in results]
    assert len({part["len"] for part in parts}) == 1 and all(len(p["batches"]) == p["len"] for p in parts)
    assert sorted(i for part in parts for batch in part["batches"] for i in batch) == list(range(60))
    assert all(sum(BUDGET_LENGTHS[i] for i in batch) <= 400 for part in parts for batch in part["batches"])
    for part in parts:  # each step's global counts, known without a collective, equal the all-reduced ones
        assert part["totals"] == part["reduced"]


def test_token_budgets_that_differ_between_processes_are_refused_on_every_process(runs):
    world, results = runs
    messages = [r["token_budget"]["mismatch"] for r in results]
    assert all(m is not None and m == messages[0] for m in messages)
    assert f"process {world - 1}: 60 lengths" in messages[0] and "seed=4" in messages[0]


def test_token_budgets_resume_a_position_of_another_number_of_processes(runs):
    world, results = runs
    parts = [r["token_budget"] for r in results]
    assert len({part["resumed_len"] for part in parts}) == 1
    assert all(len(part["resumed"]) == part["resumed_len"] for part in parts)
    rest = [i for part in parts for batch in part["resumed"] for i in batch]
    assert sorted(parts[0]["seen"] + rest) == list(range(60))


def _dispatched(runs) -> tuple[int, list[dict]]:
    world, results = runs
    parts = [r["token_budget"]["dispatch"] for r in results]
    for part in parts:
        assert isinstance(part, dict), part
    return world, parts


@pytest.mark.parametrize("lengths", ["budget", "padded"])
def test_token_budgets_dispatched_give_each_process_the_micro_batches_it_reads_itself(runs, lengths):
    """Process 0 reads every process's micro-batches (with 2 DataLoader workers for BUDGET_LENGTHS) and each
    process receives exactly its own, packed, with the padding marks, samples and step totals of the loader that
    reads its own; len() alike; the audit over all processes sees every sample once."""
    world, parts = _dispatched(runs)
    size = len(BUDGET_LENGTHS if lengths == "budget" else PADDED_LENGTHS)
    padding = 0
    for part in parts:
        case = part[lengths]
        assert case["class"] == "DataLoaderDispatcher"
        assert case["len"][0] == case["len"][1] == len(case["sent"]) == len(parts[0][lengths]["sent"])
        assert case["sent"] == case["plain"]
        padding += sum(len(record["indices"]) - record["real"] for record in case["sent"])
        assert case["audit"] == (True, size, parts[0][lengths]["audit"][2])
    assert parts[0][lengths]["audit"][2] == padding
    if lengths == "padded":  # a step whose micro-batches are padding but one
        assert padding == world - 1


def test_token_budgets_dispatched_resume_on_as_many_and_on_another_number_of_processes(runs):
    """A dispatched position saved after 2 steps is the position of the loader that reads its own; it resumes
    exactly on as many processes, and on the other number (3 -> 2, 2 -> 3) with every remaining sample once in
    equal steps; the other number's position resumes dispatched here alike."""
    world, parts = _dispatched(runs)
    for part in parts:
        assert part["position"] == part["plain_position"] and part["position"]["unit"] == "samples"
        assert part["resumed"] == part["budget"]["plain"][2:] and part["resumed_len"] == len(part["resumed"])
        assert part["stateful_resumed"] == part["budget"]["plain"][2:]
    seen = [i for part in parts for record in part["first"] for i in record["indices"]]
    resized = parts[0]["resized"]
    assert len({len(rest) for rest in resized}) == 1 and [len(rest) for rest in resized] == parts[0]["resized_lens"]
    rest = [i for records in resized for record in records for i in record["indices"][: record["real"]]]
    assert sorted(seen + rest) == list(range(60))
    assert len({(part["other_len"], len(part["other"])) for part in parts}) == 1
    assert parts[0]["other_len"] == len(parts[0]["other"])
    rest = [i for part in parts for record in part["other"] for i in record["indices"][: record["real"]]]
    assert sorted(runs[1][0]["token_budget"]["seen"] + rest) == list(range(60))


def _round_robin(per_rank):
    """Batch k of every rank in turn: the global order the shards were cut from."""
    flat = []
    for k in range(max(len(b) for b in per_rank)):
        for batches in per_rank:
            if k < len(batches):
                flat.extend(batches[k])
    return flat


def test_shuffle_without_seed_gives_disjoint_covering_shards_every_epoch(runs):
    world, results = runs
    epochs = []
    for epoch in range(3):
        per_rank = [r["shuffle"][epoch] for r in results]
        order = _round_robin(per_rank)
        assert sorted(order[:40]) == list(range(40)), f"epoch {epoch}: shards overlap or miss samples"
        assert order[40:] == order[: len(order) - 40], "only the documented padding may repeat"
        epochs.append(order)
    assert epochs[0] != epochs[1] != epochs[2], "the shuffle must change with the epoch"


@pytest.mark.parametrize("shuffle", list(USER_GENERATOR_SHUFFLES))
def test_user_generators_seeded_per_rank_are_synchronised(runs, shuffle):
    world, results = runs
    orders = []
    for epoch in range(2):
        order = _round_robin([r["shuffle_user_generator"][shuffle][epoch] for r in results])
        assert sorted(order[:40]) == list(range(40)), f"epoch {epoch}: shards overlap or miss samples"
        orders.append(order[:40])
    assert orders[0] != orders[1], "the shuffle must change with the epoch"
    keyed = {"bijective": BijectiveRandomSampler, "own_seedable_sampler": SeedableRandomSampler}
    if shuffle in keyed:  # keyed by process 0's generator's seed (its initial_seed())
        sampler = keyed[shuffle](range(40), data_seed=torch.Generator().manual_seed(0).initial_seed())
        for epoch, order in enumerate(orders):
            sampler.set_epoch(epoch)
            assert order == list(sampler)


def test_a_random_sampler_subclass_is_shared_out_as_it_yields(runs):
    """A RandomSampler subclass is the user's: the processes share out its own order (one order on
    every process, though they were seeded differently), each index it yields once, and its
    set_epoch gets each later pass's epoch, the first pass being epoch 0 as built (with DataLoader
    workers: tests/sharding/test_samplers.py)."""
    world, results = runs
    evens = list(range(0, 40, 2))
    orders = []
    for epoch in range(2):
        order = _round_robin([r["subclass"][epoch] for r in results])
        assert sorted(order[:20]) == evens, f"epoch {epoch}: the subclass's indices, each once"
        assert order[20:] == order[: len(order) - 20], "only the documented padding may repeat"
        orders.append(order)
    assert orders[0] != orders[1], "the order changes with the epoch"
    assert all(r["subclass_epochs"] == [1] for r in results)  # the second pass's; the first is epoch 0 as built


def test_dispatch_gives_each_process_its_rows_incl_padded_final_step(runs):
    world, results = runs
    # 11 samples, batch 3, not split: a step is `world` batches concatenated; rows are cut in `world` parts.
    steps, start = [], 0
    while start < 11:
        rows = list(range(start, min(start + 3 * world, 11)))
        start += 3 * world
        steps.append(rows)
    for r, res in enumerate(results):
        expected = []
        for rows in steps:
            padded = rows + [k % 11 for k in range(-len(rows) % world)]
            k = len(padded) // world
            expected.append(padded[r * k : (r + 1) * k])
        assert res["dispatch"] == expected
        assert res["dispatch_len"] == len(steps)
        assert res["dispatch_nested_ok"]


def test_dispatch_split(runs):
    world, results = runs
    for r, res in enumerate(results):
        expected = []
        for start in range(0, 10, 2 * world):
            rows = list(range(start, min(start + 2 * world, 10)))
            padded = rows + [k % 10 for k in range(-len(rows) % world)]
            k = len(padded) // world
            expected.append(padded[r * k : (r + 1) * k])
        assert res["dispatch_split"] == expected


def test_dispatch_errors_reach_every_process(runs):
    world, results = runs
    for res in results:
        # batches of one step with another number of dimensions cannot be dispatched together (other
        # widths can: each process gets its own batch, tests/dispatch/test_dispatch_ragged.py)
        assert res["dispatch_error_ragged"] is not None and "split_batches=True" in res["dispatch_error_ragged"]


def test_dispatch_delivers_strings_with_their_rows(runs):
    world, results = runs
    seen = []
    for res in results:
        for x, names in res["dispatch_strings"]:
            assert names == [f"item{i}" for i in x]  # each process gets the names of its own rows
            seen.extend(x)
    assert sorted(set(seen)) == list(range(6))


def test_iterable_with_two_workers_reads_each_sample_once(runs):
    world, results = runs
    per_rank = [r["iterable_workers"] for r in results]
    for res in results:
        assert len(res["iterable_workers"]) == res["iterable_workers_len"]
    # round-robin over ranks, batch by batch, gives the stream in order, then padding from the start
    flat = _round_robin(per_rank)
    assert flat[:23] == list(range(23))
    assert flat[23:] == list(range(len(flat) - 23))


def test_len_of_a_stream_without_len_says_what_to_do_on_every_process(runs):
    world, results = runs
    for res in results:
        for name, said in res["unsized_len"].items():
            assert NO_LEN in said and "iterate without len()" in said, (name, said)


def test_iterable_dispatch_is_the_default_with_put_on_device(runs):
    world, results = runs
    assert all(r["iterable_dispatch_class"] == "DataLoaderDispatcher" for r in results)
    got = [[rows for rows, _ in r["iterable_dispatch"]] for r in results]
    flags = [[last for _, last in r["iterable_dispatch"]] for r in results]
    assert all(f[-1] and not any(f[:-1]) for f in flags)
    assert _round_robin(got)[:9] == list(range(9))


def test_device_mesh_shards_only_along_data_dimensions(runs):
    world, results = runs
    for r, res in enumerate(results):
        assert res["mesh_tp"] == [[0, 1], [2, 3], [4, 5]], "ranks differing only along tp get identical data"
        assert res["mesh_dp"] == [[k] for k in range(r, 6, world)]


def test_gather_for_metrics_counts_each_sample_once(runs):
    world, results = runs
    steps = results[0]["gathered"]
    assert all(r["gathered"] == steps for r in results), "every process gets the same gathered rows"
    assert sorted(x for step in steps for x in step) == list(range(11))


# -- a user's DistributedSampler adopted --------------------------------------------------------------------
def _adopted(runs):
    world, results = runs
    for result in results:
        assert isinstance(result["distributed_sampler"], dict), result["distributed_sampler"]
    return world, [result["distributed_sampler"] for result in results]


@pytest.mark.parametrize("case", ddp.MATRIX, ids=str)
def test_a_distributed_sampler_gives_every_process_the_batches_of_native_ddp(runs, case):
    """Shuffle on and off, the sampler's and the DataLoader's drop_last, 3 epochs set on the sampler, workers."""
    world, results = _adopted(runs)
    key = str(case)
    for result in results:
        assert result["adopted"][key] == result["native"][key]
        assert result["lengths"][key] == [len(epoch) for epoch in result["native"][key]]
        assert result["loader_epochs"][key] == 2, "the sampler's set_epoch moves the loader's epoch"
    if case[0]:
        assert results[0]["native"][key][0] != results[0]["native"][key][1], "the shuffle follows the epoch"


def test_a_distributed_samplers_wrapped_around_rows_are_marked_as_padding(runs):
    world, results = _adopted(runs)
    real = [i for rank in results[0]["all_real"] for batch in rank for i in batch]
    assert sorted(real) == list(range(ddp.N)), "each sample once in the real rows of all processes"


@pytest.mark.parametrize("case", ddp.RESUME, ids=str)
@pytest.mark.parametrize("stop", ddp.STOPS)
def test_a_distributed_samplers_position_resumes_exactly_on_as_many_processes(runs, case, stop):
    world, results = _adopted(runs)
    for result in results:
        rest, uninterrupted = result["resumed"][str((case, stop))]["same"]
        assert rest == uninterrupted


@pytest.mark.parametrize("case", ddp.RESUME, ids=str)
@pytest.mark.parametrize("stop", ddp.STOPS)
def test_a_distributed_samplers_resize_continues_its_order_with_every_remaining_sample_once(runs, case, stop):
    """Saved on 3 processes, resumed on 2 (and 2 -> 3): the consumed part is a prefix of the epoch's order,
    the rest is dealt over the new processes, every remaining sample exactly once (the sampler's drop_last:
    fewer than one step short)."""
    world, results = _adopted(runs)
    key, other = str((case, stop)), 5 - world
    consumed, _, position = results[0]["resumed"][key]["other"]
    if other in _SAVED:  # the position the other number of processes saved in its own launch
        assert position == _SAVED[other][key][1]
    shuffle, sampler_drop = case
    order = DistributedSampler(range(ddp.N), 1, 0, shuffle=shuffle, seed=ddp.SEED)
    order.set_epoch(1)
    assert sorted(consumed) == sorted(list(order)[: stop * 2 * other]), "a prefix of the epoch's order"
    seen = consumed + [i for result in results for i in result["resumed"][key]["other"][1]]
    assert len(seen) == len(set(seen)), "no sample twice"
    assert len(set(range(ddp.N)) - set(seen)) < (world if sampler_drop else 1)


def test_a_distributed_sampler_of_another_job_is_refused_naming_the_mismatch(runs):
    world, results = _adopted(runs)
    for rank, result in enumerate(results):
        assert f"rank={(rank + 1) % world}" in result["errors"]["rank"]
        assert f"num_replicas={world + 1}" in result["errors"]["num_replicas"]
        for message in result["errors"].values():
            assert f"num_replicas={world}, rank={rank}" in message, "the fix: the job's own"
