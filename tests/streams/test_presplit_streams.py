"""Streams that split themselves by rank, read as each process's part (docs/streams.md): litdata's and
MosaicML streaming's ``StreamingDataset`` written to local files, a Hugging Face stream after
``split_dataset_by_node``, a webdataset pipeline with ``nodesplitter=split_by_node`` and a stream of
your own that declares ``split_by_node = True``, on 2 real gloo processes, with and without
DataLoader workers: every element once per epoch (or the library's own drop or repeat, as its
plain DataLoader reads it, said in one warning on the first pass), equal step counts, padding marked,
an exact mid-epoch resume on the same number of processes, and a resume on another number refused
with the fix. litdata with ``drop_last=False`` (unequal parts, evened by shardplug), and a stream of
your own that wraps litdata's: refused with the declaration that applies, read once declared."""

from __future__ import annotations

import itertools
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_gloo, worker_context
from _stream_libraries import (
    WORKER_PRELOAD,
    litdata_module,
    streaming_base,
    streaming_world,
    write_litdata,
    write_mds,
)
from torch.utils.data import DataLoader

from shardplug import prepare_data_loader

datasets = pytest.importorskip("datasets")
pytest.importorskip("_hf_datasets")  # without datasets' pause of 5 s after each shuffled pass
wds = pytest.importorskip("webdataset")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

N, BATCH, STOP = 63, 4, 2  # 63 samples, batches of 4 per process, a resume after 2 steps
KINDS = ("litdata", "litdata-all", "streaming", "hf", "wds", "declared")  # litdata-all: drop_last=False
LIBRARIES = ("litdata", "litdata-all", "streaming")
NATIVE = ("litdata", "streaming")  # compared with what the library's plain DataLoader reads
UNEVEN = [17, 15, 16, 15]  # the HF / webdataset shards: rank 0 reads shards 0 and 2 (33), rank 1 shards 1 and 3 (30)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("presplit")
    litdata_module()
    streaming_base()
    write_litdata(root / "litdata", N)
    write_mds(root / "mds", N)
    start = 0
    for s, size in enumerate(UNEVEN):
        values = list(range(start, start + size))
        start += size
        datasets.Dataset.from_dict({"index": values}).to_parquet(str(root / f"part-{s}.parquet"))
        with wds.TarWriter(str(root / f"shard-{s}.tar")) as writer:
            for v in values:
                writer.write({"__key__": f"{v:05d}", "cls": str(v)})
    return root


class RankPart(torch.utils.data.IterableDataset):
    """A stream of your own that reads only its process's elements (rank r of w: r, r+w, ...)."""

    split_by_node = True
    splits_by_worker = False  # every DataLoader worker would read all of it: shardplug splits it

    def __init__(self, n: int) -> None:
        self.n, self.rank, self.world_size = n, dist.get_rank(), dist.get_world_size()  # workers have no group

    def __iter__(self):
        return ({"index": i} for i in range(self.rank, self.n, self.world_size))


