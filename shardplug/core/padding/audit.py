"""An exactly-once audit: which samples were consumed in each epoch, and whether any twice.

Each process records the dataset indices of the batches it was handed (real samples and
wrap-around padding apart).  A record keeps at most two bits per sample and epoch: *seen* and
*seen more than once*, as two bitmaps, the second allocated at the first duplicate (an exact epoch
holds ``n / 8`` bytes: 125 MB for a billion samples; at most ``n / 4``), so records add
up across processes and across a resume: :meth:`SampleAudit.gathered` combines every process's
(bitwise-or collectives of bounded chunks, exact whenever no sample was seen by two processes; otherwise an exact
pairwise merge) and :meth:`SampleAudit.report` summarises an epoch: how many samples were seen,
missed and duplicated, with the first few ids of each.

Example::

    loader = prepare_data_loader(DataLoader(dataset, batch_size=8, shuffle=True))
    audit = loader.enable_audit()
    for batch in loader:
        ...
    report = audit.gathered().report(epoch=0)
    assert report.exact, report
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardplug.core._internal.arguments import is_int
from shardplug.core._internal.collectives import waiting_for
from shardplug.core._internal.topology import distributed_is_active

__all__ = ["SampleAudit", "AuditReport", "CycleReport"]


@dataclass(frozen=True)
class CycleReport:
    """What one epoch read of one cycle of one source of a mixture (:meth:`SampleAudit.by_source`): the source's
    ``length``, how many of its samples were ``seen`` in that cycle, and how many ``duplicated`` (a sample at two
    positions of the cycle, or a position seen twice)."""

    source: str
    cycle: int
    length: int
    seen: int
    duplicated: int

    @property
    def complete(self) -> bool:
        """Every sample of the cycle read in this epoch, none twice."""
        return self.seen == self.length and not self.duplicated


_BIT = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


@dataclass(frozen=True)
class AuditReport:
    """What one epoch consumed, over the processes whose records were combined.

    ``missing`` and ``duplicated`` list the first :attr:`SampleAudit.report_ids` ids of each (all
    of them for small datasets); ``missing_count`` and ``duplicated_count`` count them all.
    """

    epoch: int
    dataset_length: int
    seen: int
    missing: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    padding: int = 0
    missing_count: int = 0
    duplicated_count: int = 0

    @property
    def exact(self) -> bool:
        """Every sample consumed exactly once (padding apart)."""
        return self.missing_count == 0 and self.duplicated_count == 0


class _EpochRecord:
    """A bitmap of the samples seen, one of those seen more than once (allocated at the first
    duplicate: an exact epoch costs one bit a sample), and a padding count."""

    __slots__ = ("seen", "twice", "padding")

    def __init__(self, length: int) -> None:
        self.seen = torch.zeros((length + 7) // 8, dtype=torch.uint8)
        self.twice: torch.Tensor | None = None
        self.padding = 0

    def mark_twice(self, byte: torch.Tensor, masks: torch.Tensor) -> None:
        if self.twice is None:
            if not bool(masks.any()):
                return
            self.twice = torch.zeros_like(self.seen)
        self.twice[byte] |= masks

    def add(self, seen: torch.Tensor, twice: torch.Tensor | None, padding: int) -> None:
        """Combine with another record: a sample seen in both is seen twice (read in chunks: the
        temporary memory stays O(_CHUNK); the seen-twice bitmap is allocated at the first such sample)."""
        for start in range(0, self.seen.numel(), _CHUNK):
            part = slice(start, start + _CHUNK)
            mine = self.seen[part]
            both = mine & seen[part]
            if twice is not None:
                both |= twice[part]
            if self.twice is not None or bool(both.any()):
                if self.twice is None:
                    self.twice = torch.zeros_like(self.seen)
                self.twice[part] |= both
            mine |= seen[part]
        self.padding += padding

    def copy(self) -> _EpochRecord:
        copied = _EpochRecord(0)
        copied.seen = self.seen.clone()
        copied.twice = self.twice.clone() if self.twice is not None else None
        copied.padding = self.padding
        return copied

    def twice_or_zeros(self) -> torch.Tensor:
        return self.twice if self.twice is not None else torch.zeros_like(self.seen)


_POPCOUNT = torch.tensor([bin(byte).count("1") for byte in range(256)], dtype=torch.int64)
_CHUNK = 1 << 20
"""Bytes of a bitmap that a report, a count or a combination reads at a time (bounds their temporary
memory: a few times 8 bytes a byte of chunk, tens of MB, whatever the dataset's length)."""
_GATHER_CHUNK = 1 << 22
"""Bytes of a bitmap that one collective of :meth:`SampleAudit.gathered` combines."""


def _popcount(bitmap: torch.Tensor) -> int:
    """Set bits in ``bitmap``, read in chunks (temporary memory stays O(_CHUNK))."""
    return sum(
        int(_POPCOUNT[bitmap[start : start + _CHUNK].long()].sum()) for start in range(0, bitmap.numel(), _CHUNK)
    )


def _first_ids(bitmap: torch.Tensor, length: int, limit: int, set_bits: bool) -> list[int]:
    """The first ``limit`` ids (below ``length``) whose bit is set (``set_bits``) or clear, read in chunks."""
    found: list[int] = []
    offsets = torch.arange(8, dtype=torch.int64)
    for start in range(0, bitmap.numel(), _CHUNK):
        if len(found) >= limit:
            break
        chunk = bitmap[start : start + _CHUNK]
        # bytes holding one such bit at least (each gives an id, the last byte's bits past length aside)
        where = torch.nonzero(chunk != 0 if set_bits else chunk != 255).flatten()[: limit - len(found)]
        if not where.numel():
            continue
        bits = (chunk[where][:, None] & _BIT) != 0
        ids = ((where[:, None] + start) * 8 + offsets)[bits if set_bits else ~bits]
        found += ids[ids < length][: limit - len(found)].tolist()
    return found


class SampleAudit:
    """Per-epoch records of which dataset indices were consumed as real samples, and which twice.

    ``state_dict()`` holds two uint8 bitmaps per epoch (loads with ``weights_only=True``);
    :meth:`load_state_dict` *adds* a saved record to this one, so records of the processes of
    an interrupted run can be combined with the resumed run's (load it on one process only, or
    load the gathered record everywhere and gather only the new part).  :meth:`drop_epoch` forgets
    an epoch once it was checked.
    """

    report_ids = 100
    """How many ids of missing and of duplicated samples a report lists at most."""

    def __init__(self, dataset_length: int | None) -> None:
        if dataset_length is None:
            raise ValueError("an audit needs a sized dataset (len(dataset)); this loader's dataset has no length")
        self.dataset_length = int(dataset_length)
        self.records: dict[int, _EpochRecord] = {}

    def _epoch(self, epoch: int) -> _EpochRecord:
        if epoch not in self.records:
            self.records[epoch] = _EpochRecord(self.dataset_length)
        return self.records[epoch]

    @property
    def epochs(self) -> list[int]:
        return sorted(self.records)

    @property
    def nbytes(self) -> int:
        """Memory the records hold (their bitmaps)."""
        return sum(r.seen.numel() + (r.twice.numel() if r.twice is not None else 0) for r in self.records.values())

    def drop_epoch(self, epoch: int) -> None:
        """Forget what ``epoch`` consumed (its memory is freed)."""
        self.records.pop(epoch, None)

    def record(self, epoch: int, indices: list[int], real: int) -> None:
        """Count the first ``real`` of ``indices`` as consumed in ``epoch``, the rest as padding."""
        record = self._epoch(epoch)
        record.padding += len(indices) - real
        if not real:
            return
        ids, repeats = torch.as_tensor(indices[:real], dtype=torch.int64).unique(return_counts=True)
        byte, masks = ids >> 3, _BIT[ids & 7]
        # ids are distinct, so the masks of one byte are distinct bits: their sum is their or
        bytes_, slot = byte.unique(return_inverse=True)
        combined = torch.zeros(bytes_.numel(), dtype=torch.uint8).index_add_(0, slot, masks)
        again = torch.zeros_like(combined).index_add_(0, slot, masks * (repeats > 1).to(torch.uint8))
        record.mark_twice(bytes_, again | (record.seen[bytes_] & combined))
        record.seen[bytes_] |= combined

    def state_dict(self) -> dict[str, Any]:
        return {
            "dataset_length": self.dataset_length,
            "epochs": {
                int(e): {"seen": r.seen.clone(), "twice": r.twice_or_zeros().clone(), "padding": r.padding}
                for e, r in self.records.items()
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Add a saved record to this one (also one saved by shardplug 0.1, with count vectors).

        The whole state is checked first (its length, every epoch's bitmaps or counts and padding):
        a state that does not describe this dataset is a ``ValueError`` / ``TypeError`` naming the
        key and the value, and nothing is added."""
        for epoch, seen, twice, padding in _checked_epochs(state_dict, self.dataset_length):
            self._epoch(epoch).add(seen, twice, padding)

    def gathered(self) -> SampleAudit:
        """Every process's record combined (a collective: call it on every process).

        Per epoch, one sum of counts, then a bitwise-or all-reduce of the bitmaps in chunks of
        ``_GATHER_CHUNK`` bytes (the memory above the records is the result's bitmaps and one chunk);
        exact when no sample was seen by two processes, which the counts tell.  Otherwise the
        records are merged pairwise along a tree, chunk by chunk, also exactly."""
        combined = SampleAudit(self.dataset_length)
        if not distributed_is_active() or dist.get_world_size() == 1:
            combined.records = {epoch: record.copy() for epoch, record in self.records.items()}
            return combined
        epochs: list[Any] = [None] * dist.get_world_size()
        with waiting_for("every process's record of the samples it was given (SampleAudit.gathered)"):
            dist.all_gather_object(epochs, sorted(self.records))
            for epoch in sorted({e for ranks in epochs for e in ranks}):
                combined.records[epoch] = _gather_record(self.records.get(epoch), (self.dataset_length + 7) // 8)
        return combined

    def report(self, epoch: int) -> AuditReport:
        """What ``epoch`` consumed according to this record (counts, and the first ids of each kind;
        read in chunks of ``_CHUNK`` bytes: its temporary memory does not grow with the dataset)."""
        n, limit = self.dataset_length, self.report_ids
        record = self.records.get(epoch)
        if record is None:  # nothing recorded: every sample missing
            return AuditReport(
                epoch=epoch, dataset_length=n, seen=0, missing=list(range(min(n, limit))), missing_count=n
            )
        seen = _popcount(record.seen)
        duplicated = _popcount(record.twice) if record.twice is not None else 0
        first_missing = _first_ids(record.seen, n, limit, set_bits=False) if seen < n else []
        first_duplicated = _first_ids(record.twice, n, limit, set_bits=True) if duplicated else []  # type: ignore[arg-type]
        return AuditReport(
            epoch=epoch,
            dataset_length=n,
            seen=seen,
            missing=first_missing,
            duplicated=first_duplicated,
            padding=record.padding,
            missing_count=n - seen,
            duplicated_count=duplicated,
        )

    def by_source(self, mixture: Any, epoch: int) -> list[CycleReport]:
        """What ``epoch`` read of each cycle of each source of ``mixture`` (a
        :class:`~shardplug.core.sharding.mixture.Mixture`, whose loader recorded positions of the epoch), by
        source and cycle: a cycle begun in the previous epoch, or going on into the next, reads only part of it
        here; one whose samples are all seen, none twice, is :attr:`CycleReport.complete`. Reads every seen
        position (O(positions seen) Python work: for checks, not for every step)."""
        record = self.records.get(epoch)
        if record is None:
            return []
        n = self.dataset_length
        ids = _first_ids(record.seen, n, n, set_bits=True)
        twice = set(_first_ids(record.twice, n, n, set_bits=True)) if record.twice is not None else set()
        cycles: dict[tuple[str, int], list[int]] = {}
        repeated: dict[tuple[str, int], int] = {}
        for position, draw in zip(ids, mixture.locate_many([epoch * n + i for i in ids])):
            key = (draw.source, draw.cycle)
            cycles.setdefault(key, []).append(draw.sample)
            if position in twice:
                repeated[key] = repeated.get(key, 0) + 1
        return [
            CycleReport(
                source,
                cycle,
                mixture.order.lengths[source],
                len(set(samples)),
                len(samples) - len(set(samples)) + repeated.get((source, cycle), 0),
            )
            for (source, cycle), samples in sorted(cycles.items())
        ]


def _gather_record(local: _EpochRecord | None, size: int) -> _EpochRecord:
    """Every process's record of one epoch (``local``: this process's, if it has one) combined, in chunks."""
    counts = torch.tensor(
        [
            _popcount(local.seen) if local else 0,
            local.padding if local else 0,
            int(local is not None and local.twice is not None),
        ],
        dtype=torch.int64,
    )
    dist.all_reduce(counts)
    out = _EpochRecord(0)
    out.seen, out.padding = torch.empty(size, dtype=torch.uint8), int(counts[1])
    out.twice = torch.empty(size, dtype=torch.uint8) if int(counts[2]) else None
    for start in range(0, size, _GATHER_CHUNK):
        part = slice(start, min(start + _GATHER_CHUNK, size))
        out.seen[part] = _or_reduced(local.seen[part] if local else None, part)
        if out.twice is not None:
            out.twice[part] = _or_reduced(local.twice[part] if local and local.twice is not None else None, part)
    if _popcount(out.seen) != int(counts[0]):  # a sample in two processes' records: merge exactly
        _tree_merge(out, local, size)
    return out


def _or_reduced(piece: torch.Tensor | None, part: slice) -> torch.Tensor:
    """The bitwise or over every process of a chunk of a bitmap (``None``: this process has zeros)."""
    buffer = piece.clone() if piece is not None else torch.zeros(part.stop - part.start, dtype=torch.uint8)
    dist.all_reduce(buffer, op=dist.ReduceOp.BOR)
    return buffer


_LOAD_FIX = "load what SampleAudit.state_dict() saved for this dataset"


def _checked_epochs(state: Any, length: int) -> list[tuple[int, torch.Tensor, torch.Tensor, int]]:
    """Every epoch of a saved audit ``state`` as (epoch, seen, twice, padding), all checked before
    any is used."""
    if not isinstance(state, dict) or "dataset_length" not in state or "epochs" not in state:
        raise TypeError(
            f"the audit state {_short(state)} is not a dict with 'dataset_length' and 'epochs'; {_LOAD_FIX}"
        )
    saved_length = state["dataset_length"]
    if not is_int(saved_length) or saved_length != length:
        raise ValueError(
            f"the saved audit is for a dataset of {saved_length!r} samples, this one has {length}; load the audit "
            "saved for this dataset"
        )
    epochs = state["epochs"]
    if not isinstance(epochs, dict):
        raise TypeError(f"the audit state's epochs={_short(epochs)} is not a dict of epoch -> record; {_LOAD_FIX}")
    return [_checked_epoch(epoch, saved, length) for epoch, saved in epochs.items()]


def _checked_epoch(epoch: Any, saved: Any, length: int) -> tuple[int, torch.Tensor, torch.Tensor, int]:
    if not is_int(epoch) or epoch < 0:
        raise ValueError(f"the audit state has a record for epoch {epoch!r}: epochs are integers >= 0; {_LOAD_FIX}")
    where = f"the audit state's epoch {epoch}"
    if (
        not isinstance(saved, dict)
        or "padding" not in saved
        or not ("counts" in saved or {"seen", "twice"} <= saved.keys())
    ):
        raise TypeError(f"{where} is {_short(saved)}, not a dict with 'seen', 'twice' and 'padding'; {_LOAD_FIX}")
    padding = saved["padding"]
    if not is_int(padding):
        raise TypeError(f"{where} has padding={padding!r}: it must be an integer in [0, 2**63); {_LOAD_FIX}")
    if not 0 <= padding < 2**63:  # (gathered as an int64)
        raise ValueError(f"{where} has padding={padding}: it must be an integer in [0, 2**63); {_LOAD_FIX}")
    if "counts" in saved:  # shardplug 0.1: a count per sample
        counts = _checked_tensor(where, "counts", saved["counts"], (length,), integer=True)
        _check_counts(where, counts)
        return int(epoch), _pack(counts > 0), _pack(counts > 1), int(padding)
    size = (length + 7) // 8
    seen = _checked_bitmap(where, "seen", saved["seen"], size, length)
    twice = _checked_bitmap(where, "twice", saved["twice"], size, length)
    for start in range(0, size, _CHUNK):  # a sample seen twice is seen
        unseen = torch.nonzero(twice[start : start + _CHUNK] & ~seen[start : start + _CHUNK]).flatten()
        if unseen.numel():
            byte = start + int(unseen[0])
            raise ValueError(
                f"{where} has twice bits set for samples its seen bitmap does not have (byte {byte}: "
                f"twice={int(twice[byte])}, seen={int(seen[byte])}); {_LOAD_FIX}"
            )
    return int(epoch), seen, twice, int(padding)


def _checked_tensor(where: str, key: str, value: Any, shape: tuple[int, ...], integer: bool) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} has {key}={_short(value)}, which is not a tensor; {_LOAD_FIX}")
    if integer and (value.is_floating_point() or value.is_complex()):
        raise TypeError(
            f"{where} has {key} of dtype {value.dtype}: they must be integer (or bool) tensors; {_LOAD_FIX}"
        )
    if tuple(value.shape) != shape:
        raise ValueError(
            f"{where} has {key} of shape {tuple(value.shape)}, but this dataset needs {shape}; {_LOAD_FIX}"
        )
    return value


_COUNT_LIMIT = 2**31
"""shardplug 0.1 counted each sample's uses in an int32: its counts lie in ``[0, 2**31)``."""


def _check_counts(where: str, counts: torch.Tensor) -> None:
    """Refuse 0.1 counts outside ``[0, 2**31)``, naming the first sample out of range and its count."""
    if not counts.numel():
        return
    wide = counts.to(torch.int64)
    outside = torch.nonzero((wide < 0) | (wide >= _COUNT_LIMIT)).flatten()
    if outside.numel():
        sample = int(outside[0])
        raise ValueError(
            f"{where} has counts out of range: counts[{sample}]={int(wide[sample])} ({outside.numel()} of "
            f"{counts.numel()} samples outside [0, 2**31)); a record of shardplug 0.1 holds each sample's number of "
            f"uses in [0, 2**31); {_LOAD_FIX}"
        )


def _checked_bitmap(where: str, key: str, value: Any, size: int, length: int) -> torch.Tensor:
    bitmap = _checked_tensor(where, key, value, (size,), integer=True)
    if bitmap.dtype != torch.uint8:
        raise TypeError(f"{where} has {key} of dtype {bitmap.dtype}: bitmaps are uint8 tensors; {_LOAD_FIX}")
    if length % 8 and size and int(bitmap[-1]) >> (length % 8):
        raise ValueError(
            f"{where} has {key} bits set beyond the dataset's {length} samples "
            f"(last byte {int(bitmap[-1])}); {_LOAD_FIX}"
        )
    return bitmap


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _pack(flags: torch.Tensor) -> torch.Tensor:
    """One bool per sample as a bitmap (bit ``i % 8`` of byte ``i // 8``)."""
    padded = torch.zeros((flags.numel() + 7) // 8 * 8, dtype=torch.bool)
    padded[: flags.numel()] = flags.flatten().bool()
    return (padded.view(-1, 8).to(torch.uint8) * _BIT).sum(dim=1, dtype=torch.uint8)


def _tree_merge(out: _EpochRecord, local: _EpochRecord | None, size: int) -> None:
    """Combine every process's ``local`` record into ``out`` exactly (seen by two processes = seen
    twice), chunk by chunk: a binary tree of point-to-point exchanges to process 0, then a broadcast."""
    for start in range(0, size, _GATHER_CHUNK):
        stop = min(start + _GATHER_CHUNK, size)
        seen = local.seen[start:stop] if local else torch.zeros(stop - start, dtype=torch.uint8)
        twice = local.twice[start:stop] if local and local.twice is not None else torch.zeros_like(seen)
        planes = _merged_along_tree(torch.cat([seen, twice]), stop - start)
        out.seen[start:stop] = planes[: stop - start]
        if out.twice is None and bool(planes[stop - start :].any()):
            out.twice = torch.zeros(size, dtype=torch.uint8)
        if out.twice is not None:
            out.twice[start:stop] = planes[stop - start :]


def _merged_along_tree(planes: torch.Tensor, half: int) -> torch.Tensor:
    """``planes`` (seen, then twice) of every process merged exactly, on every process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step = 1
    while step < world:
        if rank % (2 * step) == step:
            dist.send(planes, dst=rank - step)
            break
        if rank % (2 * step) == 0 and rank + step < world:
            other = torch.empty_like(planes)
            dist.recv(other, src=rank + step)
            seen, twice = planes[:half], planes[half:]
            twice |= (seen & other[:half]) | other[half:]
            seen |= other[:half]
        step *= 2
    dist.broadcast(planes, src=0)
    return planes
