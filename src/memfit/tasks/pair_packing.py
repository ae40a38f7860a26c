"""--packing samples for preference tasks: a micro-batch's sequences packed into rows without padding, each attending
only to itself.

Padded, a micro-batch of pairs is `2 x pairs` rows as wide as its longest sequence (prompt + chosen, prompt +
rejected; KTO: prompt + completion, prompt + mismatched completion): with mixed lengths much of it is padding, which
every layer computes and keeps. Packed (data/micro_batch_packing.py), the same sequences lie end to end in as few rows
of that width as best-fit decreasing finds, positions restarting at 0 at each sequence and no attention mask, so
transformers keeps attention within each sequence from the positions (techniques/packed_attention.py) and every token
has the context and position it has in a row of its own.

The log-probabilities are computed on the packed rows and laid back out in the two-row layout's order (`two_rows`):
`[2 x pairs, longest]` per-token values, every first row then every second, exactly as one forward over the padded
rows gives them, so the objectives, their metrics and the reference read what they read padded. The collate
(`collate_packed_pairs`) computes on the host, once, where each sequence's token t lies in the packed rows (a flat
index) and which positions of the two-row layout hold a token: the loss reads those, never a device value, so
packing adds no wait for the device.

Where a pair's two sides must run apart (--pair-layout split: the chosen rows' forward, then the rejected rows';
KTO: the mismatched completions without a graph), the first sides and the second sides are packed separately, the
first side's rows first; one side's row never holds the other side's sequences. OOM recovery splits the list of
samples before the collate, so a pair's two sequences always meet in one micro-batch, whatever row each lands in.

Not packed: --pair-layout shared-prompt rows (their own 4D mask; a packed row takes none), models whose layers carry
state across positions or that do not build their masks from positions (packed_attention.stateful_layers,
positions_not_read): those run padded, and the log and the task's facts say why (`choose_pair_packing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from memfit.data.micro_batch_packing import PackedRows, pack_sequences
from memfit.techniques.loss import IGNORE_INDEX
from memfit.techniques.sequence_logprobs import SequenceLogprobs

PACKED = "samples"
PADDED = "off"

POSITIONS = "packed_position_ids"
"""Batch key of the packed rows' `[rows, width]` positions, restarting at 0 at each sequence. Not `position_ids`: the
loss hands them to the model itself, as it does the shared-prompt rows' (tasks/pair_layout.py POSITIONS)."""
INDEX = "packed_token_index"
"""Batch key of the `[sequences, longest]` flat index into the packed rows of each sequence's token t (two-row order)."""
INSIDE = "packed_token_inside"
"""Batch key of the `[sequences, longest]` booleans: True where the two-row layout holds a token, False on padding."""
FIRST_SIDE = "packed_first_side_rows"
"""Batch key (sides packed apart only) of an `[rows of the first sides]` tensor: its length is where the second
sides' rows begin, read from the shape so the loss never waits for the device."""


# -- the choice -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairPacking:
    """Whether a run's preference micro-batches are packed, and why."""

    mode: str
    """PACKED ('samples') or PADDED ('off')."""
    requested: str
    """What --packing asked: auto, samples or off."""
    reason: str

    @property
    def packed(self) -> bool:
        return self.mode == PACKED

    @property
    def fell_back(self) -> bool:
        """samples was asked for and the pairs run padded."""
        return self.requested == PACKED and not self.packed

    def facts(self) -> str:
        """The task facts' `packing` entry."""
        if self.packed:
            return (f"samples ({self.reason}): each micro-batch's sequences end to end in rows as wide as its longest,"
                    " attention within each sequence")
        return f"off ({self.reason}): rows padded to the longest of each micro-batch"

    def describe(self) -> str:
        return f"packing {self.facts()}"


AUTO_RULE = "auto: the model can pack, and the pairs run as rows of their own"
"""Why auto packs (docs/preference.md, "Packed pairs": never more positions, a mask no larger than padding's)."""


def choose_pair_packing(requested: str, model: torch.nn.Module | None, shared_prompt: bool) -> PairPacking:
    """The packing of a run's preference micro-batches (module docstring).

    `requested`: --packing (auto, samples, off; wrapped is refused before); `model`: the loaded model (None before
    it is known: nothing about it refuses yet); `shared_prompt`: the pair layout runs one shared-prompt row a pair.
    auto packs wherever samples would run: packed rows hold the padded rows' tokens less their padding, and under
    SDPA a block mask no larger than the padded rows' own padding mask (docs/preference.md, "Packed pairs").
    """
    if requested == PADDED:
        return PairPacking(PADDED, requested, "asked for")
    if shared_prompt:
        return PairPacking(PADDED, requested, "--pair-layout shared-prompt runs a pair as one row with its own 4D mask,"
                                              " which a packed row cannot take")
    why = _model_refusal(model)
    if why:
        return PairPacking(PADDED, requested, f"{why}, so attention would cross sequences")
    return PairPacking(PACKED, requested, "asked for" if requested == PACKED else AUTO_RULE)


def _model_refusal(model: torch.nn.Module | None) -> str:
    if model is None:
        return ""
    from memfit.techniques.packed_attention import positions_not_read, stateful_layers

    return stateful_layers(model) or positions_not_read(model)


# -- the rows ---------------------------------------------------------------------------------------------------------