class Wrapped(torch.utils.data.IterableDataset):
    """A stream of your own that reads a litdata ``StreamingDataset`` inside it (which reads only its
    rank's part, and only its DataLoader worker's part of that)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __iter__(self):
        return iter(self.inner)


class DeclaredWrapped(Wrapped):
    """The same, declared as docs/streams.md says: it reads only its process's (and worker's) part."""

    split_by_node = True
    splits_by_worker = True


_COPIES = itertools.count()
_ALIVE: list[Any] = []  # every streaming dataset this process built (see _stream)


def _as_index(sample: tuple[int]) -> dict[str, int]:
    return {"index": sample[0]}  # a function, not a lambda: the pipeline is pickled to fork-server workers


def _stream(kind: str, root: Path) -> Any:
    """A new stream of ``kind`` for this process (streaming needs its own copy of the local directory
    for every dataset that is alive at the same time)."""
    if kind == "litdata":
        return litdata_module().StreamingDataset(str(root / "litdata"), shuffle=True, seed=7)
    if kind == "litdata-all":
        return litdata_module().StreamingDataset(str(root / "litdata"), shuffle=True, seed=7, drop_last=False)
    if kind == "streaming":
        local = root / "copies" / str(next(_COPIES))  # the same directory on every process (built in the same order)
        if dist.get_rank() == 0:
            shutil.copytree(root / "mds", local)
        dist.barrier()
        dataset = streaming_base().StreamingDataset(local=str(local), shuffle=True, shuffle_seed=7, batch_size=BATCH)
        _ALIVE.append(dataset)  # streaming hands a freed dataset's shared memory to the next one: never free one
        return dataset
    if kind == "hf":
        from datasets.distributed import split_dataset_by_node

        files = sorted(str(p) for p in root.glob("part-*.parquet"))
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        return split_dataset_by_node(stream, rank=dist.get_rank(), world_size=dist.get_world_size())
    if kind == "wds":
        urls = sorted(str(p) for p in root.glob("shard-*.tar"))
        pipeline = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node)
        return pipeline.to_tuple("cls").map_tuple(int).map(_as_index)
    return RankPart(N)


def _loader(kind: str, root: Path, workers: int, prepare: bool = True, **options: Any) -> Any:
    # from a fork server that imported streaming.base (see _stream_libraries), whatever the kind: one server a rank
    context = worker_context(workers, WORKER_PRELOAD)
    loader = DataLoader(_stream(kind, root), batch_size=BATCH, num_workers=workers, multiprocessing_context=context)
    if not prepare:
        return loader
    prepared = prepare_data_loader(loader, **options)
    prepared.track_padding()
    return prepared


def _pass(loader: Any, stop: int | None = None) -> list[tuple[list[int], int | None]]:
    """The batches of one pass (sample indices, real count), the first ``stop`` of them when given."""
    out = []
    for batch in loader:
        out.append((batch["index"].tolist(), loader.batch_real_count))
        if stop is not None and len(out) == stop:
            break
    return out


def _record_starts(loader: Any) -> list[int]:
    """The batches each pass of ``loader`` started after through the stream's own state (the plan's hook, recorded)."""
    starts: list[int] = []
    hook = loader.plan.start

    def recorded(batches: int) -> tuple[int, bool]:
        result = hook(batches)
        starts.append(result[0])
        return result

    loader.plan.start = recorded
    return starts


def _native_pass(kind: str, root: Path, workers: int, epoch: int) -> list[int]:
    """What the library's stream gives this process in ``epoch`` through a plain DataLoader (the
    epoch set through the library's own API)."""
    loader = _loader(kind, root, workers, prepare=False)
    if kind.startswith("litdata"):  # what litdata's StreamingDataLoader tells its dataset
        loader.dataset.set_batch_size(BATCH)
        loader.dataset.set_num_workers(workers)
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)
    elif kind == "streaming":
        loader.dataset.next_epoch = epoch
    return [x for batch in loader for x in batch["index"].tolist()]


