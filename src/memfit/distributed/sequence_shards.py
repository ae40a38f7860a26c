"""The split of a collated batch into context-parallel shards: each rank's contiguous piece of every row.

Exact by construction, so N ranks on the shards train as one process on the whole rows:

- The targets are taken BEFORE the split: a shard's `labels` are one position longer than its
  `input_ids` and hold, from index 1 on, the next token of the whole row for each of its positions
  (memfit.techniques.loss.next_token_targets reads them), so the last token of a shard is
  predicted from the first token of the next one, not dropped.
- `position_ids` run on across the shards (RoPE sees each token at its place in the whole row);
  packed rows keep their restarts at 0, and every padding position is 0, a one-token document
  of its own (as memfit.data.collate pads packed rows), so positions alone say which tokens may
  attend which (memfit.distributed.ulysses builds the mask from them).
- Rows are padded to a multiple of the shard count; padding carries no target.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def padded_length(length: int, shards: int) -> int:
    """`length` rounded up to a multiple of `shards` (every shard the same size, as the all-to-all needs)."""
    return -(-length // shards) * shards


def whole_row_positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each position's index in its document: the packed rows' own, else 0, 1, 2, ...; padding 0."""
    if "position_ids" in batch:
        return batch["position_ids"]
    rows, length = batch["input_ids"].shape
    positions = torch.arange(length, dtype=torch.long).expand(rows, length).clone()
    mask = batch.get("attention_mask")
    if mask is not None:
        positions[mask == 0] = 0  # padding: a document of its own, attended by nothing real
    return positions


def shift_targets(labels: torch.Tensor) -> torch.Tensor:
    """Labels one longer, as a shard carries them: index t + 1 holds the target of position t (the next token)."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)


def shard_batch(batch: dict[str, torch.Tensor], rank: int, shards: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard (of `shards`) of a collated batch: {input_ids, labels, position_ids}, see the module doc.

    The attention mask is left out: the positions carry it (padding and document starts).
    """
    if not 0 <= rank < shards:
        raise ValueError(f"shard {rank} is not within {shards} shards")
    input_ids = batch["input_ids"]
    length = input_ids.size(1)
    extra = padded_length(length, shards) - length
    positions = whole_row_positions(batch)
    labels = batch["labels"]
    if extra:
        input_ids = torch.nn.functional.pad(input_ids, (0, extra), value=0)
        positions = torch.nn.functional.pad(positions, (0, extra), value=0)
        labels = torch.nn.functional.pad(labels, (0, extra), value=IGNORE_INDEX)
    targets = shift_targets(labels)  # before the split: the shard edge keeps its next token
    size = input_ids.size(1) // shards
    start, end = rank * size, (rank + 1) * size
    shard = {
        "input_ids": input_ids[:, start:end].contiguous(),
        "labels": targets[:, start : end + 1].contiguous(),
        "position_ids": positions[:, start:end].contiguous(),
    }
    for name, value in batch.items():  # what else the task reads of the batch stays whole
        if name not in shard and name != "attention_mask":
            shard[name] = value
    return shard


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Per position, which document of its row it belongs to: a new one starts wherever the position is 0."""
    return torch.cumsum((positions == 0).long(), dim=-1)


def shard_layout(input_ids: torch.Tensor, labels: torch.Tensor, shards: int) -> list[dict[str, int]]:
    """How one row splits over `shards` context ranks, as `shard_batch` splits it (what `memfit data` shows).

    Per rank: its first and last token index in the padded row, the position its first token carries, and the
    targets it scores (the last token of a shard counts the next shard's first token as its target).
    """
    batch = {"input_ids": input_ids.reshape(1, -1), "labels": labels.reshape(1, -1)}
    layout = []
    for rank in range(shards):
        shard = shard_batch(batch, rank, shards)
        size = shard["input_ids"].size(1)
        layout.append({"rank": rank, "first": rank * size, "last": (rank + 1) * size - 1,
                       "first_position": int(shard["position_ids"][0, 0]),
                       "targets": int((shard["labels"][0, 1:] != IGNORE_INDEX).sum())})
    return layout
