"""The prefetcher hands out exactly the batch collate would make, prepared ahead when it can."""

from __future__ import annotations

import pytest
import torch

from memfit.data import collate
from memfit.data.prefetch import BatchPrefetcher


def _samples(count: int, length: int = 6) -> list[dict]:
    return [
        {"input_ids": torch.arange(length) + i, "labels": torch.arange(length) + i} for i in range(count)
    ]


class CountingCollate:
    def __init__(self):
        self.calls = 0

    def __call__(self, samples):
        self.calls += 1
        return collate(samples, pad_token_id=0)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def test_prepared_batch_is_handed_out_without_collating_again():
    samples = _samples(4)
    first, second = samples[:2], samples[2:]
    counting = CountingCollate()
    prefetcher = BatchPrefetcher(counting, torch.device("cpu"))
    assert _equal(prefetcher.take(first), collate(first, 0))
    prefetcher.prepare(second)
    assert counting.calls == 2
    batch = prefetcher.take(second)
    assert counting.calls == 2  # made by prepare, not again
    assert _equal(batch, collate(second, 0))
    assert (prefetcher.prefetched, prefetcher.collated_on_demand) == (1, 1)


def test_a_stale_batch_is_dropped_when_the_pieces_are_split_again():
    samples = _samples(4)
    prefetcher = BatchPrefetcher(CountingCollate(), torch.device("cpu"))
    prefetcher.prepare(samples[2:])
    # Out-of-memory recovery halved the piece: the prepared batch of two samples must not be used.
    batch = prefetcher.take(samples[2:3])
    assert _equal(batch, collate(samples[2:3], 0))
    assert prefetcher.prefetched == 0
    # And it is gone: taking the old piece now collates it afresh.
    prefetcher.take(samples[2:])
    assert prefetcher.collated_on_demand == 2


def test_same_values_in_a_copy_of_the_list_still_count_as_another_piece():
    samples = _samples(2)
    clones = [{k: v.clone() for k, v in s.items()} for s in samples]
    prefetcher = BatchPrefetcher(CountingCollate(), torch.device("cpu"))
    prefetcher.prepare(samples)
    prefetcher.take(clones)
    assert prefetcher.prefetched == 0


def test_a_mask_without_padding_is_dropped_on_the_host_when_asked():
    full = _samples(2)
    ragged = full[:1] + _samples(1, length=3)
    prefetcher = BatchPrefetcher(lambda s: collate(s, 0), torch.device("cpu"), drop_full_attention_mask=True)
    assert "attention_mask" not in prefetcher.take(full)
    prefetcher.prepare(ragged)
    assert prefetcher.take(ragged)["attention_mask"].tolist() == [[1] * 6, [1] * 3 + [0] * 3]
    assert "attention_mask" in BatchPrefetcher(lambda s: collate(s, 0), torch.device("cpu")).take(full)


@pytest.mark.gpu
def test_cuda_copy_is_pinned_and_on_a_side_stream():
    device = torch.device("cuda")
    samples = _samples(3, length=4096)
    prefetcher = BatchPrefetcher(CountingCollate(), device)
    assert prefetcher.pin and prefetcher.stream is not None
    prefetcher.prepare(samples)
    batch = prefetcher.take(samples)
    assert prefetcher.prefetched == 1
    assert all(t.device.type == "cuda" for t in batch.values())
    assert _equal(batch, collate(samples, 0))
