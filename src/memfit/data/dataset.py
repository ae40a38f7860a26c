"""The training dataset: cached tokens seen through windows, one sample per window."""

from __future__ import annotations

import numpy as np
import torch

from memfit.data.cache import TokenStore
from memfit.data.windows import IGNORE_INDEX, Windows


class TokenizedDataset(torch.utils.data.Dataset):
    """Samples of at most `seq_len` tokens: `dataset[i]` is {"input_ids", "labels"}, 1-D LongTensors.

    Labels equal input_ids except on overlap context (-100); the loss shifts them by one.
    Reading a sample slices the memory-mapped token file, so the dataset costs almost no
    memory however large it is.
    """

    def __init__(self, store: TokenStore, windows: Windows, seq_len: int, stride: int, packing: bool, source: str):
        self.store = store
        self.windows = windows
        self.seq_len = seq_len
        self.stride = stride
        self.packing = packing
        self.source = source

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {len(self)} samples")
        index = int(index) % len(self)
        start = int(self.windows.starts[index])
        length = int(self.windows.lengths[index])
        input_ids = torch.from_numpy(np.asarray(self.store.tokens[start : start + length], dtype=np.int64))
        labels = input_ids.clone()
        labels[: int(self.windows.contexts[index])] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of every sample (what --packing samples packs by)."""
        return self.windows.lengths

    @property
    def num_tokens(self) -> int:
        """Tokens in the dataset, EOS separators included."""
        return self.store.num_tokens

    @property
    def num_documents(self) -> int:
        return self.store.num_documents

    @property
    def num_target_tokens(self) -> int:
        """Tokens that carry a loss over one pass of every window."""
        return self.windows.target_tokens()

    @property
    def from_cache(self) -> bool:
        return self.store.from_cache

    @property
    def description(self) -> str:
        """One line for the user: source, documents, tokens, windows, cached or fresh."""
        layout = "packed" if self.packing else "one document each"
        overlap = f", stride {self.stride}" if self.stride else ""
        origin = "from cache" if self.from_cache else "tokenized now, cached"
        return (
            f"{self.source}: {self.num_documents:,} documents, {self.num_tokens:,} tokens,"
            f" {len(self):,} windows of <= {self.seq_len} ({layout}{overlap}), {origin}"
        )