def lengths_differ(rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the micro-batch's sequences differ in length: only then is there padding for packing to remove. Rows
    of one length run padded (no padding: the attention mask is dropped and SDPA takes its causal fast path), which
    packing would only match, with its positions and unpacking index beside."""
    return len({len(prompt) + len(completion) for prompt, completion in rows}) > 1


def collate_packed_pairs(rows: Sequence[tuple[torch.Tensor, torch.Tensor]], pad_token_id: int | None,
                         sides_apart: bool) -> dict[str, torch.Tensor]:
    """The two-row layout's rows (`rows`: (prompt, completion) each, every first row then every second) packed
    (module docstring): input_ids, labels (IGNORE_INDEX on the prompts and each sequence's first token), the positions
    (POSITIONS) and the unpacking keys INDEX, INSIDE (and FIRST_SIDE when `sides_apart`). No attention_mask."""
    if not rows:
        raise ValueError("collate needs at least one row")
    sequences = [torch.cat([prompt, completion]) for prompt, completion in rows]
    labels = [torch.cat([torch.full((len(prompt),), IGNORE_INDEX, dtype=torch.long), completion])
              for prompt, completion in rows]
    width = max(len(tokens) for tokens in sequences)
    if not sides_apart:
        packed = pack_sequences(sequences, labels, pad_token_id, width)
        return _batch(packed, None)
    half = len(rows) // 2
    first = pack_sequences(sequences[:half], labels[:half], pad_token_id, width)
    second = pack_sequences(sequences[half:], labels[half:], pad_token_id, width)
    return _batch(_joined(first, second), len(first.input_ids))


def _joined(first: PackedRows, second: PackedRows) -> PackedRows:
    """Two packings of one width as one: the second's rows after the first's."""
    offset = len(first.input_ids)
    return PackedRows(torch.cat([first.input_ids, second.input_ids]), torch.cat([first.labels, second.labels]),
                      torch.cat([first.position_ids, second.position_ids]),
                      torch.cat([first.row_of, second.row_of + offset]), torch.cat([first.start_of, second.start_of]),
                      torch.cat([first.length_of, second.length_of]))


def _batch(packed: PackedRows, first_side_rows: int | None) -> dict[str, torch.Tensor]:
    rows, width = packed.input_ids.shape
    flat = torch.arange(rows * width, dtype=torch.long).view(rows, width)
    index = packed.unpack(flat, fill=0)  # the shared unpacking, applied once to the token's own flat place
    inside = torch.arange(index.shape[1]).unsqueeze(0) < packed.length_of.unsqueeze(1)
    batch = {"input_ids": packed.input_ids, "labels": packed.labels, POSITIONS: packed.position_ids, INDEX: index,
             INSIDE: inside}
    if first_side_rows is not None:
        batch[FIRST_SIDE] = torch.arange(first_side_rows)
    return batch


@dataclass
class PackedPairs:
    """How a packed micro-batch's sequences lie in its rows (the collate's INDEX, INSIDE, FIRST_SIDE)."""

    position_ids: torch.Tensor
    """`[rows, width]` the packed rows' positions, restarting at 0 at each sequence."""
    index: torch.Tensor
    """`[sequences, longest]` flat index into the packed rows of each sequence's token t."""
    inside: torch.Tensor
    """`[sequences, longest]` True where the sequence has a token t."""
    width: int
    """Tokens a packed row."""
    first_side_rows: int | None
    """Rows of the first sides when the sides were packed apart, else None."""

    @classmethod
    def taken_from(cls, inputs: dict[str, Any]) -> PackedPairs | None:
        """The packing popped out of a loss function's keyword inputs; None for padded rows."""
        positions, index, inside = inputs.pop(POSITIONS, None), inputs.pop(INDEX, None), inputs.pop(INSIDE, None)
        first_side = inputs.pop(FIRST_SIDE, None)
        if positions is None:
            return None
        return cls(positions, index, inside, int(positions.shape[-1]),
                   None if first_side is None else int(first_side.shape[0]))

    @property
    def sequences(self) -> int:
        return int(self.index.shape[0])

    def unpacked(self, packed: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """`[rows, width]` values of the packed rows as `[sequences, longest]`, `fill` past each sequence's end."""
        gathered = packed.reshape(-1)[self.index]
        return gathered.masked_fill(~self.inside, fill)

    def two_rows(self, per_token: torch.Tensor, labels: torch.Tensor) -> SequenceLogprobs:
        """Per-token log-probabilities of the packed rows (position t: log p(labels[t + 1])) as the two-row layout
        has them: `[sequences]` sums and target counts and the `[sequences, longest]` values. A sequence's last
        token predicts the next sequence's first label, which the packing left IGNORE_INDEX: 0, as in its own row."""
        values = self.unpacked(per_token, 0.0)
        targets = F.pad(self.unpacked(labels, IGNORE_INDEX)[:, 1:], (0, 1), value=IGNORE_INDEX)
        return SequenceLogprobs(values.sum(-1), (targets != IGNORE_INDEX).sum(-1, dtype=torch.float32), values)

    def side(self, second: bool) -> PackedPairs:
        """The first sides' (or the second sides') packing on their own rows (sides packed apart only)."""
        if self.first_side_rows is None:
            raise ValueError("the sides of this micro-batch were packed together")
        half, rows = self.sequences // 2, self.side_rows(second)
        if not second:
            return PackedPairs(self.position_ids[rows], self.index[:half], self.inside[:half], self.width, None)
        offset = self.first_side_rows * self.width
        return PackedPairs(self.position_ids[rows], (self.index[half:] - offset).clamp(min=0), self.inside[half:],
                           self.width, None)

    def side_rows(self, second: bool) -> slice:
        """The packed rows of the first sides (or the second sides), sides packed apart only."""
        if self.first_side_rows is None:
            raise ValueError("the sides of this micro-batch were packed together")
        return slice(self.first_side_rows, None) if second else slice(0, self.first_side_rows)


    def every_token_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Labels of the packed rows that score every real token a sequence predicts (ORPO's NLL): not a sequence's
        first token (the sequence before it must not predict it) nor the padding, which both have position 0."""
        return input_ids.masked_fill(self.position_ids == 0, IGNORE_INDEX)