def _scenarios(rank: int, world: int, root: str, workers: int) -> dict[str, Any]:
    """Every case with ``workers`` DataLoader workers (see :func:`runs` for why one worker count a run)."""
    streaming_world(rank, world)
    streaming_base().util.clean_stale_shared_memory()
    root_path = Path(root)
    if rank == 0:
        shutil.rmtree(root_path / "copies", ignore_errors=True)
        (root_path / "copies").mkdir()
    dist.barrier()
    out: dict[str, Any] = {}
    for kind in KINDS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = _loader(kind, root_path, workers)
            marks = [len(caught)]  # the warnings at prepare, then in each epoch
            epochs = []
            for epoch in range(2):
                loader.set_epoch(epoch)
                epochs.append(_pass(loader))
                marks.append(len(caught))
        warned = [_ours(caught[a:b]) for a, b in zip([0, *marks], marks)]
        try:
            length = len(loader)
        except TypeError:
            length = None
        resumes = {}
        first_steps = {1} if kind != "litdata-all" else set()  # litdata's turns of the workers: tried once
        for stop in sorted({*first_steps, STOP, len(epochs[1]) - 1}):
            first = _loader(kind, root_path, workers)
            first.set_epoch(1)
            head = _pass(first, stop)
            state = first.state_dict()
            resumed = _loader(kind, root_path, workers)
            resumed.load_state_dict(state)
            starts = _record_starts(resumed)
            resumes[stop] = {"head": head, "rest": _pass(resumed), "state": state, "own_state": starts}
        out[kind, workers] = {
            "native": [_native_pass(kind, root_path, workers, epoch) for epoch in range(2) if kind in NATIVE],
            "epochs": epochs,
            "len": length,
            "resumes": resumes,
            "part": type(loader.dataset).__name__,
            "warned": warned,
        }
    out["wrapped", workers] = _wrapped(root_path, workers)
    # the documented modes, on the HF parts of 33 and 30 elements
    for mode, options in {"uneven": {"even_batches": False}, "stateful": {"use_stateful_dataloader": True}}.items():
        out["hf", workers, mode] = _pass(_loader("hf", root_path, workers, **options))
    dropping = DataLoader(
        _stream("hf", root_path),
        batch_size=BATCH,
        drop_last=True,
        num_workers=workers,
        multiprocessing_context=worker_context(workers),
    )
    prepared = prepare_data_loader(dropping)
    prepared.track_padding()
    out["hf", workers, "drop_last"] = _pass(prepared)
    for kind in ("litdata", "hf"):  # a StatefulDataLoader resumed mid-epoch
        first = _loader(kind, root_path, workers, use_stateful_dataloader=True)
        whole = _pass(_loader(kind, root_path, workers, use_stateful_dataloader=True))
        head = _pass(first, STOP)
        resumed = _loader(kind, root_path, workers, use_stateful_dataloader=True)
        resumed.load_state_dict(first.state_dict())
        out[kind, workers, "stateful resume"] = {"whole": whole, "resumed": head + _pass(resumed)}
    if workers:
        return out
    refusals = {}
    for kind in ("litdata", "hf"):
        try:
            prepare_data_loader(
                DataLoader(_stream(kind, root_path), batch_size=BATCH), dispatch_batches=True, put_on_device=True
            )
        except ValueError as exc:
            refusals[kind, "dispatch"] = str(exc)
    from datasets.distributed import split_dataset_by_node

    files = sorted(str(p) for p in root_path.glob("part-*.parquet"))
    other = split_dataset_by_node(
        datasets.load_dataset("parquet", data_files=files, split="train", streaming=True), rank=0, world_size=4
    )
    try:
        prepare_data_loader(DataLoader(other, batch_size=BATCH))
    except ValueError as exc:
        refusals["hf", "world"] = str(exc)
    out["refusals"] = refusals
    return out


def _ours(caught: list[warnings.WarningMessage]) -> list[str]:
    """The messages of the warnings shardplug issued."""
    return [str(w.message) for w in caught if "shardplug" in Path(w.filename).parts]


def _wrapped(root: Path, workers: int) -> dict[str, Any]:
    """A stream of your own around litdata's (drop_last=False: every sample kept): refused as it is
    (the error), read once it declares split_by_node = True (its batches)."""
    out: dict[str, Any] = {}
    for name, cls in (("refused", Wrapped), ("declared", DeclaredWrapped)):
        inner = litdata_module().StreamingDataset(str(root / "litdata"), shuffle=True, seed=7, drop_last=False)
        loader = DataLoader(
            cls(inner), batch_size=BATCH, num_workers=workers, multiprocessing_context=worker_context(workers)
        )
        prepared = prepare_data_loader(loader)
        prepared.track_padding()
        try:
            out[name] = _pass(prepared)
        except RuntimeError as exc:
            out[name] = str(exc)
    return out


def _resize(rank: int, world: int, root: str, states: dict[str, Any]) -> dict[str, str | None]:
    streaming_world(rank, world)
    out: dict[str, str | None] = {}
    for kind, state in states.items():
        loader = _loader(kind, Path(root), 0)
        try:
            loader.load_state_dict(state)
            out[kind] = None
        except ValueError as exc:
            out[kind] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(files: Path) -> list[dict[str, Any]]:
    """Each process's results: the cases without DataLoader workers and those with 2, in two runs.
    Workers come from a fork server (:func:`_dist.worker_context`), never forked from a rank: gloo's
    and the libraries' reader threads run there (python/cpython#112275)."""
    without, with_workers = (run_gloo(_scenarios, str(files), workers, timeout=150) for workers in (0, 2))
    return [{**a, **b} for a, b in zip(without, with_workers, strict=True)]


def _real(batches: list[tuple[list[int], int | None]]) -> list[int]:
    return [x for ids, count in batches for x in (ids if count is None else ids[:count])]


