"""Packing that never crosses a sample: several samples share a window, each sees only itself.

Samples (of any dataset with a `lengths` array and dict items {"input_ids", "labels"}) are
placed into windows of `seq_len` tokens by best-fit decreasing: the longest sample first,
each into the window whose free space it fills most tightly, a new window when none has
room. The placement is a function of the lengths only, so every run, rank and resume
sees the same rows.

A packed row is its samples laid end to end, with:

- `position_ids` restarting at 0 at each sample, so rotary/learned positions are those the
  sample has on its own, and the attention kernel finds the sample boundaries from them
  (transformers' `find_packed_sequence_indices`: a position that does not follow the one
  before it starts a new sample);
- the label of each sample's first token set to -100: the loss shifts labels by one, so
  without it the last token of one sample would be trained to predict the next sample's
  first token. A sample's own first label never carries loss anyway, so the target tokens
  are exactly those of the samples run one by one.

Modes (`--packing`): `samples` (this module), `off` (one sample per row, padded by collate),
`wrapped` (plain text only: documents concatenated and cut, attention crosses documents).
`auto` picks `samples` for supervised formats and `wrapped` for plain text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from memfit.config import PACKING_MODES
from memfit.data.windows import IGNORE_INDEX
from memfit.errors import UsageError


def best_fit_decreasing(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[np.ndarray]:
    """Bins of sample indices, each summing to at most `capacity` tokens (best-fit decreasing).

    Samples are taken longest first (ties by index); each goes into the open bin with the
    least free space that still holds it, else into a new bin. A bin's samples are in the
    order they were placed. Deterministic: a function of `lengths` and `capacity` only.
    O(n log capacity): a segment tree over free-space values finds the tightest bin.

    Raises:
        UsageError: a sample longer than `capacity`, or not at least one token long.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if capacity < 1:
        raise UsageError(f"--seq-len must be at least 1 to pack samples, got {capacity}")
    if len(lengths) and (int(lengths.max()) > capacity or int(lengths.min()) < 1):
        bad = int(np.argmax(lengths > capacity)) if int(lengths.max()) > capacity else int(np.argmin(lengths))
        raise UsageError(
            f"sample {bad} has {int(lengths[bad])} tokens and cannot be packed into windows of --seq-len {capacity};"
            " drop or cut long samples first (--truncate), or raise --seq-len"
        )
    order = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, then by index
    # Free space -> stack of open bins with exactly that much room; `tree` marks non-empty stacks.
    by_free: dict[int, list[int]] = {}
    size = 1
    while size < capacity + 1:
        size *= 2
    tree = np.zeros(2 * size, dtype=bool)

    def mark(free: int, present: bool) -> None:
        node = free + size
        tree[node] = present
        node //= 2
        while node:
            tree[node] = tree[2 * node] or tree[2 * node + 1]
            node //= 2

    def tightest(at_least: int) -> int:
        """The smallest free space >= at_least held by an open bin, or -1."""
        node, low, high = 1, 0, size - 1
        return _first_marked(tree, node, low, high, at_least)

    bins: list[list[int]] = []
    free_of: list[int] = []
    for index in order.tolist():
        length = int(lengths[index])
        free = tightest(length)
        if free < 0:
            bins.append([index])
            free_of.append(capacity - length)
            target = len(bins) - 1
        else:
            stack = by_free[free]
            target = stack.pop()
            if not stack:
                mark(free, False)
            bins[target].append(index)
            free_of[target] = free - length
        left = free_of[target]
        if left > 0:
            stack = by_free.setdefault(left, [])
            if not stack:
                mark(left, True)
            stack.append(target)
    return [np.asarray(b, dtype=np.int64) for b in bins]


def _first_marked(tree: np.ndarray, node: int, low: int, high: int, at_least: int) -> int:
    """Leftmost marked leaf >= at_least in the subtree of `node`, covering [low, high]; -1 if none."""
    if high < at_least or not tree[node]:
        return -1
    if low == high:
        return low
    middle = (low + high) // 2
    found = _first_marked(tree, 2 * node, low, middle, at_least)
    return found if found >= 0 else _first_marked(tree, 2 * node + 1, middle + 1, high, at_least)


