"""A supervised dataset made in memory: samples of given lengths with a masked prompt, as the formats produce."""

from __future__ import annotations

import numpy as np
import torch


class SyntheticSamples(torch.utils.data.Dataset):
    """Samples of the given lengths with random tokens; the first 1/`prompt_share` of each carries no loss."""

    def __init__(self, lengths, seed: int = 0, prompt_share: int = 3):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        generator = torch.Generator().manual_seed(seed)
        self.items = []
        for length in self.lengths.tolist():
            input_ids = torch.randint(0, 250, (length,), generator=generator)
            labels = input_ids.clone()
            labels[: length // prompt_share] = -100  # a prompt that carries no loss
            self.items.append({"input_ids": input_ids, "labels": labels})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]