CASES = [(kind, workers) for kind in KINDS for workers in (0, 2)]


@pytest.mark.parametrize("kind, workers", CASES, ids=[f"{k}-workers{w}" for k, w in CASES])
def test_each_process_reads_its_own_part_once_with_equal_steps(runs, kind, workers):
    """Not split a second time: every element of the epoch once (litdata by default drops what its
    split leaves over, streaming repeats to fill its ranks, as their plain DataLoaders do), equal step counts."""
    for epoch in range(2):
        per_rank = [runs[rank][kind, workers]["epochs"][epoch] for rank in range(2)]
        assert len(per_rank[0]) == len(per_rank[1]), "equal steps on both processes"
        real = sorted(x for batches in per_rank for x in _real(batches))
        if kind in NATIVE:
            native = sorted(x for rank in range(2) for x in runs[rank][kind, workers]["native"][epoch])
            assert real == native, f"epoch {epoch}: what the library gives its ranks, once"
        else:
            assert real == list(range(N)), f"epoch {epoch}: every element once"
    assert all(runs[rank][kind, workers]["part"] == "NodePart" for rank in range(2))


def test_the_library_s_own_tail_rule_is_what_the_processes_get(runs):
    """litdata drops the samples its rank split leaves over (unless drop_last=False: its last rank
    reads them); streaming repeats samples so that every rank gets as many: stated in docs/streams.md."""
    litdata = sorted(x for rank in range(2) for x in _real(runs[rank]["litdata", 0]["epochs"][0]))
    streaming = sorted(x for rank in range(2) for x in _real(runs[rank]["streaming", 0]["epochs"][0]))
    assert len(litdata) == len(set(litdata)) < N, "litdata drops the tail"
    assert set(streaming) == set(range(N)) and len(streaming) > N, "streaming repeats to fill its ranks"
    parts = [len(_real(runs[rank]["litdata-all", 0]["epochs"][0])) for rank in range(2)]
    assert sum(parts) == N and parts[0] < parts[1], "drop_last=False: the last rank reads what is left over"


@pytest.mark.parametrize("workers", [0, 2])
def test_the_library_s_own_drop_or_repeat_is_one_warning_on_the_first_pass(runs, workers):
    """Process 0 warns once, when the first pass begins, with the count and the fix; nothing
    warns where every sample is read once."""
    for kind in KINDS:
        real = [x for rank in range(2) for x in _real(runs[rank][kind, workers]["epochs"][0])]
        for rank in range(2):
            warned = runs[rank][kind, workers]["warned"]
            if rank or kind not in ("litdata", "streaming"):
                assert warned == [[], [], []], (kind, rank)
                continue
            assert warned[0] == [] == warned[2] and len(warned[1]) == 1, f"{kind}: one warning, on the first pass"
            message = warned[1][0]
            if kind == "litdata":
                assert f"drops {N - len(real)} of its {N} samples" in message and "drop_last=False" in message, message
            else:
                assert f"repeats {len(real) - N} of its {N} samples" in message, message


def test_a_shorter_part_is_padded_and_the_padding_is_marked(runs):
    """The HF parts hold 33 and 30 elements, litdata's with drop_last=False 28 and 35: the shorter
    part's last steps are padding, real count 0."""
    for kind, sizes in (("hf", [33, 30]), ("litdata-all", [28, 35])):
        for workers in (0, 2):
            batches = [runs[rank][kind, workers]["epochs"][0] for rank in range(2)]
            counts = [[count for _, count in rank] for rank in batches]
            assert [len(_real(rank)) for rank in batches] == sizes
            short = sizes.index(min(sizes))
            assert 0 in counts[short] and 0 not in counts[1 - short], f"{kind}: the padding steps are marked"


