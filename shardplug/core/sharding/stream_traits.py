"""What a stream already does by itself: split across DataLoader workers, split by node, shuffle; and so the
kind of sharding it gets (:func:`stream_kind`: the planner's one look at a stream, with its checks).

Recognised by duck typing (the package never imports ``datasets`` or ``webdataset``); this is
the one place that uses their private attributes, reached through :mod:`shardplug.core._internal.compat`
(``datasets.IterableDataset._distributed``, ``._ex_iterable``, its chain's ``BufferShuffledExamplesIterable``
and ``generator``s; webdataset's ``pipeline`` stages by name), each checked by
``tests/streams/test_streams.py::test_the_stream_attributes_shardplug_reads_still_exist``:

* Hugging Face ``datasets.IterableDataset``: splits its shards across DataLoader workers by
  itself; ``split_dataset_by_node`` records the node split in ``_distributed``; ``shuffle()``
  adds a buffer shuffle to its chain of example iterables (its ``state_dict()`` does not save
  the buffer).
* webdataset pipelines (``DataPipeline`` / ``WebDataset``): stages ``split_by_worker`` (the
  default worker splitter) and ``split_by_node`` in their ``pipeline`` list.
* litdata's ``StreamingDataset`` and MosaicML ``streaming``'s ``StreamingDataset``: split across
  DataLoader workers by themselves, and by rank once they see several processes (litdata its
  ``distributed_env``, read from ``torch.distributed`` when it is built; streaming the rank world
  it read from the environment, ``RANK`` / ``WORLD_SIZE``, reached through :mod:`~shardplug.core._internal.compat`).
* A dataset of your own that reads only its DataLoader worker's part declares it with a class or
  instance attribute ``splits_by_worker = True`` (and ``split_by_node = True`` when it already reads
  only this process's part).

Example::

    >>> class Files(torch.utils.data.IterableDataset):
    ...     def __iter__(self):
    ...         return iter([])
    >>> class MyFiles(Files):
    ...     splits_by_worker = True  # each DataLoader worker reads only its own files
    >>> splits_by_worker(MyFiles()), splits_by_worker(Files())
    (True, False)
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch  # noqa: F401  (the docstring example)

from shardplug.core._internal import compat
from shardplug.core._internal.collectives import all_gather_objects, require_group
from shardplug.core._internal.topology import Readers
from shardplug.core.sharding.kinds import DISPATCH, LOCAL, NATIVE, PRESPLIT, READ_ALL, NodeSplit, ShardingKind
from shardplug.core.sharding.layout import ShardLayout

__all__ = [
    "stream_kind",
    "can_shard",
    "shards_natively",
    "check_stream",
    "check_worker_split",
    "splits_by_worker",
    "declared_worker_split",
    "asks_for_its_worker",
    "node_split",
    "stream_library",
    "single_node_only",
    "is_hf_iterable",
    "hf_shuffles",
    "shuffle_fingerprint",
]


logger = logging.getLogger(__name__)


def stream_kind(
    dataset: Any,
    dispatch_batches: bool | None,
    put_on_device: bool,
    layout: ShardLayout,
    num_workers: int,
    readers: Readers,
) -> ShardingKind:
    """The kind of sharding a stream gets under ``layout``, and what that kind's module reads of it:
    the one look at the stream (its node split, its worker split, whether it shards itself), with
    the checks of a stream several ranks read (:func:`check_stream`, :func:`check_worker_split`).

    ``dispatch_batches=None``: process 0 reads a stream for every process with ``put_on_device``,
    except a stream already split by node (each process reads its own part)."""
    split = node_split(dataset) if layout.num_processes > 1 else None
    if dispatch_batches and split is not None:
        raise ValueError(
            f"dispatch_batches=True has process 0 read the stream for every process, but this stream is already "
            f"split by node ({split.how}): process 0 holds only its own part; pass dispatch_batches=False (each "
            "process reads its part), or dispatch the stream before it is split"
        )
    dispatch = dispatch_batches if dispatch_batches is not None else put_on_device and split is None
    if dispatch:
        return ShardingKind(DISPATCH, reads=LOCAL)  # process 0 reads the stream as it is
    if layout.num_processes == 1:
        if readers.size > 1:  # the ranks of a device mesh's one data index each read it whole: alike, or refused
            check_stream(dataset, 1, 0, readers)
        return ShardingKind(LOCAL)
    check_stream(dataset, layout.num_processes, layout.process_index, readers)
    check_worker_split(dataset, num_workers)
    if split is not None:  # the stream reads only this process's part by itself
        return ShardingKind(PRESPLIT, split, splits_by_worker(dataset), library=stream_library(dataset))
    worker_split, hf = splits_by_worker(dataset), is_hf_iterable(dataset)
    if shards_natively(dataset, layout.num_processes, worker_split, hf):
        return ShardingKind(NATIVE, splits_by_worker=worker_split, hf=hf)
    if can_shard(dataset):
        _warn_read_whole(dataset, layout.num_processes)
    return ShardingKind(READ_ALL, splits_by_worker=worker_split, hf=hf)


def shards_natively(dataset: Any, num_processes: int, splits_by_worker: bool, hf: bool) -> bool:
    """Whether a stream gives each of ``num_processes`` processes a part of its own (see
    :func:`~shardplug.core.sharding.native._part`): it shards itself into at least as many shards,
    and shards that do not divide can be joined keeping its own split across workers (a Hugging Face
    stream's can) or shardplug splits them."""
    if not can_shard(dataset) or dataset.n_shards // num_processes == 0:
        return False
    return dataset.n_shards % num_processes == 0 or not splits_by_worker or hf


def _warn_read_whole(dataset: Any, num_processes: int) -> None:
    """Say why a stream that shards itself is read whole by every process."""
    n_shards, n = dataset.n_shards, num_processes
    why = (
        f"fewer than num_processes={n}"
        if n_shards < n
        else f"not a multiple of num_processes={n}, and its parts cannot be joined keeping its own split across "
        "DataLoader workers"
    )
    logger.warning(
        "the stream has n_shards=%s, %s: every process reads the whole stream (%dx the I/O of its part); give it "
        "a number of shards that %d divides to shard it natively",
        n_shards,
        why,
        n,
        n,
    )


def can_shard(dataset: Any) -> bool:
    """Whether ``dataset`` shards itself: an integer ``n_shards`` and a ``shard(num_shards, index)``."""
    return callable(getattr(dataset, "shard", None)) and isinstance(getattr(dataset, "n_shards", None), int)


def is_hf_iterable(dataset: Any) -> bool:
    """A Hugging Face ``datasets.IterableDataset``."""
    return (
        type(dataset).__module__.startswith("datasets.")
        and hasattr(dataset, "n_shards")
        and (compat.hf_example_iterable(dataset) is not None)
    )


def _wds_stages(dataset: Any) -> list[Any]:
    """The stages of a webdataset pipeline (``[]`` for anything else)."""
    stages = getattr(dataset, "pipeline", None)
    if not isinstance(stages, list) or not type(dataset).__module__.startswith("webdataset"):
        return []
    return stages


def _stage_named(stages: list[Any], name: str) -> bool:
    return any(getattr(stage, "__name__", None) == name for stage in stages)


def splits_by_worker(dataset: Any) -> bool:
    """Whether ``dataset`` reads only its DataLoader worker's part of the stream by itself."""
    return bool(declared_worker_split(dataset))


def stream_library(dataset: Any) -> str | None:
    """``"litdata"`` or ``"streaming"`` for those libraries' ``StreamingDataset`` (by duck typing:
    the module and an attribute each has), ``None`` for anything else."""
    module = type(dataset).__module__
    if module.startswith("litdata.") and hasattr(dataset, "distributed_env"):
        return "litdata"
    if module.startswith("streaming.") and compat.streaming_rank_world(dataset) is not None:
        return "streaming"
    return None


def declared_worker_split(dataset: Any) -> bool | None:
    """Whether ``dataset`` is known to split itself across DataLoader workers (``True``), known not
    to (``False``: a webdataset pipeline without a worker splitter, ``splits_by_worker = False``), or
    not known (``None``: a dataset of your own that declares nothing)."""
    declared = getattr(dataset, "splits_by_worker", None)
    if isinstance(declared, bool):
        return declared
    if is_hf_iterable(dataset) or stream_library(dataset) is not None:
        return True
    stages = _wds_stages(dataset)
    if stages:
        return _stage_named(stages, "split_by_worker")
    return None


def node_split(dataset: Any) -> NodeSplit | None:
    """How ``dataset`` is already split by node (process), or ``None`` when it is not."""
    if getattr(dataset, "split_by_node", None) is True:
        return NodeSplit("it declares split_by_node = True")
    if is_hf_iterable(dataset) and compat.hf_node_split(dataset) is not None:
        config = compat.hf_node_split(dataset)
        return NodeSplit(
            f"datasets.distributed.split_dataset_by_node(rank={config.rank}, world_size={config.world_size})",
            config.rank,
            config.world_size,
        )
    if _stage_named(_wds_stages(dataset), "split_by_node"):
        return NodeSplit("webdataset's nodesplitter=split_by_node")
    library = stream_library(dataset)
    if library == "litdata" and getattr(dataset.distributed_env, "world_size", 1) > 1:
        env = dataset.distributed_env
        return NodeSplit(
            f"litdata's StreamingDataset reads rank {env.global_rank} of {env.world_size}",
            env.global_rank,
            env.world_size,
        )
    if library == "streaming" and compat.streaming_rank_world(dataset).num_ranks > 1:
        world = compat.streaming_rank_world(dataset)
        return NodeSplit(
            f"streaming's StreamingDataset reads rank {world.rank} of {world.num_ranks}", world.rank, world.num_ranks
        )
    return None


def single_node_only(dataset: Any) -> bool:
    """A webdataset pipeline with webdataset's default node splitter, which refuses several processes."""
    return _stage_named(_wds_stages(dataset), "single_node_only")


def asks_for_its_worker(dataset: Any) -> bool:
    """Whether the dataset's ``__iter__`` calls ``get_worker_info()`` (as torch's documentation
    shows for a dataset that splits itself across workers): a hint, never a decision."""
    try:
        source = inspect.getsource(type(dataset).__iter__)
    except (OSError, TypeError):  # built in, or no source at hand
        return False
    return "get_worker_info" in source


def _hf_chain(dataset: Any) -> list[Any]:
    """The chain of example iterables of a Hugging Face stream, outermost first."""
    chain, node = [], compat.hf_example_iterable(dataset)
    while node is not None:
        chain.append(node)
        node = getattr(node, "ex_iterable", None)
    return chain


def hf_shuffles(dataset: Any) -> bool:
    """A Hugging Face stream with ``shuffle()`` applied (its own state does not restore the buffer)."""
    if not is_hf_iterable(dataset):
        return False
    if compat.hf_legacy_shuffling(dataset) is not None:  # datasets < 3
        return True
    return any(type(node).__name__ == "BufferShuffledExamplesIterable" for node in _hf_chain(dataset))


def shuffle_fingerprint(dataset: Any) -> str | None:
    """What a stream's shuffle depends on, to compare across processes (``None``: nothing known).

    A Hugging Face stream's ``shuffle(seed=None)`` draws a different seed in every process: its
    shards would then overlap.  The states of its shuffle generators tell."""
    if not is_hf_iterable(dataset):
        return None
    states = []
    for node in _hf_chain(dataset):
        generator = getattr(node, "generator", None)
        bit_generator = getattr(generator, "bit_generator", None)
        if bit_generator is not None:
            states.append(repr(bit_generator.state))
    return "|".join(states) if states else None


_GIVEN_SEEDS = 2**64
"""numpy's seed sequence of a drawn seed holds 128 bits of entropy; one of a given seed, that seed."""


def drew_its_seed(dataset: Any) -> bool:
    """Whether a Hugging Face stream's shuffle drew its seed itself (``shuffle()`` without ``seed=``,
    or a generator of ``np.random.default_rng()``): the entropy of its generator's seed sequence is
    not an integer below 2**64, which a given seed is.  Without a process group nothing else tells."""
    for node in _hf_chain(dataset):
        bit_generator = getattr(getattr(node, "generator", None), "bit_generator", None)
        if bit_generator is not None:
            entropy = getattr(getattr(bit_generator, "seed_seq", None), "entropy", None)
            if not isinstance(entropy, int) or not 0 <= entropy < _GIVEN_SEEDS:
                return True
    return False


def check_stream(dataset: Any, num_processes: int, process_index: int, readers: Readers | None = None) -> None:
    """Refuse a stream that shuffles differently on the ranks that read it (``readers``, compared
    with a collective: the data processes and the ranks that share a data index with one; where no
    process group runs, a shuffle that drew its own seed), or that cannot run on several processes.
    ``readers`` defaults to :meth:`Readers.of(num_processes) <shardplug.core._internal.topology.Readers.of>`."""
    readers = Readers.of(num_processes) if readers is None else readers
    fingerprint = shuffle_fingerprint(dataset)
    if fingerprint is not None and drew_its_seed(dataset):
        require_group(
            num_processes,
            process_index,
            "agreeing on the seed of the stream's shuffle",
            "its shuffle() without seed draws its own seed in every process, and their parts would overlap and miss "
            "elements",
            ", or pass shuffle(seed=...) the same seed on every process",
        )
    if fingerprint is not None and readers.size > 1:
        if len(set(all_gather_objects(fingerprint, group=readers.group, what="the stream's shuffle"))) > 1:
            raise ValueError(
                "the stream shuffles differently on each process (a Hugging Face shuffle() without seed draws its "
                "own seed in every process), so the processes' parts would overlap and miss elements, and ranks "
                "that share a data index (a device mesh's tp / cp ranks) would read different batches; pass "
                "shuffle(seed=...) with the same seed on every process"
            )
    if single_node_only(dataset):
        raise ValueError(
            "this WebDataset keeps webdataset's default nodesplitter=single_node_only, which refuses to run on more "
            "than one process; build it with WebDataset(urls, nodesplitter=None, ...): shardplug gives each "
            "process its part"
        )


def check_worker_split(dataset: Any, num_workers: int) -> None:
    """Refuse to guess whether a stream of your own splits itself across DataLoader workers where
    the answer matters and is in doubt: it shards itself, or its ``__iter__`` asks for its worker.
    Guessing wrong reads everything twice, or half of it."""
    if num_workers == 0 or declared_worker_split(dataset) is not None:
        return
    if can_shard(dataset):
        why = "shards itself (n_shards, shard())"
    elif asks_for_its_worker(dataset):
        why = "calls torch.utils.data.get_worker_info() in its __iter__"
    else:
        return  # a plain stream: every worker reads all of it, shardplug splits it
    raise ValueError(
        f"{type(dataset).__name__} {why}, and with num_workers={num_workers} shardplug must know whether it splits "
        "itself across DataLoader workers: declare splits_by_worker = True on the class if its __iter__ reads only its "
        "worker's part, or splits_by_worker = False if every worker reads all of it (shardplug then splits it)"
    )
