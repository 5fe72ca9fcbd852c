"""One oracle for resume across every combination of options (test helper).

A :class:`Case` is a set of options (data kind, shuffle, split / even / drop_last, dispatch,
stateful, workers) and a :class:`Resume` a way to stop and continue (N processes, a point in the
epoch, M processes, loaded once or twice, resumed once or twice, or ``skip_first_batches``).
:func:`check` runs the N processes to the point, saves their positions, continues with M, then
runs the next epoch, and asserts from one oracle:

* every real sample of the epoch exactly once (``drop_last``: at most once, and no more than a
  step short), padding only where the mode pads, and always marked (``batch_real_count``, also under
  dispatch, with ``remainder`` the last step's real rows on every process);
* ``len()`` equal to what the pass yields, asked before the pass, at its first batch and at its last;
* equal batch counts on every process where the mode promises them;
* identical positions on every process (also a step after a resume);
* the next epoch equal to an uninterrupted run's of M processes.

Without a process group the processes are simulated in one process (explicit ``num_processes`` /
``process_index``, iterated in lockstep); :func:`check_rank` runs the same on a real gloo group,
one process per rank, exchanging what each rank saw through ``all_gather_object``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _dist import worker_context
from torch.utils.data import DataLoader, IterableDataset

import shardplug

POINTS = ("start", "one", "half", "all_but_one", "all_open", "ended", "mid_next")


class Stream(IterableDataset):
    """A stream of ``0 .. n-1`` that every DataLoader worker reads whole (shardplug splits it)."""

    splits_by_worker = False

    def __init__(self, n: int, sized: bool = True) -> None:
        self.n, self.sized = n, sized

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("unsized")
        return self.n


class WorkerSplitStream(Stream):
    """A stream of ``0 .. n-1`` that splits itself across DataLoader workers (element ``k`` to worker ``k % W``)."""

    splits_by_worker = True

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


class ShardedStream(IterableDataset):
    """A stream that shards itself: ``shards`` files; element ids are ``0 .. n-1`` overall."""

    splits_by_worker = False

    def __init__(self, n: int, shards: int = 6, files: tuple[int, ...] | None = None, sized: bool = True) -> None:
        self.n, self.shards, self.sized = n, shards, sized
        self.files = files if files is not None else tuple(range(shards))

    @property
    def n_shards(self) -> int:
        return len(self.files)

    def shard(self, num_shards: int, index: int) -> ShardedStream:
        return ShardedStream(self.n, self.shards, self.files[index::num_shards], self.sized)

    def _elements(self):
        for f in self.files:
            yield from range(f, self.n, self.shards)

    def __iter__(self):
        return self._elements()

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("unsized")
        return sum(len(range(f, self.n, self.shards)) for f in self.files)


@dataclass(frozen=True)
class Case:
    """The options of one combination."""

    data: str = "map"  # map | stream | stream_unsized | worker_split | sharded | hf | wds
    n: int = 21
    batch_size: int = 3
    shuffle: str = "off"  # off | shuffle | generator | seedable | bijective
    split_batches: bool = False
    even_batches: bool = True
    drop_last: bool = False
    dispatch: bool = False
    stateful: bool = False
    workers: int = 0
    hf_path: str | None = None  # data="hf": a parquet file of ids 0 .. n-1; data="wds": a folder of write_wds's tars
    shards: int = 0  # data="hf": an in-memory HF stream of that many shards instead of the parquet file

    @property
    def iterable(self) -> bool:
        return self.data != "map"


@dataclass(frozen=True)
class Resume:
    """How a run stops and continues."""

    n_before: int = 1
    n_after: int = 1
    point: str = "half"
    load_twice: bool = False
    resume_twice: bool = False
    skip: bool = False  # skip_first_batches instead of a position (same N); with resume_twice, then a position


def dataset_for(case: Case) -> Any:
    if case.data == "map":
        return range(case.n)  # sample i is i
    if case.data in ("stream", "stream_unsized"):
        return Stream(case.n, sized=case.data == "stream")
    if case.data == "worker_split":
        return WorkerSplitStream(case.n)
    if case.data == "sharded":
        return ShardedStream(case.n)
    if case.data == "hf" and case.shards:
        import datasets

        return datasets.Dataset.from_dict({"id": list(range(case.n))}).to_iterable_dataset(num_shards=case.shards)
    if case.data == "wds":
        import glob

        import webdataset as wds

        urls = sorted(glob.glob(f"{case.hf_path}/shard-*.tar"))
        return wds.WebDataset(urls, shardshuffle=False, nodesplitter=None).map(_wds_id)
    if case.data == "hf":
        import datasets

        return datasets.load_dataset("parquet", data_files=case.hf_path, split="train", streaming=True).map(_same_row)
    raise ValueError(case.data)


def _same_row(row: dict[str, Any]) -> dict[str, Any]:
    return row  # (a function of the module: the stream is pickled for the fork server's workers)


def _wds_id(sample: dict[str, Any]) -> int:
    return int(sample["id"])


def write_wds(folder: str, sizes: tuple[int, ...]) -> int:
    """Tar shards of ``sizes`` samples in ``folder`` for ``Case(data="wds")``, ids ``0 .. sum(sizes)-1`` in order."""
    import webdataset as wds

    start = 0
    for k, size in enumerate(sizes):
        with wds.TarWriter(f"{folder}/shard-{k:03d}.tar") as writer:
            for i in range(start, start + size):
                writer.write({"__key__": f"{i:06d}", "id": str(i)})
        start += size
    return start


def build(case: Case, processes: int, index: int, explicit: bool = True) -> Any:
    """The prepared loader of process ``index`` of ``processes`` for ``case``."""
    kwargs: dict[str, Any] = {}
    prepare: dict[str, Any] = {}
    if case.shuffle == "shuffle":
        kwargs["shuffle"] = True
        if explicit:  # simulated processes cannot agree a seed from process 0
            prepare["data_seed"] = 11
    elif case.shuffle == "generator":
        kwargs.update(shuffle=True, generator=torch.Generator().manual_seed(5))
    elif case.shuffle == "seedable":
        kwargs["shuffle"] = True
        prepare.update(use_seedable_sampler=True, data_seed=3)
    elif case.shuffle == "bijective":
        kwargs["shuffle"] = True
        prepare.update(shuffle_algorithm="bijective", data_seed=3)
    if case.workers:  # from the fork server: a fork of a gloo rank (its threads) can deadlock (see worker_context)
        kwargs.update(num_workers=case.workers, multiprocessing_context=worker_context(case.workers))
    loader = DataLoader(dataset_for(case), batch_size=case.batch_size, drop_last=case.drop_last, **kwargs)
    if explicit:
        prepare.update(num_processes=processes, process_index=index)
    if case.dispatch:
        prepare.update(put_on_device=True, dispatch_batches=True)
    else:
        prepare["dispatch_batches"] = False
    prepared = shardplug.prepare_data_loader(
        loader,
        split_batches=case.split_batches,
        even_batches=case.even_batches,
        use_stateful_dataloader=case.stateful,
        **prepare,
    )
    try:
        prepared.track_padding()
    except ValueError:
        pass  # this mode cannot tell padding apart: then it must not pad (checked by the oracle)
    return prepared


def _values(batch: Any) -> list[int]:
    if isinstance(batch, dict):
        batch = batch["id"]
    return [int(v) for v in batch]


class Pass:
    """One process's view of one pass: batches (values, real count) and ``len()`` as asked."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.len_before = _length(loader)
        self.len_first: int | None = None
        self.len_last: int | None = None
        self.batches: list[tuple[list[int], int]] = []
        self.remainder: int | None = None  # loader.remainder at the pass's last batch
        self.iterator = iter(loader)
        self.done = False

    def take(self, count: int | None = None) -> None:
        """Up to ``count`` more batches (all when ``None``, exhausting the pass)."""
        while count is None or count > 0:
            try:
                batch = next(self.iterator)
            except StopIteration:
                self.done = True
                return
            values = _values(batch)
            real = self.loader.batch_real_count
            self.batches.append((values, len(values) if real is None else real))
            length = _length(self.loader)
            if len(self.batches) == 1:
                self.len_first = length
            self.len_last = length
            if self.loader.end_of_dataloader:
                self.remainder = self.loader.remainder
            if count is not None:
                count -= 1

    def close(self) -> None:
        self.iterator = None  # type: ignore[assignment]


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _position(loader: Any, stateful: bool) -> dict[str, Any]:
    state = loader.state_dict()
    return state["_shardplug_position"] if stateful else state


