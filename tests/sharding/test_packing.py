"""PackingCollate: a micro-batch as rows of at most row_tokens tokens, no sample split or dropped, nothing kept
between calls; its boundaries (document ids, position ids, cu_seqlens) give a small attention on the packed rows
the same output as on each sample alone (CPU, PyTorch's scaled_dot_product_attention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplug import PackingCollate


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 16), min_size=0, max_size=20), extra=st.integers(0, 10))
def test_rows_hold_every_sample_once_whole_within_row_tokens(lengths: list[int], extra: int) -> None:
    row_tokens = max(lengths, default=1) + extra
    samples = [torch.arange(100 * i + 1, 100 * i + 1 + n) for i, n in enumerate(lengths)]
    collate = PackingCollate(row_tokens)
    batch = collate(samples)
    assert batch["input_ids"].shape[1] <= row_tokens
    bounds = batch["cu_seqlens"].tolist()
    flat = batch["input_ids"].reshape(-1)
    assert bounds[-1] == flat.numel()
    pieces = {int(i): flat[a:b].tolist() for a, b, i in zip(bounds, bounds[1:], batch["sample_index"]) if i >= 0}
    assert pieces == {i: sample.tolist() for i, sample in enumerate(samples)}
    assert collate(samples)["input_ids"].tolist() == batch["input_ids"].tolist()  # nothing kept between calls


class TinyAttention(torch.nn.Module):
    """One causal attention head over token and position embeddings."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = torch.nn.Embedding(64, 16)
        self.positions = torch.nn.Embedding(32, 16)
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions(positions)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _alone(model: TinyAttention, sample: torch.Tensor) -> torch.Tensor:
    n = sample.numel()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return model(sample[None], torch.arange(n)[None], causal[None])[0]


@pytest.mark.parametrize("row_tokens", [12, 20, 64])
def test_varlen_attention_on_packed_rows_equals_each_sample_alone(row_tokens: int) -> None:
    generator = torch.Generator().manual_seed(1)
    samples = [
        torch.randint(0, 64, (int(n),), generator=generator) for n in torch.randint(1, 13, (9,), generator=generator)
    ]
    batch = PackingCollate(row_tokens, pad_id=0)(samples)
    model = TinyAttention()
    with torch.no_grad():
        docs = batch["document_ids"]
        width = docs.shape[1]
        mask = (docs[:, :, None] == docs[:, None, :]) & torch.ones(width, width, dtype=torch.bool).tril()
        mask |= torch.eye(width, dtype=torch.bool)  # padding attends to itself only (its rows are not read)
        packed = model(batch["input_ids"], batch["position_ids"], mask)
        flat_out = packed.reshape(-1, packed.shape[-1])
        flat_ids = batch["input_ids"].reshape(-1)
        flat_positions = batch["position_ids"].reshape(-1)
        bounds = batch["cu_seqlens"].tolist()
        for a, b, owner in zip(bounds, bounds[1:], batch["sample_index"].tolist()):
            if owner < 0:
                continue
            expected = _alone(model, samples[owner])
            torch.testing.assert_close(flat_out[a:b], expected)  # the document mask
            n = b - a  # the varlen form: each cu_seqlens sequence attended alone
            causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
            varlen = model(flat_ids[a:b][None], flat_positions[a:b][None], causal)[0]
            torch.testing.assert_close(varlen, expected)


def test_dict_samples_pack_labels_and_refuse_a_sample_longer_than_a_row() -> None:
    samples = [{"input_ids": [5, 6, 7], "labels": [6, 7, 8], "name": "a"}, {"input_ids": [9], "labels": [1]}]
    batch = PackingCollate(3)(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch["labels"].tolist() == [[6, 7, 8], [1, -100, -100]]
    with pytest.raises(ValueError, match="sample 0 of the micro-batch has 3 tokens, more than row_tokens=2"):
        PackingCollate(2)(samples)
