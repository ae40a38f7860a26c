"""Stack samples into a batch: right padding that never counts in the loss.

Samples are independent of one another, so a caller may split an effective batch into
micro-batches of any size and collate each one separately: the tokens, labels and
target tokens are the same as for the whole batch, only the padding differs, and
padding carries no loss and is masked out of attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memfit.data.windows import IGNORE_INDEX


def collate(
    samples: Sequence[dict[str, torch.Tensor]],
    pad_token_id: int | None,
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Batch of samples as {input_ids, labels, attention_mask}, LongTensors of shape [batch, length].

    `length` is the longest sample, rounded up to `pad_to_multiple_of` when given (fewer
    distinct shapes help compiled kernels). Padding sits on the right: input_ids take
    `pad_token_id` (0 when the tokenizer has none), labels -100, attention_mask 0.
    Packed rows (samples with `position_ids`, memfit.data.packing) keep them, padded with 0:
    each pad position then reads as a one-token sample of its own, so the positions alone
    keep attention within samples and away from padding.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    length = max(len(sample["input_ids"]) for sample in samples)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    pad = 0 if pad_token_id is None else int(pad_token_id)
    batch = len(samples)
    input_ids = torch.full((batch, length), pad, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    packed = any("position_ids" in sample for sample in samples)
    position_ids = torch.zeros((batch, length), dtype=torch.long) if packed else None
    for row, sample in enumerate(samples):
        size = len(sample["input_ids"])
        input_ids[row, :size] = sample["input_ids"]
        labels[row, :size] = sample["labels"]
        attention_mask[row, :size] = 1
        if position_ids is not None:
            own = sample.get("position_ids")
            position_ids[row, :size] = own if own is not None else torch.arange(size)
    batch_dict = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    if position_ids is not None:
        batch_dict["position_ids"] = position_ids
    return batch_dict


def target_token_count(samples: Sequence[dict[str, torch.Tensor]]) -> int:
    """Tokens carrying a loss in these samples (labels are shifted by one in the loss).

    The loop divides each micro-batch's summed loss by this count for the whole
    effective batch, so that any micro-batch split gives the same update.
    """
    return sum(int((sample["labels"][1:] != IGNORE_INDEX).sum()) for sample in samples)