@pytest.mark.parametrize("workers", [0, 2])
def test_even_batches_false_drop_last_and_a_stateful_loader_as_documented(runs, workers):
    """even_batches=False: each process its own part (9 and 8 steps, no padding); drop_last: every
    process stops at the first step some process cannot fill, full batches only; a StatefulDataLoader
    reads the parts as the plain loader does, and a mid-epoch resume of it is exact."""
    uneven = [runs[rank]["hf", workers, "uneven"] for rank in range(2)]
    assert [len(_real(batches)) for batches in uneven] == [33, 30] and len(uneven[0]) > len(uneven[1])
    assert all(count == len(ids) for batches in uneven for ids, count in batches), "no padding"
    dropped = [runs[rank]["hf", workers, "drop_last"] for rank in range(2)]
    assert len(dropped[0]) == len(dropped[1]) and all(len(ids) == count == BATCH for b in dropped for ids, count in b)
    real = [x for batches in dropped for x in _real(batches)]
    assert len(real) == len(set(real)), "nothing twice"
    for rank in range(2):
        assert runs[rank]["hf", workers, "stateful"] == runs[rank]["hf", workers]["epochs"][0]
        for kind in ("litdata", "hf"):
            result = runs[rank][kind, workers, "stateful resume"]
            assert result["resumed"] == result["whole"], f"{kind}: the resumed stateful pass is the uninterrupted one"


def test_len_is_the_agreed_step_count_where_the_parts_have_a_length(runs):
    for kind in LIBRARIES:
        steps = {len(runs[rank][kind, 0]["epochs"][0]) for rank in range(2)}
        assert {runs[rank][kind, 0]["len"] for rank in range(2)} == steps
    assert runs[0]["hf", 0]["len"] is None, "an HF stream has no len(): its steps are agreed while reading"


@pytest.mark.parametrize("kind, workers", CASES, ids=[f"{k}-workers{w}" for k, w in CASES])
def test_a_mid_epoch_resume_on_the_same_number_of_processes_is_exact(runs, kind, workers):
    """After 1 (litdata-all: not), 2 and all but one of the steps: the resumed epoch is the uninterrupted one,
    padding included; litdata and streaming start it through their own state (not re-reading) where
    every batch before the place is full and the ranks' parts are equal (not so litdata's with
    drop_last=False: its shorter part is padded with its first batch), the others read past what was consumed."""
    parts = [len(_real(runs[rank][kind, workers]["epochs"][1])) for rank in range(2)]
    for rank in range(2):
        result = runs[rank][kind, workers]
        for stop, resume in result["resumes"].items():
            assert resume["head"] + resume["rest"] == result["epochs"][1], f"resumed after {stop} steps"
        own = {stop: resume["own_state"] for stop, resume in result["resumes"].items()}
        if kind in LIBRARIES and len(set(parts)) > 1:  # litdata's drop_last=False: unequal parts
            assert all(starts == [0] for starts in own.values()), "unequal parts are read past, exactly"
        elif kind in LIBRARIES:
            assert own[STOP] == [STOP], "the library's own state positions the stream"
            if 1 in own:
                assert own[1] == [0 if kind == "litdata" and workers else 1], "litdata: whole turns of the workers"
        else:
            assert all(starts in ([], [0]) for starts in own.values()), "read past, exactly"


def test_dispatch_and_a_split_for_other_processes_are_refused_with_the_fix(runs):
    for rank in range(2):
        refusals = runs[rank]["refusals"]
        assert "pass dispatch_batches=False" in refusals["litdata", "dispatch"]
        assert "pass dispatch_batches=False" in refusals["hf", "dispatch"]
        assert "num_processes=4, process_index=0" in refusals["hf", "world"]


def test_a_resume_on_another_number_of_processes_is_refused_at_load_with_the_fix(runs, files):
    states = {kind: runs[0][kind, 0]["resumes"][STOP]["state"] for kind in ("litdata", "hf")}
    messages = run_gloo(_resize, str(files), states, world_size=3, timeout=120)
    for message in messages:
        assert all(m is not None and "resume with num_processes=2" in m for m in message.values()), message


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_of_your_own_around_a_self_splitting_one_is_refused_with_the_declaration(runs, workers):
    """Around litdata's StreamingDataset (already split by rank): the processes read different
    streams, and the error names split_by_node = True; declared so, every sample once, equal steps."""
    results = [runs[rank]["wrapped", workers] for rank in range(2)]
    for result in results:
        refused = result["refused"]
        assert isinstance(refused, str) and "split_by_node = True" in refused and "splits_by_worker = True" in refused
    declared = [result["declared"] for result in results]
    assert len(declared[0]) == len(declared[1]), "equal steps"
    assert sorted(x for batches in declared for x in _real(batches)) == list(range(N)), "every sample once"
