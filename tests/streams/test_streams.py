"""Streams as users run them (docs/streams.md): Hugging Face ``datasets`` and webdataset built from local
files, on 2 real gloo processes, with DataLoader workers: every element once per epoch, equal step
counts, streams that cannot run on several processes as they are refused with the fix (streams
already split by node: tests/streams/test_presplit_streams.py)."""

from __future__ import annotations

import functools
import os
import random
from pathlib import Path

import pytest
import torch
from _datasets import Files, PlainShards
from _dist import run_gloo, worker_context
from torch.utils.data import DataLoader

from shardplug import prepare_data_loader

datasets = pytest.importorskip("datasets")
pytest.importorskip("_hf_datasets")  # without datasets' pause of 5 s after each shuffled pass
wds = pytest.importorskip("webdataset")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHARDS, PER_SHARD = 4, 10  # 40 elements


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Parquet and tar shards of the elements 0..39, ten a shard."""
    root = tmp_path_factory.mktemp("streams")
    for s in range(SHARDS):
        values = list(range(s * PER_SHARD, (s + 1) * PER_SHARD))
        datasets.Dataset.from_dict({"x": values}).to_parquet(str(root / f"part-{s}.parquet"))
        extra = list(range(100 + s * 20, 100 + s * 20 + (13 if s == 3 else 10)))  # 10, 10, 10, 13 rows
        datasets.Dataset.from_dict({"x": extra}).to_parquet(str(root / f"uneven-{s}.parquet"))
        with wds.TarWriter(str(root / f"shard-{s}.tar")) as writer:
            for v in values:
                writer.write({"__key__": f"{v:05d}", "cls": str(v)})
    datasets.Dataset.from_dict({"x": list(range(SHARDS * PER_SHARD))}).to_parquet(str(root / "whole.parquet"))
    return root


@functools.cache
def hf_stream(root: Path, shuffle: bool = False):
    """The parquet shards as a Hugging Face stream (built once per process; preparing never changes it)."""
    stream = datasets.load_dataset(
        "parquet", data_files=sorted(str(p) for p in root.glob("part-*.parquet")), split="train", streaming=True
    )
    return stream.shuffle(seed=3, buffer_size=8) if shuffle else stream


def uneven_stream(root: Path):
    """Four parquet shards of 10, 10, 10 and 13 rows, without len(): on 2 processes, parts of 20 and 23."""
    return datasets.load_dataset(
        "parquet", data_files=sorted(str(p) for p in root.glob("uneven-*.parquet")), split="train", streaming=True
    )


UNEVEN = sorted(v for s in range(SHARDS) for v in range(100 + s * 20, 100 + s * 20 + (13 if s == 3 else 10)))


def _native(rank, world, root, workers, mode):
    options = {"even": {}, "drop_last": {}, "uneven": {"even_batches": False}}[mode]
    loader = prepare_data_loader(
        DataLoader(
            uneven_stream(root),
            batch_size=2,
            num_workers=workers,
            drop_last=mode == "drop_last",
            multiprocessing_context=worker_context(workers),
        ),
        **options,
    )
    loader.track_padding()
    batches = [(_ids(batch), loader.batch_real_count) for batch in loader]
    return {"native": type(loader.dataset).__module__.startswith("datasets"), "batches": batches}


def wds_stream(root: Path, **kwargs):
    urls = sorted(str(p) for p in root.glob("shard-*.tar"))
    return wds.WebDataset(urls, shardshuffle=False, **kwargs).to_tuple("cls").map_tuple(int)


def _ids(batch) -> list[int]:
    if isinstance(batch, dict):
        batch = batch["x"]
    if isinstance(batch, (list, tuple)):
        batch = batch[0]
    return [int(v) for v in batch]


def _epochs(rank, world, kind, root, workers, persistent, shuffle):
    stream = hf_stream(root, shuffle) if kind == "hf" else wds_stream(root, nodesplitter=None)
    loader = prepare_data_loader(
        DataLoader(
            stream,
            batch_size=2,
            num_workers=workers,
            persistent_workers=persistent,
            multiprocessing_context=worker_context(workers),
        )
    )
    seen = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen.append([_ids(batch) for batch in loader])
    return seen


SCENARIOS = [
    ("hf", workers, persistent, False) for workers, persistent in ((0, False), (1, False), (2, False), (2, True))
]
SCENARIOS += [("wds", 0, False, False), ("wds", 2, True, False), ("hf", 2, False, True)]


def _everything(rank, world, root):
    """Every scenario of this file on the same 2 gloo processes (one spawn: the imports dominate)."""
    return {
        "epochs": {scenario: _epochs(rank, world, *scenario[:1], root, *scenario[1:]) for scenario in SCENARIOS},
        "split": {kind: _prepare_split(rank, world, kind, root) for kind, _ in SPLIT_KINDS},
        "resume": {case: _resume(rank, world, root, *case) for case in RESUMES},
        "native": {case: _native(rank, world, root, *case) for case in NATIVE},
        "balanced": {case: _balanced(rank, world, root, *case) for case in BALANCED},
        "own_shards": {case: _own_shards(rank, world, *case) for case in OWN_SHARDS},
    }


@pytest.fixture(scope="module")
def runs(files):
    return run_gloo(_everything, files, world_size=2, timeout=300)


@pytest.fixture(scope="module")
def epochs(runs):
    return [run["epochs"] for run in runs]


@pytest.mark.parametrize(
    "scenario", SCENARIOS[:-1], ids=lambda s: f"{s[0]}-workers{s[1]}{'-persistent' if s[2] else ''}"
)
def test_every_element_once_over_processes_and_workers(epochs, scenario):
    for epoch in range(2):
        batches = [epochs[rank][scenario][epoch] for rank in range(2)]
        assert len(batches[0]) == len(batches[1]), "equal step counts"
        elements = sorted(x for per_rank in batches for batch in per_rank for x in batch)
        assert elements == list(range(SHARDS * PER_SHARD)), f"epoch {epoch}: every element exactly once"


def test_a_shuffled_hf_stream_is_consumed_once_and_agrees_across_processes(epochs):
    scenario = SCENARIOS[-1]
    for epoch in range(2):
        elements = sorted(x for rank in range(2) for batch in epochs[rank][scenario][epoch] for x in batch)
        assert elements == list(range(SHARDS * PER_SHARD))
    assert epochs[0][scenario][0] != epochs[0][scenario][1], "the shuffle changes with the epoch"


def _replicas(world):
    """A device mesh of one data process that every rank reads (its ``tp`` ranks: they share the data)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))


