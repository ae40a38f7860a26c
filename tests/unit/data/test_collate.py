"""Collate: right padding that never counts in the loss; any micro-batch split gives the same targets."""

from __future__ import annotations

import torch

from memfit.data.collate import collate, target_token_count


def sample(ids, context=0):
    input_ids = torch.tensor(ids, dtype=torch.long)
    labels = input_ids.clone()
    labels[:context] = -100
    return {"input_ids": input_ids, "labels": labels}


def test_right_padding_is_masked_in_labels_and_attention():
    batch = collate([sample([5, 6, 7]), sample([8], context=0), sample([1, 2, 3, 4, 5], context=2)], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [1, 2, 3, 4, 5]]
    assert batch["labels"].tolist() == [[5, 6, 7, -100, -100], [8, -100, -100, -100, -100], [-100, -100, 3, 4, 5]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_pad_to_multiple_of_rounds_the_length_up():
    batch = collate([sample([1, 2, 3])], pad_token_id=9, pad_to_multiple_of=8)
    assert batch["input_ids"].shape == (1, 8)
    assert batch["input_ids"][0, 3:].tolist() == [9] * 5
    assert collate([sample([1] * 8)], None, pad_to_multiple_of=8)["input_ids"].shape == (1, 8)


def test_micro_batch_splits_keep_the_same_target_tokens():
    samples = [sample(list(range(n)), context=c) for n, c in [(7, 0), (3, 0), (9, 4), (2, 0), (5, 1)]]
    whole = collate(samples, pad_token_id=0)
    whole_targets = int((whole["labels"][:, 1:] != -100).sum())
    assert whole_targets == target_token_count(samples) == 6 + 2 + 5 + 1 + 4
    for size in (1, 2, 3):
        parts = [collate(samples[i : i + size], pad_token_id=0) for i in range(0, len(samples), size)]
        assert sum(int((p["labels"][:, 1:] != -100).sum()) for p in parts) == whole_targets
