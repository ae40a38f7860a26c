"""Training data: text files or Hugging Face datasets -> cached tokens -> windows -> batches.

    dataset = load_training_data(cfg.data, tokenizer, max_positions=model.config.max_position_embeddings)
    schedule = BatchSchedule(len(dataset), effective_batch_size, seed, rank, world_size)
    for step in range(max_steps):
        indices = schedule.batch_indices(step)           # this rank's share of the step
        for chunk in split(indices, micro_batch_size):   # any split gives the same samples
            batch = collate([dataset[i] for i in chunk], tokenizer.pad_token_id)

See docs/data.md for the formats, windows, packing, the cache and the order guarantee.
"""

from __future__ import annotations

import math
from typing import Any

from memfit.config import DEFAULT_SEQ_LEN, DataConfig
from memfit.data.cache import TokenStore, load_or_tokenize, tokenizer_fingerprint
from memfit.data.collate import collate, target_token_count
from memfit.data.dataset import TokenizedDataset
from memfit.data.packing import PackedDataset, best_fit_decreasing, packing_efficiency, resolve_packing
from memfit.data.samples import SFTDataset, load_supervised_data
from memfit.data.schedule import BatchSchedule
from memfit.data.sources import TextSource, bundled_corpus_path, resolve_source
from memfit.data.windows import IGNORE_INDEX, Windows, make_windows
from memfit.errors import UsageError

__all__ = [
    "IGNORE_INDEX",
    "BatchSchedule",
    "PackedDataset",
    "SFTDataset",
    "TextSource",
    "TokenStore",
    "TokenizedDataset",
    "Windows",
    "bundled_corpus_path",
    "collate",
    "load_training_data",
    "make_windows",
    "best_fit_decreasing",
    "packing_efficiency",
    "resolve_packing",
    "resolve_source",
    "target_token_count",
    "tokenizer_fingerprint",
]


def load_training_data(
    data_cfg: DataConfig,
    tokenizer: Any,
    *,
    max_positions: int | None = None,
    min_samples: int = 1,
    rope_positions: int | None = None,
    say: bool = True,
) -> TokenizedDataset | SFTDataset:
    """Read, tokenize (once; cached on disk) and window the training text of `data_cfg`.

    Args:
        data_cfg: dataset, text_field, seq_len, stride, packing, truncate, allow_drop and cache_dir. seq_len None:
            from the data for whole samples (memfit.data.lengths), DEFAULT_SEQ_LEN for plain text, within
            `max_positions` either way; the dataset's `seq_len` says what was chosen.
        tokenizer: has `encode(text, add_special_tokens=False)`, `eos_token_id` and
            `get_vocab()` (any Hugging Face tokenizer does).
        max_positions: the most positions the model handles; seq_len must not exceed it.
        min_samples: the fewest windows a run can use (one effective batch).
        rope_positions: the model's own positions when `--rope-scale` could extend them (a RoPE
            model); the refusal of a too long seq_len then names the factor that would fit it.
        say: log what the length did to whole samples (chosen from the data, dropped, cut), one line each.

    The data is checked before the token cache is written: data a run cannot use leaves
    no cache (and no cache directory) behind.

    Raises:
        UsageError: seq_len too long for the model, missing or unreadable data, no text, whole samples of which
            seq_len would drop more than 1% (samples or target tokens) without allow_drop, or too little text for
            one window or for `min_samples` windows.
    """
    seq_len, stride = data_cfg.seq_len, data_cfg.stride
    if seq_len is not None:
        check_seq_len(seq_len, stride, max_positions, rope_positions)
    # Conversations, prompt-completion, Alpaca, ShareGPT: whole samples with loss masks (data/samples.py).
    supervised = load_supervised_data(data_cfg, tokenizer, min_samples=min_samples, max_positions=max_positions, say=say)
    if supervised is not None:
        if seq_len is None:
            check_seq_len(supervised.seq_len, 0, max_positions, rope_positions)
        return supervised
    if seq_len is None:  # plain text: windows of the default length (fewer when the model has fewer positions)
        seq_len = min(DEFAULT_SEQ_LEN, max_positions) if max_positions else DEFAULT_SEQ_LEN
        check_seq_len(seq_len, stride, max_positions, rope_positions)
    source = resolve_source(data_cfg.dataset, data_cfg.text_field)
    windows: list[Windows] = []
    # Plain text: `wrapped` cuts one stream; `off` and `samples` keep one document per window (samples packs them later).
    wrapped = resolve_packing(data_cfg.packing, supervised=False) == "wrapped"

    def check(store: TokenStore) -> None:
        found = make_windows(store.doc_offsets, seq_len, stride, wrapped)
        if len(found) < min_samples:
            raise UsageError(
                f"the dataset has {len(found)} samples of {seq_len} tokens, fewer than one effective batch"
                f" ({min_samples}); lower --batch-size/--gradient-accumulation-steps or --seq-len, or add data"
            )
        windows.append(found)

    store = load_or_tokenize(source, tokenizer, data_cfg.cache_dir, check=check)
    return TokenizedDataset(store, windows[-1], seq_len, stride, wrapped, source.label)


def check_seq_len(seq_len: int, stride: int, max_positions: int | None, rope_positions: int | None = None) -> None:
    """Refuse a window the model cannot hold, one shorter than 2 tokens, or a stride outside it (UsageError)."""
    if max_positions is not None and seq_len > max_positions:
        extend = ""
        if rope_positions:
            factor = max(2, math.ceil(seq_len / rope_positions))
            extend = (f", or extend the model's {rope_positions:,} positions with --rope-scale {factor}"
                      " (RoPE scaling: a context-extension fine-tune)")
        raise UsageError(
            f"--seq-len {seq_len} is too long: the model handles at most {max_positions} positions; lower --seq-len{extend}"
        )
    if seq_len < 2:
        raise UsageError(f"--seq-len must be at least 2 (one token predicts the next), got {seq_len}")
    if not 0 <= stride < seq_len:
        raise UsageError(f"--stride must be between 0 and --seq-len - 1 ({seq_len - 1}), got {stride}")
