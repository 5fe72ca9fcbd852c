"""Packing: a micro-batch of variable-length samples as rows of at most ``row_tokens`` tokens, with the boundaries
varlen attention takes.

:class:`PackingCollate` is a ``collate_fn``: each call packs the samples of one micro-batch and nothing else (no
sample is split across rows, none is dropped, nothing is kept for the next call), so a resumed loader cannot lose
or repeat a packed sample.  Samples are placed longest first, each in the first row with room for it.

What a packed batch holds (``rows`` x ``width``, ``width`` the fullest row's tokens):

* ``input_ids`` (and every other per-token key of the samples, e.g. ``labels``): the samples' tokens, each row
  padded at its end (``pad_id``; ``labels`` with ``label_pad_id``);
* ``position_ids``: each sample's positions from 0 (0 on padding);
* ``document_ids``: which sample of the micro-batch each token belongs to (``-1`` on padding): a block-diagonal
  mask for PyTorch's attention is ``document_ids[:, :, None] == document_ids[:, None, :]`` (and causal);
* ``cu_seqlens`` (int32) and ``max_seqlen``: the sequence boundaries of the rows flattened
  (``input_ids.view(-1)``), each row's padding a sequence of its own, as FlashAttention's varlen functions take them;
* ``sample_index``: the sample (its place in the micro-batch) of each sequence of ``cu_seqlens`` (``-1``: padding).

Example::

    >>> import torch
    >>> batch = PackingCollate(row_tokens=6)([torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7, 8])])
    >>> batch["input_ids"].tolist(), batch["position_ids"].tolist()
    ([[1, 2, 3, 6, 7, 8], [4, 5, 0, 0, 0, 0]], [[0, 1, 2, 0, 1, 2], [0, 1, 0, 0, 0, 0]])
    >>> batch["cu_seqlens"].tolist(), batch["sample_index"].tolist(), batch["max_seqlen"]
    ([0, 3, 6, 8, 12], [0, 2, 1, -1], 4)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["PackingCollate"]


class PackingCollate:
    """A ``collate_fn`` that packs a micro-batch into rows of at most ``row_tokens`` tokens (see the module).

    Each sample is a 1-d tensor (or sequence) of token ids, or a mapping whose ``key`` (``"input_ids"``) holds them;
    the mapping's other values with as many entries are packed alike, the rest dropped.  ``pad_id`` pads
    ``input_ids`` and other keys, ``label_pad_id`` pads ``labels``.  A sample longer than ``row_tokens`` is a
    ``ValueError`` (give the :class:`~shardplug.core.sharding.token_budget.TokenBudgetBatchSampler` a
    ``max_tokens`` no larger than ``row_tokens``, or pass a larger ``row_tokens``).
    """

    def __init__(self, row_tokens: int, *, key: str = "input_ids", pad_id: int = 0, label_pad_id: int = -100) -> None:
        if isinstance(row_tokens, bool) or not isinstance(row_tokens, int) or row_tokens < 1:
            raise ValueError(f"row_tokens={row_tokens!r} must be an integer >= 1 (the tokens a packed row holds)")
        self.row_tokens = row_tokens
        self.key = key
        self.pad_id = pad_id
        self.label_pad_id = label_pad_id

    def __call__(self, samples: Sequence[Any]) -> dict[str, Any]:
        fields = [self._fields(sample) for sample in samples]
        lengths = [int(f[self.key].numel()) for f in fields]
        for index, length in enumerate(lengths):
            if length > self.row_tokens:
                raise ValueError(
                    f"sample {index} of the micro-batch has {length} tokens, more than row_tokens={self.row_tokens}: "
                    "no row can hold it; pass row_tokens >= the sampler's max_tokens"
                )
        rows = self._rows(lengths)
        width = max((sum(lengths[i] for i in row) for row in rows), default=0)
        names = [name for name in fields[0] if all(name in f for f in fields)] if fields else [self.key]
        out: dict[str, Any] = {}
        for name in names:
            pad = self.label_pad_id if name == "labels" else self.pad_id
            dtype = fields[0][name].dtype if fields else torch.long
            out[name] = torch.full((len(rows), width), pad, dtype=dtype)
        out["position_ids"] = torch.zeros((len(rows), width), dtype=torch.long)
        out["document_ids"] = torch.full((len(rows), width), -1, dtype=torch.long)
        bounds, owners = [0], []
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                length = lengths[i]
                for name in names:
                    out[name][r, at : at + length] = fields[i][name]
                out["position_ids"][r, at : at + length] = torch.arange(length)
                out["document_ids"][r, at : at + length] = i
                at += length
                bounds.append(bounds[-1] + length)
                owners.append(i)
            if at < width:  # the row's padding: a sequence of its own
                bounds.append(bounds[-1] + width - at)
                owners.append(-1)
        out["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
        out["max_seqlen"] = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
        out["sample_index"] = torch.tensor(owners, dtype=torch.long)
        return out

    def _fields(self, sample: Any) -> dict[str, torch.Tensor]:
        """A sample's per-token values, each a 1-d tensor of its ``key``'s length."""
        if not isinstance(sample, Mapping):
            return {self.key: torch.as_tensor(sample).reshape(-1)}
        if self.key not in sample:
            raise KeyError(f"a sample has no {self.key!r} (its keys: {sorted(sample)}); pass key=... naming its tokens")
        tokens = torch.as_tensor(sample[self.key]).reshape(-1)
        fields = {self.key: tokens}
        for name, value in sample.items():
            if name == self.key or isinstance(value, (str, bytes)):
                continue
            try:
                tensor = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError):
                continue
            if tensor.dim() == 1 and tensor.numel() == tokens.numel():
                fields[name] = tensor
        return fields

    def _rows(self, lengths: list[int]) -> list[list[int]]:
        """The samples of each row: longest first, each in the first row with room (first-fit decreasing)."""
        rows: list[list[int]] = []
        room: list[int] = []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            for r, free in enumerate(room):
                if lengths[i] <= free:
                    rows[r].append(i)
                    room[r] -= lengths[i]
                    break
            else:
                rows.append([i])
                room.append(self.row_tokens - lengths[i])
        return rows
