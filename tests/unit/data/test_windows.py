"""Windows: stride overlap is context only, every token is a target once, packing vs padding."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from memfit.data.windows import make_windows, split_spans
from memfit.errors import UsageError


def targets_of(windows) -> Counter:
    """How many times each stream position is a loss target (labels shift by one in the loss)."""
    seen: Counter = Counter()
    for start, length, context in zip(windows.starts, windows.lengths, windows.contexts, strict=True):
        for position in range(max(int(context), 1), int(length)):
            seen[int(start) + position] += 1
    return seen


@pytest.mark.parametrize("size, seq_len, stride", [(100, 16, 4), (100, 16, 1), (97, 10, 9), (33, 8, 3), (16, 16, 5)])
def test_every_token_after_the_first_is_trained_exactly_once_with_stride(size, seq_len, stride):
    windows = split_spans(np.array([0]), np.array([size]), seq_len, stride)
    assert targets_of(windows) == Counter(range(1, size))
    assert windows.target_tokens() == size - 1
    assert all(windows.lengths == min(size, seq_len))  # the last window is moved back, so all are full
    assert windows.starts[-1] + windows.lengths[-1] == size


def test_overlap_is_stride_tokens_of_context():
    windows = split_spans(np.array([0]), np.array([40]), seq_len=10, stride=3)
    assert windows.starts.tolist() == [0, 7, 14, 21, 28, 30]
    assert windows.contexts.tolist() == [0, 3, 3, 3, 3, 8]  # the last window re-reads 8 tokens as context


def test_without_stride_windows_do_not_overlap():
    windows = split_spans(np.array([0]), np.array([30]), seq_len=10, stride=0)
    assert windows.starts.tolist() == [0, 10, 20]
    assert windows.contexts.tolist() == [0, 0, 0]


def test_packing_cuts_one_stream_across_documents():
    offsets = np.array([0, 5, 12, 30, 33])  # documents of 5, 7, 18 and 3 tokens
    windows = make_windows(offsets, seq_len=8, packing=True)
    assert all(windows.lengths == 8)
    assert windows.starts.tolist() == [0, 8, 16, 24, 25]
    # stride 0: the first token of each later window has no history and is no target
    assert targets_of(windows) == Counter(set(range(1, 33)) - {8, 16, 24})
    assert targets_of(make_windows(offsets, seq_len=8, stride=1, packing=True)) == Counter(range(1, 33))


def test_without_packing_each_document_is_its_own_sample():
    offsets = np.array([0, 5, 12, 30, 33])
    windows = make_windows(offsets, seq_len=8, stride=2, packing=False)
    spans = [(int(s), int(s + n)) for s, n in zip(windows.starts, windows.lengths, strict=True)]
    assert spans == [(0, 5), (5, 12), (12, 20), (18, 26), (22, 30), (30, 33)]
    assert windows.contexts.tolist() == [0, 0, 0, 2, 4, 0]
    # no window crosses a document boundary
    for start, end in spans:
        assert np.searchsorted(offsets, start, side="right") == np.searchsorted(offsets, end - 1, side="right")


def test_packing_needs_at_least_one_full_window():
    with pytest.raises(UsageError, match="fewer than one window of --seq-len 64; lower --seq-len"):
        make_windows(np.array([0, 10, 20]), seq_len=64, packing=True)
    assert len(make_windows(np.array([0, 10, 20]), seq_len=64, packing=False)) == 2


def test_bad_stride_is_refused():
    with pytest.raises(UsageError, match="--stride"):
        split_spans(np.array([0]), np.array([10]), seq_len=4, stride=4)