def packing_efficiency(lengths: Sequence[int] | np.ndarray, capacity: int, num_rows: int | None = None) -> float:
    """Share of the packed windows' positions that hold a token (1.0: no padding at all).

    `num_rows` defaults to the rows best-fit decreasing makes of `lengths`.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(lengths):
        return 0.0
    rows = len(best_fit_decreasing(lengths, capacity)) if num_rows is None else num_rows
    return float(lengths.sum()) / (rows * capacity)


def pack_sample_dicts(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One packed row of `samples`: tokens and labels end to end, positions restarting at each sample.

    The first label of every sample is -100 (see the module docstring).
    """
    input_ids = torch.cat([sample["input_ids"] for sample in samples])
    labels = []
    for sample in samples:
        own = sample["labels"].clone()
        own[:1] = IGNORE_INDEX
        labels.append(own)
    position_ids = torch.cat([torch.arange(len(sample["input_ids"]), dtype=torch.long) for sample in samples])
    return {"input_ids": input_ids, "labels": torch.cat(labels), "position_ids": position_ids}


def resolve_packing(requested: str | bool, supervised: bool) -> str:
    """The mode that runs: `auto` is `samples` for supervised formats and `wrapped` for plain text.

    A bool is the old setting (True: pack as the data allows, i.e. `auto`; False: `off`).
    Raises UsageError for `wrapped` on a supervised format, whose samples must stay whole.
    """
    if isinstance(requested, bool):
        requested = "auto" if requested else "off"
    if requested not in PACKING_MODES:
        raise UsageError(f"--packing must be one of {', '.join(PACKING_MODES)}; got {requested!r}")
    if requested == "auto":
        return "samples" if supervised else "wrapped"
    if requested == "wrapped" and supervised:
        raise UsageError(
            "--packing wrapped concatenates plain text across documents and would cut conversations and their masks;"
            " use --packing samples (the default) or off"
        )
    return requested


class PackedDataset(torch.utils.data.Dataset):
    """Rows of whole samples packed by best-fit decreasing into windows of `seq_len` tokens.

    `dataset[i]` is {"input_ids", "labels", "position_ids"}, 1-D LongTensors of at most
    `seq_len` tokens (see the module docstring). Works over any dataset with a `lengths`
    array and dict items; rows are built on access, so it costs a few bytes a sample.

    Args:
        samples: the dataset of whole samples (its `lengths[i]` is the length of `samples[i]`).
        seq_len: window size.
        min_rows: the fewest rows a run can use (one effective batch).

    Raises:
        UsageError: a sample longer than `seq_len`, or fewer rows than `min_rows`.
    """

    packing = "samples"

    def __init__(self, samples: Any, seq_len: int, min_rows: int = 1):
        self.samples = samples
        self.seq_len = seq_len
        self.sample_lengths = np.asarray(samples.lengths, dtype=np.int64)
        self.rows = best_fit_decreasing(self.sample_lengths, seq_len)
        if len(self.rows) < min_rows:
            raise UsageError(
                f"the {len(self.sample_lengths):,} samples pack into {len(self.rows)} windows of {seq_len} tokens, fewer"
                f" than one effective batch ({min_rows}); lower --batch-size/--gradient-accumulation-steps or"
                " --seq-len, use --packing off, or add data"
            )
        self.lengths = np.asarray([int(self.sample_lengths[row].sum()) for row in self.rows], dtype=np.int64)
        self.attention_restriction = "not set: the model's attention kernel names it"
        """How attention is kept within each sample; set once the model is loaded (techniques.packed_attention)."""

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} is out of range for {len(self)} packed rows")
        return pack_sample_dicts([self.samples[int(i)] for i in self.rows[int(index)]])

    def __getattr__(self, name: str) -> Any:
        # Everything else (source, counts of dropped samples, from_cache, ...) is the samples' own.
        if name in ("samples", "__setstate__") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.samples, name)

    @property
    def efficiency(self) -> float:
        """Share of the windows' positions that hold a token."""
        return packing_efficiency(self.sample_lengths, self.seq_len, len(self.rows))

    @property
    def num_samples(self) -> int:
        return len(self.sample_lengths)

    @property
    def num_target_tokens(self) -> int:
        """Tokens that carry a loss over one pass: the samples' own (no sample predicts another's)."""
        inner = getattr(self.samples, "num_target_tokens", None)
        return int(inner) if inner is not None else sum(
            int((self.samples[i]["labels"][1:] != IGNORE_INDEX).sum()) for i in range(len(self.sample_lengths))
        )

    def facts(self) -> dict[str, Any]:
        """What the metrics and the summary record about packing."""
        return {
            "mode": "samples",
            "samples": self.num_samples,
            "rows": len(self.rows),
            "efficiency": round(self.efficiency, 4),
            "attention_restriction": self.attention_restriction,
        }

    @property
    def description(self) -> str:
        inner = getattr(self.samples, "description", f"{self.num_samples:,} samples")
        return (
            f"{inner}; packed (--packing samples): {self.num_samples:,} samples in {len(self.rows):,} windows of"
            f" {self.seq_len}, {self.efficiency:.1%} of positions used; attention and positions restart at each"
            f" sample ({self.attention_restriction})"
        )
