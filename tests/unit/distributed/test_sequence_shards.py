"""The context-parallel split of a batch, without torchrun: the shards put together are the whole row."""

from __future__ import annotations

import torch

from memfit.data.collate import collate
from memfit.distributed.sequence_shards import IGNORE_INDEX, document_ids, shard_batch
from memfit.distributed.ulysses import whole_row_mask
from memfit.techniques.loss import next_token_targets


def _row(length: int) -> dict:
    tokens = torch.arange(100, 100 + length)
    return {"input_ids": tokens, "labels": tokens.clone()}


def _whole(batch: dict, shards: int) -> dict:
    parts = [shard_batch(batch, rank, shards) for rank in range(shards)]
    targets = torch.cat([next_token_targets(p["labels"], p["input_ids"].size(1)) for p in parts], dim=1)
    return {"input_ids": torch.cat([p["input_ids"] for p in parts], dim=1), "targets": targets,
            "position_ids": torch.cat([p["position_ids"] for p in parts], dim=1)}


def test_targets_are_shifted_before_the_split_so_shard_edges_keep_their_next_token():
    batch = collate([_row(8)], pad_token_id=0)
    whole = _whole(batch, 2)
    assert whole["targets"][0, :7].tolist() == list(range(101, 108))  # position 3 (shard 0's last) predicts 104
    assert whole["targets"][0, 7].item() == IGNORE_INDEX
    assert shard_batch(batch, 0, 2)["labels"].shape == (1, 5)  # one longer than its 4 inputs


def test_positions_continue_across_shards_and_rows_pad_to_a_multiple_of_the_shards():
    batch = collate([_row(7), _row(5)], pad_token_id=0)
    parts = [shard_batch(batch, rank, 4) for rank in range(4)]
    assert all(p["input_ids"].shape == (2, 2) for p in parts)
    whole = _whole(batch, 4)
    assert whole["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0]
    assert whole["position_ids"][1].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]  # padding: documents of their own
    assert (whole["targets"][1, 4:] == IGNORE_INDEX).all()  # padding carries no loss
    assert whole["targets"][1, :4].tolist() == [101, 102, 103, 104]


def test_packed_rows_keep_their_document_starts_across_shards():
    packed = {"input_ids": torch.arange(6), "labels": torch.arange(6), "position_ids": torch.tensor([0, 1, 2, 0, 1, 2])}
    whole = _whole(collate([packed], pad_token_id=0), 2)
    assert whole["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2]
    assert document_ids(whole["position_ids"])[0].tolist() == [1, 1, 1, 2, 2, 2]
    mask = whole_row_mask(whole["position_ids"])[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False]  # the second document sees only itself
    assert whole_row_mask(torch.arange(6)[None]) is None  # one document: plain causal


def test_a_2x_shard_mistake_changes_the_targets():
    """Shifting each shard's labels on its own (after the split) loses the edge target: the check above would fail."""
    batch = collate([_row(8)], pad_token_id=0)
    naive = shard_batch(batch, 0, 2)["labels"][:, :4]  # labels cut to the shard, then shifted in the loss
    assert next_token_targets(naive, 4)[0, 3].item() == IGNORE_INDEX != _whole(batch, 2)["targets"][0, 3].item()
