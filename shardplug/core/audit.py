"""An exactly-once audit: which samples were consumed in each epoch, and how often.

Each process records the dataset indices of the batches it was handed (real samples and
wrap-around padding apart).  The records are per-epoch count vectors, so they add up across
processes and across a resume: :meth:`SampleAudit.gathered` sums them over the process group and
:meth:`SampleAudit.report` says, per epoch, what was seen, missed, duplicated and padded.

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
from typing import Any, Optional

import torch
import torch.distributed as dist

from .topology import distributed_is_active

__all__ = ["SampleAudit", "AuditReport"]


@dataclass(frozen=True)
class AuditReport:
    """What one epoch consumed, over the processes whose records were combined."""

    epoch: int
    dataset_length: int
    seen: int
    missing: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    padding: int = 0

    @property
    def exact(self) -> bool:
        """Every sample consumed exactly once (padding apart)."""
        return not self.missing and not self.duplicated


class SampleAudit:
    """Per-epoch counts of how often each dataset index was consumed as a real sample.

    ``state_dict()`` holds a count tensor per epoch (loads with ``weights_only=True``);
    :meth:`load_state_dict` *adds* a saved record to this one, so records of the processes of
    an interrupted run can be combined with the resumed run's (load it on one process only, or
    load the gathered record everywhere and gather only the new part).
    """

    def __init__(self, dataset_length: Optional[int]) -> None:
        if dataset_length is None:
            raise ValueError("an audit needs a sized dataset (len(dataset)); this loader's dataset has no length")
        self.dataset_length = int(dataset_length)
        self.counts: dict[int, torch.Tensor] = {}
        self.padding: dict[int, int] = {}

    def _epoch(self, epoch: int) -> torch.Tensor:
        if epoch not in self.counts:
            self.counts[epoch] = torch.zeros(self.dataset_length, dtype=torch.int32)
            self.padding[epoch] = 0
        return self.counts[epoch]

    def record(self, epoch: int, indices: list[int], real: int) -> None:
        """Count the first ``real`` of ``indices`` as consumed in ``epoch``, the rest as padding."""
        counts = self._epoch(epoch)
        if real:
            counts.index_add_(0, torch.as_tensor(indices[:real], dtype=torch.int64), torch.ones(real, dtype=torch.int32))
        self.padding[epoch] += len(indices) - real

    def state_dict(self) -> dict[str, Any]:
        return {
            "dataset_length": self.dataset_length,
            "epochs": {int(e): {"counts": c.clone(), "padding": self.padding[e]} for e, c in self.counts.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Add a saved record to this one."""
        if int(state_dict["dataset_length"]) != self.dataset_length:
            raise ValueError(
                f"the saved audit is for a dataset of {state_dict['dataset_length']} samples, this one has "
                f"{self.dataset_length}; load the audit saved for this dataset"
            )
        for epoch, record in state_dict["epochs"].items():
            self._epoch(int(epoch)).add_(record["counts"].to(torch.int32))
            self.padding[int(epoch)] += int(record["padding"])

    def gathered(self) -> "SampleAudit":
        """The sum of every process's record (a collective: call it on every process)."""
        combined = SampleAudit(self.dataset_length)
        combined.load_state_dict(self.state_dict())
        if not distributed_is_active() or dist.get_world_size() == 1:
            return combined
        epochs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(epochs, sorted(combined.counts))
        for epoch in sorted({e for ranks in epochs for e in ranks}):
            counts = combined._epoch(epoch)
            padding = torch.tensor([combined.padding[epoch]], dtype=torch.int64)
            dist.all_reduce(counts)
            dist.all_reduce(padding)
            combined.padding[epoch] = int(padding.item())
        return combined

    def report(self, epoch: int) -> AuditReport:
        """What ``epoch`` consumed according to this record."""
        counts = self.counts.get(epoch, torch.zeros(self.dataset_length, dtype=torch.int32))
        return AuditReport(
            epoch=epoch,
            dataset_length=self.dataset_length,
            seen=int((counts > 0).sum().item()),
            missing=torch.nonzero(counts == 0).flatten().tolist(),
            duplicated=torch.nonzero(counts > 1).flatten().tolist(),
            padding=self.padding.get(epoch, 0),
        )
