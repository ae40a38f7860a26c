"""Cut tokenized documents into training windows of at most `seq_len` tokens.

Two layouts:

- packing (the default): all documents, each ending with EOS, form one token stream
  that is cut into full windows of `seq_len`. No padding, no wasted compute.
- no packing: one document per sample; a short document is one short window (padded
  later by `collate`), a long one is cut like the packed stream.

A span longer than `seq_len` is cut into windows that share `stride` tokens with the
previous window. The shared tokens are context only: their labels are -100, so each
token is a training target exactly once while still being predicted with up to
`stride` tokens of history. The last window of a span is moved back so that it ends on
the span's end and stays full; what it shares with the window before it is context too.
(With stride 0 the first token of each later window has no history and is not a target.)

Windows are stored as three integer arrays, not copies of tokens, so millions of
windows cost a few bytes each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memfit.errors import UsageError

IGNORE_INDEX = -100


@dataclass
class Windows:
    """Window i covers tokens[starts[i] : starts[i] + lengths[i]]; its first contexts[i] tokens carry no label."""

    starts: np.ndarray
    lengths: np.ndarray
    contexts: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    def target_tokens(self) -> int:
        """Tokens that carry a loss over all windows (labels are shifted by one in the loss)."""
        return int(np.sum(self.lengths - np.maximum(self.contexts, 1)))


def split_spans(span_starts: np.ndarray, span_ends: np.ndarray, seq_len: int, stride: int) -> Windows:
    """Windows of every span [start, end): one window if it fits in seq_len, else overlapping full windows."""
    if seq_len < 1 or not 0 <= stride < seq_len:
        raise UsageError(f"--stride must be between 0 and --seq-len - 1 ({seq_len - 1}), got {stride}")
    span_starts = np.asarray(span_starts, dtype=np.int64)
    span_ends = np.asarray(span_ends, dtype=np.int64)
    sizes = span_ends - span_starts
    step = seq_len - stride
    # Windows per span: 1 if it fits, else the first one plus enough steps to reach the end.
    counts = np.where(sizes <= seq_len, 1, 1 + -(-(sizes - seq_len) // step))
    span_of = np.repeat(np.arange(len(sizes)), counts)
    first_window = np.cumsum(counts) - counts
    position = np.arange(len(span_of)) - first_window[span_of]  # window number within its span

    starts = span_starts[span_of] + position * step
    is_last = position == counts[span_of] - 1
    long_last = is_last & (counts[span_of] > 1)
    starts = np.where(long_last, span_ends[span_of] - seq_len, starts)
    lengths = np.minimum(sizes[span_of], seq_len)
    # Context = where the previous window ended minus where this one starts.
    previous_end = span_starts[span_of] + (position - 1) * step + seq_len
    contexts = np.where(position == 0, 0, previous_end - starts)
    return Windows(starts=starts, lengths=lengths.astype(np.int64), contexts=contexts.astype(np.int64))


def make_windows(doc_offsets: np.ndarray, seq_len: int, stride: int = 0, packing: bool = True) -> Windows:
    """Windows over tokenized documents (`doc_offsets` as in TokenStore: starts plus the end).

    Raises UsageError when packing and the whole dataset is shorter than one window.
    """
    doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
    total = int(doc_offsets[-1])
    if packing:
        if total < seq_len:
            raise UsageError(
                f"the dataset has {total:,} tokens, fewer than one window of --seq-len {seq_len}; lower --seq-len,"
                " give more text, or use --no-packing"
            )
        return split_spans(np.array([0]), np.array([total]), seq_len, stride)
    return split_spans(doc_offsets[:-1], doc_offsets[1:], seq_len, stride)
