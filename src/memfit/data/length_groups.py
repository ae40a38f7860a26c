"""--group-by-length: samples of similar length trained together, so micro-batches pad less.

The Hugging Face Trainer's `group_by_length` shuffles, cuts the shuffled order into
"megabatches" of up to 50 batches, sorts each by length and slices it into batches. memfit
does the same at the level of the *effective* batch, and keeps every promise of
memfit.data.schedule:

- the order is a pure function of (seed, epoch, effective batch, sample lengths): never of
  the micro-batch size, an OOM split, the number of ranks or where a run resumed, so
  accumulation and OOM recovery stay exact and a resumed run sees the same samples;
- each epoch is still a permutation of all samples, laid end to end with the next, and step
  k still takes positions [k * B, (k + 1) * B) of that stream.

Within an epoch, the shuffled order (the plain schedule's own permutation) is cut into
megabatches aligned to the step boundaries, each is sorted longest first and cut into
effective batches, and the order of those batches is shuffled from the seed. A step's
samples are sorted longest first, so its micro-batches (contiguous slices) hold neighbours
in length. The step holding the epoch's longest sample goes first: a run meets its largest
activations at its first step (as the Trainer puts its longest batch first to surface an
OOM early), where memfit's OOM recovery or the planner's margin deal with it at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from memfit.data.schedule import BatchSchedule

log = logging.getLogger("memfit")

MEGABATCH_STEPS = 50
"""At most this many effective batches are sorted together (the Trainer's megabatch multiplier)."""


class LengthGroupedSchedule(BatchSchedule):
    """A BatchSchedule whose steps each hold samples of similar length (see the module docstring).

    Args:
        lengths: tokens of each sample (the dataset's `lengths`).
        effective_batch_size, seed, rank, world_size: as BatchSchedule.
        megabatch_steps: effective batches sorted together; fewer when the data holds fewer
            than 4 x that many batches (as the Trainer lowers it), at least 1.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, effective_batch_size: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, megabatch_steps: int = MEGABATCH_STEPS):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        super().__init__(len(self.lengths), effective_batch_size, seed, rank, world_size)
        batches = len(self.lengths) // max(effective_batch_size, 1)
        self.megabatch_steps = max(1, min(megabatch_steps, batches // 4))

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a batch spans at most two epochs
                self._permutations.pop(min(self._permutations))
            self._permutations[epoch] = self._grouped(epoch)
        return self._permutations[epoch]

    def _grouped(self, epoch: int) -> np.ndarray:
        n, batch = self.num_samples, self.effective_batch_size
        rng = np.random.default_rng([self.seed, epoch])
        shuffled = rng.permutation(n)  # the plain schedule's order of this epoch
        # The first `head` positions of the epoch finish a step begun in the previous epoch: kept apart, so that every
        # later group of `batch` positions is exactly one step.
        head = min((-epoch * n) % batch, n)
        megabatch = batch * self.megabatch_steps
        full: list[np.ndarray] = []
        partial: list[np.ndarray] = []
        for start in range(head, n, megabatch):
            group = self._longest_first(shuffled[start : start + megabatch])
            for begin in range(0, len(group), batch):
                (full if len(group) - begin >= batch else partial).append(group[begin : begin + batch])
        order_rng = np.random.default_rng([self.seed, epoch, 1])
        # Batches shuffle within their megabatch only, so a step never mixes two megabatches' lengths.
        shuffled_full: list[np.ndarray] = []
        for start in range(0, len(full), self.megabatch_steps):
            chunk = full[start : start + self.megabatch_steps]
            shuffled_full.extend(chunk[i] for i in order_rng.permutation(len(chunk)))
        if shuffled_full:
            longest = int(np.argmax([self.lengths[b].max() for b in shuffled_full]))
            shuffled_full[0], shuffled_full[longest] = shuffled_full[longest], shuffled_full[0]
        # The tail (fewer than `batch`) starts the step that reaches into the next epoch: it stays last.
        return np.concatenate([self._longest_first(shuffled[:head]), *shuffled_full, *partial]).astype(np.int64)

    def _longest_first(self, indices: np.ndarray) -> np.ndarray:
        return indices[np.argsort(-self.lengths[indices], kind="stable")]


def padded_positions(lengths: Sequence[int] | np.ndarray, micro_batch_size: int) -> int:
    """Positions the micro-batches of one step run when each pads to its longest sample (right padding)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(sum(len(part) * int(part.max()) for part in np.split(lengths, range(micro_batch_size, len(lengths),
                                                                                    micro_batch_size))))


def build_schedule(dataset: Sequence, effective_batch_size: int, seed: int, rank: int, world_size: int,
                   group_by_length: bool) -> BatchSchedule:
    """The run's schedule over `dataset`: grouped by length under --group-by-length, else the plain shuffled one.

    Grouping reads `dataset.lengths`; data whose samples all have one length gains nothing but a new order, and
    the log says so.
    """
    if not group_by_length:
        return BatchSchedule(len(dataset), effective_batch_size, seed, rank, world_size)
    lengths = np.asarray(dataset.lengths if hasattr(dataset, "lengths") else
                         [len(dataset[i]["input_ids"]) for i in range(len(dataset))], dtype=np.int64)
    if len(lengths) and int(lengths.min()) == int(lengths.max()):
        log.info("memfit: --group-by-length: every sample has %d tokens, so grouping saves no padding", int(lengths[0]))
    return LengthGroupedSchedule(lengths, effective_batch_size, seed, rank, world_size)
