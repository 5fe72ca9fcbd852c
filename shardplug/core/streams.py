"""What a stream already does by itself: split across DataLoader workers, split by node, shuffle.

Recognised by duck typing (the package never imports ``datasets`` or ``webdataset``); this is
the one place that reads their private attributes (``datasets.IterableDataset._distributed``,
``._ex_iterable``, its chain's ``BufferShuffledExamplesIterable`` and ``generator``s; webdataset's ``pipeline``
stages by name), each checked by
``tests/test_streams.py::test_the_stream_attributes_shardplug_reads_still_exist``:

* Hugging Face ``datasets.IterableDataset``: splits its shards across DataLoader workers by
  itself; ``split_dataset_by_node`` records the node split in ``_distributed``; ``shuffle()``
  adds a buffer shuffle to its chain of example iterables (its ``state_dict()`` does not save
  the buffer).
* webdataset pipelines (``DataPipeline`` / ``WebDataset``): stages ``split_by_worker`` (the
  default worker splitter) and ``split_by_node`` in their ``pipeline`` list.
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
import sys
from typing import Any, Optional

import torch  # noqa: F401  (the docstring example)

__all__ = [
    "splits_by_worker", "declared_worker_split", "asks_for_its_worker", "node_split", "single_node_only",
    "is_hf_iterable", "hf_concatenate", "hf_shuffles", "shuffle_fingerprint",
]


def is_hf_iterable(dataset: Any) -> bool:
    """A Hugging Face ``datasets.IterableDataset``."""
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "n_shards") and hasattr(
        dataset, "_ex_iterable"
    )


def hf_concatenate(parts: list[Any]) -> Any:
    """Hugging Face streams joined one after the other (``datasets.concatenate_datasets``: the
    result keeps every part's shards, and so the split across DataLoader workers)."""
    package = sys.modules[type(parts[0]).__module__.split(".")[0]]  # imported: its objects exist
    return parts[0] if len(parts) == 1 else package.concatenate_datasets(parts)


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


def declared_worker_split(dataset: Any) -> Optional[bool]:
    """Whether ``dataset`` is known to split itself across DataLoader workers (``True``), known not
    to (``False``: a webdataset pipeline without a worker splitter, ``splits_by_worker = False``), or
    not known (``None``: a dataset of your own that declares nothing)."""
    declared = getattr(dataset, "splits_by_worker", None)
    if isinstance(declared, bool):
        return declared
    if is_hf_iterable(dataset):
        return True
    stages = _wds_stages(dataset)
    if stages:
        return _stage_named(stages, "split_by_worker")
    return None


def node_split(dataset: Any) -> Optional[str]:
    """How ``dataset`` is already split by node (process), in words, or ``None`` when it is not."""
    if getattr(dataset, "split_by_node", None) is True:
        return "it declares split_by_node = True"
    if is_hf_iterable(dataset) and getattr(dataset, "_distributed", None) is not None:
        config = dataset._distributed
        return f"datasets.distributed.split_dataset_by_node(rank={config.rank}, world_size={config.world_size})"
    if _stage_named(_wds_stages(dataset), "split_by_node"):
        return "webdataset's nodesplitter=split_by_node"
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
    chain, node = [], getattr(dataset, "_ex_iterable", None)
    while node is not None:
        chain.append(node)
        node = getattr(node, "ex_iterable", None)
    return chain


def hf_shuffles(dataset: Any) -> bool:
    """A Hugging Face stream with ``shuffle()`` applied (its own state does not restore the buffer)."""
    if not is_hf_iterable(dataset):
        return False
    if getattr(dataset, "_shuffling", None) is not None:  # datasets < 3
        return True
    return any(type(node).__name__ == "BufferShuffledExamplesIterable" for node in _hf_chain(dataset))


def shuffle_fingerprint(dataset: Any) -> Optional[str]:
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