def _prepare_split(rank, world, kind, root):
    options = {"torch_device_mesh": _replicas(world)} if kind.endswith("_replicas") else {}
    if kind.startswith("hf_unseeded"):
        stream = hf_stream(root).shuffle(buffer_size=8)  # seed=None: its own seed in every process
    else:
        stream = wds_stream(root)  # webdataset's default single_node_only
    try:
        prepare_data_loader(DataLoader(stream, batch_size=2), **options)
    except ValueError as exc:
        return str(exc)
    return None


def three_shards(root: Path, shuffle: bool = False):
    """Three of the shards (elements 0..29): 3 does not divide by 2 processes."""
    stream = datasets.load_dataset(
        "parquet", data_files=sorted(str(p) for p in root.glob("part-*.parquet"))[:3], split="train", streaming=True
    )
    return stream.shuffle(seed=5, buffer_size=4) if shuffle else stream


def one_shard(root: Path):
    """The elements 0..39 in one file: fewer shards than processes, so every process reads the stream."""
    return datasets.load_dataset("parquet", data_files=[str(root / "whole.parquet")], split="train", streaming=True)


def _resume(rank, world, root, workers, shuffle, read_all=False, kind="hf"):
    def make():
        if kind == "wds":
            stream = wds_stream(root, nodesplitter=None)
        elif kind == "balanced":
            stream = three_shards(root, shuffle)
        else:
            stream = one_shard(root) if read_all else hf_stream(root, shuffle)
        return prepare_data_loader(
            DataLoader(stream, batch_size=2, num_workers=workers, multiprocessing_context=worker_context(workers))
        )

    def real(loader, batch):  # padding is marked where the plan knows it (native shards)
        count = loader.batch_real_count
        return _ids(batch) if count is None else _ids(batch)[:count]

    def tracked(loader):
        if not read_all:
            loader.track_padding()
        return loader

    reference = tracked(make())
    whole = [real(reference, b) for b in reference]
    loader = tracked(make())
    iterator = iter(loader)
    first = [real(loader, next(iterator)) for _ in range(3)]
    state = loader.state_dict()
    del iterator
    resumed = make()
    try:
        resumed.load_state_dict(state)
    except ValueError as exc:
        return {"refused": str(exc)}
    tracked(resumed)
    return {"whole": whole, "first": first, "rest": [real(resumed, b) for b in resumed]}


