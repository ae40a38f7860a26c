"""The sequences of one micro-batch packed into as few rows as its longest sequence allows, and back.

A preference micro-batch is two sequences a pair (prompt + chosen, prompt + rejected) and an RL micro-batch is
one sequence a completion (prompt + completion); padded to the longest, a batch of mixed lengths spends much of
its activations on padding. Packed, the sequences are placed by best-fit decreasing (data/packing.py) into rows as
wide as the longest of them, end to end, with:

- `position_ids` restarting at 0 at each sequence, so each token has the position and the context it has in a row
  of its own, and the attention kernel keeps it within its sequence (techniques/packed_attention.py: transformers
  reads the boundaries from the positions; the model gets no attention mask). Padding after the last sequence of
  a short row takes positions 0, 0, ...: a one-token sequence of its own, carrying no target;
- each sequence's first label set to -100: position t predicts label t + 1, so the last token of one sequence
  never predicts the first of the next. A sequence's first label is never a target in a row of its own either.

`PackedRows.unpack` lays any per-token value computed on the packed rows (`[rows, width]`, such as the per-token
log-probabilities of techniques/sequence_logprobs.py) back out one sequence a row, `[sequences, longest]`, at the
positions each sequence has in a row of its own; beyond a sequence's end it holds `fill`. Gradients flow through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from memfit.data.packing import best_fit_decreasing
from memfit.data.windows import IGNORE_INDEX


@dataclass
class PackedRows:
    """Sequences packed into rows, and where each one went."""

    input_ids: torch.Tensor
    """`[rows, width]` the sequences' tokens end to end; padding after the last one takes `pad_token_id`."""
    labels: torch.Tensor
    """`[rows, width]` the sequences' labels, each sequence's first label and padding IGNORE_INDEX."""
    position_ids: torch.Tensor
    """`[rows, width]` positions restarting at 0 at each sequence (and at each padding token)."""
    row_of: torch.Tensor
    """`[sequences]` the packed row each sequence went to, in the order the sequences were given."""
    start_of: torch.Tensor
    """`[sequences]` where in its row each sequence starts."""
    length_of: torch.Tensor
    """`[sequences]` each sequence's length."""

    @property
    def sequences(self) -> int:
        return int(self.length_of.numel())

    @property
    def padding_tokens(self) -> int:
        """Tokens of the packed rows that belong to no sequence."""
        return int(self.input_ids.numel() - int(self.length_of.sum()))

    def unpack(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """`[rows, width, ...]` values of the packed rows as `[sequences, longest, ...]`, one sequence a row.

        Entry `[i, t]` is the packed value at sequence i's token t; positions past a sequence's end hold `fill`.
        """
        longest = int(self.length_of.max()) if self.sequences else 0
        offsets = torch.arange(longest, device=values.device)
        inside = offsets.unsqueeze(0) < self.length_of.to(values.device).unsqueeze(1)
        columns = (self.start_of.to(values.device).unsqueeze(1) + offsets.unsqueeze(0)).clamp(max=values.shape[1] - 1)
        rows = self.row_of.to(values.device).unsqueeze(1).expand_as(columns)
        gathered = values[rows, columns]
        mask = inside.reshape(*inside.shape, *([1] * (gathered.dim() - 2)))
        return torch.where(mask, gathered, torch.full_like(gathered, fill))

    def repack(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """`[sequences, longest]` values, one sequence a row, laid out as the packed rows `[rows, width]` (what
        `unpack` undoes); positions of no sequence hold `fill`."""
        offsets = torch.arange(values.shape[1], device=values.device)
        inside = offsets.unsqueeze(0) < self.length_of.to(values.device).unsqueeze(1)
        columns = self.start_of.to(values.device).unsqueeze(1) + offsets.unsqueeze(0)
        rows = self.row_of.to(values.device).unsqueeze(1).expand_as(columns)
        packed = torch.full(self.input_ids.shape, fill, dtype=values.dtype, device=values.device)
        packed[rows[inside], columns[inside]] = values[inside]
        return packed


def pack_sequences(input_ids: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], pad_token_id: int | None,
                   width: int | None = None) -> PackedRows:
    """`input_ids[i]`, `labels[i]` (1-D, equal lengths) packed into rows of `width` tokens (default: the longest).

    The placement is a function of the lengths only (best-fit decreasing), so every rank and every rerun packs
    a micro-batch the same way.
    """
    if not input_ids:
        raise ValueError("pack_sequences needs at least one sequence")
    lengths = np.asarray([len(ids) for ids in input_ids], dtype=np.int64)
    width = int(lengths.max()) if width is None else int(width)
    bins = best_fit_decreasing(lengths, width)
    pad = 0 if pad_token_id is None else int(pad_token_id)
    packed_ids = torch.full((len(bins), width), pad, dtype=torch.long)
    packed_labels = torch.full((len(bins), width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(bins), width), dtype=torch.long)
    row_of = torch.empty(len(lengths), dtype=torch.long)
    start_of = torch.empty(len(lengths), dtype=torch.long)
    for row, members in enumerate(bins):
        start = 0
        for index in members.tolist():
            size = int(lengths[index])
            packed_ids[row, start:start + size] = input_ids[index]
            packed_labels[row, start:start + size] = labels[index]
            packed_labels[row, start] = IGNORE_INDEX
            positions[row, start:start + size] = torch.arange(size)
            row_of[index], start_of[index] = row, start
            start += size
    return PackedRows(packed_ids, packed_labels, positions, row_of, start_of, torch.as_tensor(lengths))


def pack_padded_rows(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
                     pad_token_id: int | None) -> PackedRows:
    """A right-padded `[sequences, length]` batch (attention_mask 1 on real tokens) packed (`pack_sequences`)."""
    lengths = (attention_mask.sum(-1) if attention_mask is not None
               else torch.full((input_ids.shape[0],), input_ids.shape[1])).tolist()
    return pack_sequences([ids[:n] for ids, n in zip(input_ids, lengths, strict=True)],
                          [row[:n] for row, n in zip(labels, lengths, strict=True)], pad_token_id)
