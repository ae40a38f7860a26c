"""Masked-LM masking drawn on the fly from (seed, step, sample): a resumed run masks as an uninterrupted one.

BERT's rule, as Hugging Face's DataCollatorForLanguageModeling applies it: each token other
than a special token is chosen with probability `probability`; of those, 80% become the mask
token, 10% a random token and 10% stay as they are; only chosen tokens carry a loss. Where
the collator draws from the global RNG (so the masks depend on everything that ran before),
memfit draws each sample's masks from its own generator, seeded by (run seed, optimizer step,
sample index): the masks of a step are a function of the step, whether the run was resumed,
how the batch was split into micro-batches, or which rank holds the sample.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

IGNORE_INDEX = -100
_MASK_STREAM = 0x6D4C4D  # keeps these draws apart from the schedule's and the held-out split's
EVAL_STEP = -1
"""The step evaluation masks with: the same masks at every evaluation, so eval losses compare."""


def mask_tokens(input_ids: torch.Tensor, *, seed: int, step: int, index: int, probability: float, mask_token_id: int,
                vocab_size: int, special_ids: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked input_ids, labels) of one 1-D sample; labels hold IGNORE_INDEX where no loss is taken."""
    rng = np.random.default_rng([seed, step + 1, index, _MASK_STREAM])  # step + 1: EVAL_STEP stays non-negative
    ids = input_ids.numpy()
    candidates = ~np.isin(ids, np.fromiter(special_ids, dtype=np.int64))
    chosen = candidates & (rng.random(ids.shape) < probability)
    roll = rng.random(ids.shape)
    random_tokens = rng.integers(0, vocab_size, ids.shape)
    masked = ids.copy()
    masked[chosen & (roll < 0.8)] = mask_token_id
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    masked[swap] = random_tokens[swap]
    labels = np.where(chosen, ids, IGNORE_INDEX)
    return torch.from_numpy(masked), torch.from_numpy(labels)