NATIVE = [(workers, mode) for workers in (0, 2) for mode in ("even", "drop_last", "uneven")]


@pytest.mark.parametrize("workers, mode", NATIVE)
def test_a_stream_that_shards_itself_is_sharded_natively_with_equal_steps(runs, workers, mode):
    results = [runs[rank]["native"][workers, mode] for rank in range(2)]
    assert all(r["native"] for r in results), "each process reads only its own shards"
    counts = [len(r["batches"]) for r in results]
    real = sorted(x for r in results for batch, count in r["batches"] for x in batch[:count])
    assert len(real) == len(set(real)), "no element twice"
    if mode == "even":  # parts of 20 and 23 rows: 10 and 12 batches, the first padded twice
        assert counts == [12, 12] and real == UNEVEN
        assert [count for _, count in results[0]["batches"][-2:]] == [0, 0], "padding is marked"
    elif mode == "drop_last":  # every process stops where the first runs out
        assert counts == [10, 10]
    else:  # even_batches=False: no padding, no agreement
        assert counts == [10, 12] and real == UNEVEN


def _real(loader) -> list[tuple[list[int], int | None]]:
    """The pass's batches and how many of each one's rows are real (not padding; ``None``: every
    row, where padding is not tracked: a stream read by every process, without len())."""
    try:
        loader.track_padding()
    except ValueError:
        return [(_ids(batch), None) for batch in loader]
    return [(_ids(batch), loader.batch_real_count) for batch in loader]


def _balanced(rank, world, root, workers, shuffle, mode):
    options = {"even": {}, "drop_last": {}, "uneven": {"even_batches": False}}[mode]
    loader = prepare_data_loader(
        DataLoader(
            three_shards(root, shuffle),
            batch_size=2,
            num_workers=workers,
            drop_last=mode == "drop_last",
            multiprocessing_context=worker_context(workers),
        ),
        **options,
    )
    return {"part": type(loader.dataset).__name__, "epochs": [_real(loader) for _ in range(2)]}


BALANCED = [(workers, shuffle, mode) for workers in (0, 2) for shuffle in (False, True) for mode in ("even",)]
BALANCED += [(2, False, "drop_last"), (2, False, "uneven")]


@pytest.mark.parametrize("workers, shuffle, mode", BALANCED)
def test_shards_that_do_not_divide_are_balanced_by_rows_and_read_once(runs, workers, shuffle, mode):
    """3 shards of 10 over 2 processes: one shard each, and half the rows of the third."""
    results = [runs[rank]["balanced"][workers, shuffle, mode] for rank in range(2)]
    assert all(r["part"] == "ProcessPart" for r in results), "sharded natively, not read by every process"
    for epoch in range(2):
        batches = [r["epochs"][epoch] for r in results]
        real = [[x for batch, count in part for x in batch[:count]] for part in batches]
        together = sorted(real[0] + real[1])
        assert len(together) == len(set(together)), "no element twice"
        if mode == "drop_last":
            assert len(batches[0]) == len(batches[1]) and set(together) <= set(range(30))
            continue
        assert together == list(range(30)), "every element of the stream once"
        assert len(real[0]) == len(real[1]) == 15, f"balanced by rows: {len(real[0])}, {len(real[1])}"
        if mode == "even":
            assert len(batches[0]) == len(batches[1]), "equal step counts"