def same_position(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if set(a) != set(b):
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _check_same_positions(positions: list[dict[str, Any]], where: str) -> None:
    for rank, position in enumerate(positions[1:], 1):
        assert same_position(positions[0], position), (
            f"positions differ: process 0 {positions[0]} process {rank} {position} ({where})"
        )


def steps_of(case: Case, processes: int) -> int:
    return case.batch_size if case.split_batches else case.batch_size * processes


class Group:
    """N processes of one run: simulated in this process, or this rank of a real process group."""

    def __init__(self, case: Case, processes: int) -> None:
        self.case, self.processes = case, processes
        self.distributed = dist.is_initialized()
        if self.distributed:
            assert dist.get_world_size() == processes
            self.ranks = [dist.get_rank()]
        else:
            self.ranks = list(range(processes))

    def build(self) -> list[Any]:
        if self.distributed:  # every rank seeded differently; process 0's draws the same in every run
            torch.manual_seed(1234 + self.ranks[0])
        loaders = [build(self.case, self.processes, r, explicit=not self.distributed) for r in self.ranks]
        if self.distributed:  # (a seed is drawn when the loader is built, or at its first pass)
            torch.manual_seed(1234 + self.ranks[0])
        return loaders

    def gather(self, values: list[Any]) -> list[Any]:
        """Every process's value (by rank), from this process's ``values``."""
        if not self.distributed:
            return values
        out: list[Any] = [None] * self.processes
        dist.all_gather_object(out, values[0])
        return out


def _take_to(passes: list[Pass], point: str, epoch_batches: list[int | None]) -> None:
    """Advance every process's pass to ``point`` of the epoch, in steps (the same number of
    batches on every process: one with fewer batches, ``even_batches=False``, ends its pass)."""
    known = [t for t in epoch_batches if t is not None]
    total = max(known) if len(known) == len(epoch_batches) and known else None
    if point == "ended":
        count: int | None = None
    elif total is None:
        count = {"start": 0, "one": 1}.get(point, 2)
    else:
        count = {"start": 0, "one": 1, "half": total // 2, "all_but_one": total - 1, "all_open": total}[point]
    for p in passes:
        if count is None or count > 0:
            p.take(count)


def reference(case: Case, processes: int, epochs: int = 2) -> list[list[list[tuple[list[int], int]]]]:
    """An uninterrupted run: per epoch, per process (rank order), its batches."""
    group = Group(case, processes)
    loaders = group.build()
    out = []
    for _ in range(epochs):
        mine = []
        for loader in loaders:
            p = Pass(loader)
            p.take()
            mine.append(p.batches)
        out.append(group.gather(mine) if group.distributed else mine)
    return out


def _flatten(per_process: list[list[tuple[list[int], int]]]) -> list[int]:
    return [v for batches in per_process for values, real in batches for v in values[:real]]


def _check_padding(case: Case, batches: list[tuple[list[int], int]], where: str) -> None:
    pads = not case.drop_last and case.even_batches
    for values, real in batches:
        assert 0 <= real <= len(values), f"{where}: real count {real} for the batch {values}"
        if real < len(values):
            assert pads, f"{where}: padding {values[real:]} in a mode that does not pad"


def _check_exactly_once(case: Case, seen: list[int], steps: list[int], where: str) -> None:
    counts = Counter(seen)
    repeated = sorted(v for v, c in counts.items() if c > 1)
    assert not repeated, f"{where}: samples seen twice: {repeated[:20]} ({case})"
    missing = sorted(set(range(case.n)) - set(counts))
    if case.drop_last:  # a step short at most (each DataLoader worker drops its own short batch of a stream it splits)
        short = max(steps) * (max(case.workers, 1) if case.data in ("worker_split", "wds", "hf", "sharded") else 1)
        assert len(missing) < short, f"{where}: {len(missing)} samples lost: {missing[:20]} ({case})"
    else:
        assert not missing, f"{where}: samples lost: {missing[:20]} ({case})"
    assert set(counts) <= set(range(case.n)), f"{where}: unknown samples {sorted(set(counts) - set(range(case.n)))}"


def _check_counts(case: Case, counts: list[int], where: str) -> None:
    if case.even_batches or case.drop_last:
        assert len(set(counts)) == 1, f"{where}: unequal batch counts {counts} ({case})"


@dataclass
class Saved:
    """What the first run leaves: the batches it took of the epoch it stopped in, the states it saved."""

    target_epoch: int
    first_part: list[Any]
    states: list[Any]
    taken: list[int]


def run_before(case: Case, resume: Resume) -> Saved:
    """The first run (N processes): up to the point, then every process's state (or batch count)."""
    before = Group(case, resume.n_before)
    ref_before = reference(case, resume.n_before, epochs=2)
    loaders = before.build()
    point, target_epoch = resume.point, 0
    if point == "mid_next":
        for loader in loaders:
            Pass(loader).take()
        target_epoch, point = 1, "half"
    epoch_batches = [len(b) for b in ref_before[target_epoch]]
    passes = [Pass(loader) for loader in loaders]
    _take_to(passes, point, epoch_batches)
    first_part = before.gather([p.batches for p in passes])
    taken = before.gather([len(p.batches) for p in passes])
    if point == "ended" or not resume.skip and _position(loaders[0], case.stateful)["epoch"] > target_epoch:
        # the epoch is over (also while its last pass is still open): the position is the next epoch's start
        target_epoch += 1
        first_part, taken = [], [0] * resume.n_before
    states: list[Any] = []
    if not resume.skip:
        positions = before.gather([_position(loader, case.stateful) for loader in loaders])
        _check_same_positions(positions, f"{case}, {resume}")
        states = before.gather([loader.state_dict() for loader in loaders]) if case.stateful else positions
    for p in passes:
        p.close()
    return Saved(target_epoch, first_part, states, taken)


def run_after(case: Case, resume: Resume, saved: Saved) -> dict[str, Any]:
    """The second run (M processes): load, finish the epoch (resuming once more when asked), run the next."""
    after_n = resume.n_before if resume.skip else resume.n_after
    after = Group(case, after_n)
    target_epoch, first_part = saved.target_epoch, list(saved.first_part)

    def state_for(rank: int, states: list[Any]) -> Any:
        # a StatefulDataLoader's state is each process's own (a process the first run did not have loads process 0's)
        return states[rank] if case.stateful and rank < len(states) else states[0]

    if resume.skip:
        fresh = after.build()
        for loader in fresh:  # the skip starts in the loader's current epoch
            for _ in range(target_epoch):
                Pass(loader).take()
        originals = fresh
        steps = max(saved.taken, default=0)  # the steps taken (a process with fewer batches took them all)
        resumed = [shardplug.skip_first_batches(loader, steps) for loader in fresh]
    else:
        resumed = originals = after.build()
        for rank, loader in zip(after.ranks, resumed):
            loader.load_state_dict(state_for(rank, saved.states))
            if resume.load_twice:
                loader.load_state_dict(state_for(rank, saved.states))
    rest = [Pass(loader) for loader in resumed]
    if resume.resume_twice:  # (after a skip: a position saved inside the skipped pass)
        for p in rest:
            p.take(1)
        first_part = first_part + after.gather([p.batches for p in rest])
        if _position(resumed[0], case.stateful)["epoch"] > target_epoch:  # that batch ended the epoch
            target_epoch, first_part = target_epoch + 1, []
        positions = after.gather([_position(loader, case.stateful) for loader in resumed])
        _check_same_positions(positions, f"{case}, {resume}, a step after the resume")
        states = after.gather([loader.state_dict() for loader in resumed]) if case.stateful else positions
        for p in rest:
            p.close()
        resumed = originals = after.build()
        for rank, loader in zip(after.ranks, resumed):
            loader.load_state_dict(state_for(rank, states))
        rest = [Pass(loader) for loader in resumed]
    for p in rest:
        p.take()
    following = [Pass(loader) for loader in originals]
    for p in following:
        p.take()
    return {
        "target_epoch": target_epoch,
        "first_part": first_part,
        "rest": after.gather([p.batches for p in rest]),
        "rest_lengths": after.gather([(p.len_before, p.len_first, p.len_last, len(p.batches)) for p in rest]),
        "next": after.gather([p.batches for p in following]),
        "next_lengths": after.gather([(p.len_before, p.len_first, p.len_last, len(p.batches)) for p in following]),
        "rest_remainder": after.gather([p.remainder for p in rest]),
        "next_remainder": after.gather([p.remainder for p in following]),
        "reference": reference(case, after_n, epochs=target_epoch + 2)[target_epoch + 1],
        "tracked": resumed[0].batch_real_count is not None,
    }


def verify(case: Case, resume: Resume, result: dict[str, Any]) -> None:
    """The oracle, on what :func:`run_after` returned."""
    where = f"{case}, {resume}"
    after_n = resume.n_before if resume.skip else resume.n_after
    for name in ("rest", "next"):
        for rank, (before, first, last, got) in enumerate(result[f"{name}_lengths"]):
            for asked, value in (("before", before), ("at the first batch of", first), ("at the last batch of", last)):
                if value is not None:
                    assert value == got, (
                        f"{where}: process {rank} len() {asked} the {name} pass is {value}, it yields {got}"
                    )
    if case.dispatch:  # the last step's real rows, on every process (also of a stream without len())
        for name in ("rest", "next"):
            last = [batches[-1][1] for batches in result[name] if batches]
            if last:
                expected = sum(last) % steps_of(case, after_n)
                assert result[f"{name}_remainder"] == [expected] * after_n, (
                    f"{where}: remainder at the {name} pass's last step {result[f'{name}_remainder']}, its real rows "
                    f"{last} (of steps of {steps_of(case, after_n)})"
                )
    for batches in result["rest"]:
        _check_padding(case, batches, where)
    _check_counts(case, [len(b) for b in result["rest"]], where)
    steps = [steps_of(case, resume.n_before), steps_of(case, after_n)]
    _check_exactly_once(case, _flatten(result["first_part"]) + _flatten(result["rest"]), steps, where)
    assert result["next"] == result["reference"], (
        f"{where}: the next epoch differs from an uninterrupted run's:\n{result['next']}\n!=\n{result['reference']}"
    )


def check(case: Case, resume: Resume) -> None:
    """Run ``case`` stopped and continued as ``resume`` describes (processes simulated), and assert the oracle."""
    verify(case, resume, run_after(case, resume, run_before(case, resume)))


def check_distributed(case: Case, resume: Resume, timeout: float = 120.0) -> None:
    """:func:`check` on real gloo process groups: N processes, then M."""
    from _dist import run_gloo

    saved = run_gloo(_before_rank, case, resume, world_size=resume.n_before, timeout=timeout)[0]
    after_n = resume.n_before if resume.skip else resume.n_after
    result = run_gloo(_after_rank, case, resume, saved, world_size=after_n, timeout=timeout)[0]
    verify(case, resume, result)


def _before_rank(rank: int, world: int, case: Case, resume: Resume) -> Saved:
    return run_before(case, resume)


def _after_rank(rank: int, world: int, case: Case, resume: Resume, saved: Saved) -> dict[str, Any]:
    return run_after(case, resume, saved)


def check_many_distributed(scenarios: list[tuple[Case, Resume]], timeout: float = 300.0) -> dict[int, str]:
    """:func:`check_distributed` for many scenarios in few process groups: one spawn per number of
    processes before, one per number after.  Returns, per scenario index, the failure (or refusal)
    as text; an empty dict when every scenario passed."""
    from _dist import run_gloo

    problems: dict[int, str] = {}
    saved: dict[int, Any] = {}
    for n in sorted({r.n_before for _, r in scenarios}):
        chosen = [(i, c, r) for i, (c, r) in enumerate(scenarios) if r.n_before == n]
        for i, outcome in run_gloo(_many_before, chosen, world_size=n, timeout=timeout)[0].items():
            if isinstance(outcome, str):
                problems[i] = outcome
            else:
                saved[i] = outcome
    after_n = {i: (r.n_before if r.skip else r.n_after) for i, (_, r) in enumerate(scenarios) if i in saved}
    for m in sorted(set(after_n.values())):
        chosen = [(i, *scenarios[i], saved[i]) for i, n in after_n.items() if n == m]
        for i, outcome in run_gloo(_many_after, chosen, world_size=m, timeout=timeout)[0].items():
            if isinstance(outcome, str):
                problems[i] = outcome
                continue
            try:
                verify(*scenarios[i], outcome)
            except AssertionError as exc:
                problems[i] = f"AssertionError: {exc}"
    return problems


def _many_before(rank: int, world: int, chosen: list[tuple[int, Case, Resume]]) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for i, case, resume in chosen:
        try:
            out[i] = run_before(case, resume)
        except Exception as exc:  # every rank raises alike (the oracle's checks are global)
            out[i] = f"{type(exc).__name__}: {exc}"
    return out


def _many_after(rank: int, world: int, chosen: list[tuple[int, Case, Resume, Saved]]) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for i, case, resume, saved in chosen:
        try:
            out[i] = run_after(case, resume, saved)
        except Exception as exc:
            out[i] = f"{type(exc).__name__}: {exc}"
    return out