OWN_SHARDS = [
    (kind, shards, workers) for kind in ("splits_by_worker", "plain") for shards in (4, 5) for workers in (0, 2)
]


def _own_shards(rank, world, kind, shards, workers):
    dataset = (Files if kind == "splits_by_worker" else PlainShards)(range(shards))
    loader = prepare_data_loader(
        DataLoader(dataset, batch_size=2, num_workers=workers, multiprocessing_context=worker_context(workers))
    )
    return {"part": type(loader.dataset).__name__, "batches": _real(loader)}


@pytest.mark.parametrize("kind, shards, workers", OWN_SHARDS)
def test_a_dataset_of_your_own_that_shards_itself_is_read_once_with_workers(runs, kind, shards, workers):
    """Sized parts counted without workers, agreed on with them (a worker's last batch may be short);
    a dataset that does not split itself by worker is split by shardplug."""
    results = [runs[rank]["own_shards"][kind, shards, workers] for rank in range(2)]
    counts = [len(r["batches"]) for r in results]
    real = sorted(x for r in results for batch, count in r["batches"] for x in batch[:count])
    everything = sorted(f * 100 + k for f in range(shards) for k in range(5))
    assert counts[0] == counts[1], "equal step counts"
    if kind == "splits_by_worker" and shards == 5:
        assert all(r["part"] == "IterableDatasetShard" for r in results), "read by all: its parts cannot be joined"
        assert sorted(set(real)) == everything and len(real) - len(everything) < 2 * 2, (
            "once, and the last step's padding"
        )
    else:
        assert all(r["part"] != "IterableDatasetShard" for r in results), "sharded natively"
        assert real == everything, "every element once"


SPLIT_KINDS = [
    ("wds_default", "nodesplitter=None"),
    ("hf_unseeded", "shuffle(seed=...)"),
    ("hf_unseeded_replicas", "shuffle(seed=...)"),  # ranks that share a data index read the same stream
]
RESUMES = [
    (0, False),
    (0, True),
    (2, False),
    (2, True),
    (0, False, True),
    (2, False, True),  # workers, shuffle, read_all
    (0, False, True, "wds"),
    (0, False, False, "balanced"),
    (2, True, False, "balanced"),
]


@pytest.fixture(scope="module")
def others(runs):
    return runs


@pytest.mark.parametrize("kind, words", SPLIT_KINDS)
def test_streams_single_node_only_or_shuffled_unseeded_are_refused_with_the_fix(others, kind, words):
    messages = [others[rank]["split"][kind] for rank in range(2)]
    assert all(m is not None and words in m for m in messages), messages


@pytest.mark.parametrize("case", RESUMES, ids=str)
def test_an_hf_stream_resumes_exactly(others, case):
    """HF sharded natively (4 shards; 3 shards balanced by rows), shuffled or not, with and without
    workers; HF (1 shard) read by all, with and without workers (split by HF across them: each worker's place is
    its number of batches, read again); webdataset read by all, without workers."""
    for rank in range(2):
        result = others[rank]["resume"][case]
        got, expected = result["first"] + result["rest"], result["whole"]
        if (
            len(case) >= 3 and case[2]
        ):  # read by all, no len(): the last step's padding comes from where the resumed pass began
            got, expected = got[:-1], expected[:-1]
        assert got == expected, "the resumed pass continues exactly"


def test_the_stream_attributes_shardplug_reads_still_exist(files):
    """The private attributes streams.py reads (the compat list): fails when a library drops one."""
    from datasets.distributed import split_dataset_by_node

    from shardplug.core.sharding.stream_traits import (
        hf_shuffles,
        node_split,
        shuffle_fingerprint,
        single_node_only,
        splits_by_worker,
    )

    stream = hf_stream(files)
    assert hasattr(stream, "_ex_iterable") and stream._distributed is None
    assert split_dataset_by_node(stream, rank=0, world_size=2)._distributed is not None
    assert splits_by_worker(stream) and not hf_shuffles(stream) and hf_shuffles(hf_stream(files, shuffle=True))
    assert shuffle_fingerprint(stream) is None and shuffle_fingerprint(hf_stream(files, shuffle=True)) is not None
    assert node_split(split_dataset_by_node(stream, rank=0, world_size=2)) is not None
    assert splits_by_worker(wds_stream(files, nodesplitter=None))
    assert node_split(wds_stream(files, nodesplitter=wds.split_by_node)) is not None
    assert single_node_only(wds_stream(files)) and not single_node_only(wds_stream(files, nodesplitter=None))


def test_without_a_process_group_an_hf_stream_shuffled_without_seed_is_refused(files):
    """Without a group its seeds cannot be compared: a shuffle that drew its own seed is refused, a seeded one
    shards as ever."""
    unseeded = DataLoader(hf_stream(files).shuffle(buffer_size=8), batch_size=2)
    with pytest.raises(ValueError, match="agreeing on the seed of the stream's shuffle") as refused:
        prepare_data_loader(unseeded, num_processes=2, process_index=1)
    assert "no process group is initialised" in str(refused.value) and "init_process_group" in str(refused.value)
    assert "or pass shuffle(seed=...) the same seed on every process" in str(refused.value)
    seeded = [DataLoader(hf_stream(files, shuffle=True), batch_size=2) for _ in range(2)]
    loaders = [prepare_data_loader(loader, num_processes=2, process_index=r) for r, loader in enumerate(seeded)]
    assert sorted(int(x) for loader in loaders for batch in loader for x in batch["x"]) == list(range(40))


class _RankOrdered(torch.utils.data.IterableDataset):
    """A stream whose order depends on the process, as with an unseeded shuffle of a plain IterableDataset."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed

    def __iter__(self):
        order = list(range(self.n))
        random.Random(self.seed).shuffle(order)
        yield from (torch.tensor(i) for i in order)


def _read_all(rank, world, workers, same_order):
    """The stream shared out over the processes, and read whole by the ranks of one data process."""
    dataset = _RankOrdered(40, 0 if same_order else rank)
    out = {}
    for name, options in (("sharded", {}), ("replicas", {"torch_device_mesh": _replicas(world)})):
        loader = prepare_data_loader(
            DataLoader(dataset, batch_size=2, num_workers=workers, multiprocessing_context=worker_context(workers)),
            **options,
        )
        try:
            out[name] = {"rows": [int(v) for b in loader for v in b], "error": None}
        except RuntimeError as exc:
            out[name] = {"rows": None, "error": str(exc)}
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_streams_that_differ_between_processes_are_refused_on_every_process(workers):
    mixed = run_gloo(_read_all, workers, False, world_size=2, timeout=120)
    for res in (run[name] for run in mixed for name in ("sharded", "replicas")):
        assert res["error"] is not None and "read different streams" in res["error"], res
        assert "seed its shuffle the same way everywhere" in res["error"]
    same = run_gloo(_read_all, workers, True, world_size=2, timeout=120)
    assert all(run[name]["error"] is None for run in same for name in ("sharded", "replicas"))
    sharded = [run["sharded"]["rows"] for run in same]
    assert [len(rows) for rows in sharded] == [20, 20] and sorted(sharded[0] + sharded[1]) == list(range(40))
    replicas = [run["replicas"]["rows"] for run in same]  # read as one process reads it (each worker: all of it)
    assert replicas[0] == replicas[1] and sorted(set(replicas[0])) == list(range(40)), "every rank reads it alike"
