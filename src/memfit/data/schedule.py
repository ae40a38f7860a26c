"""Which samples each optimizer step trains on: a pure function of (seed, effective batch, step).

The sample order depends only on the seed and the effective batch size, never on how
a step is split into micro-batches or where a run was resumed. That is what makes
runs with different `--batch-size` x `--gradient-accumulation-steps` splits (or an
OOM-recovery split) train on exactly the same data, and a resumed run continue exactly
where the interrupted one stopped.

Each epoch is a fresh random permutation of all samples, derived from (seed, epoch).
The permutations are laid end to end and step k takes positions
[k * B, (k + 1) * B) of that stream (B = effective batch size). So every sample is seen
exactly once per epoch and every step has a full batch, whatever the dataset size; a
batch that straddles two epochs takes the end of one permutation and the start of the
next. With several ranks, the global batch is the same and rank r takes its contiguous
slice of it.
"""

from __future__ import annotations

import math

import numpy as np

from memfit.errors import UsageError


class BatchSchedule:
    """The samples of every optimizer step, for one rank.

    Args:
        num_samples: samples in the dataset (windows).
        effective_batch_size: samples per optimizer step over all ranks.
        seed: seed of the order.
        rank, world_size: this process's rank and the number of ranks; the effective
            batch must be divisible by world_size.
    """

    def __init__(self, num_samples: int, effective_batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        if num_samples < 1:
            raise UsageError("the dataset has no samples to train on; give more text")
        if effective_batch_size < 1:
            raise UsageError(f"the effective batch size must be at least 1, got {effective_batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise UsageError(f"rank {rank} is not within a world of {world_size} processes")
        if effective_batch_size % world_size:
            raise UsageError(
                f"the effective batch size {effective_batch_size} is not divisible by the {world_size} ranks;"
                " pick a multiple of the number of processes"
            )
        self.num_samples = num_samples
        self.effective_batch_size = effective_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.per_rank = effective_batch_size // world_size
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps that cover every sample once (the last may reach into the next epoch)."""
        return math.ceil(self.num_samples / self.effective_batch_size)

    def steps_for_epochs(self, epochs: float) -> int:
        """Optimizer steps for `epochs` passes over the data (at least 1)."""
        return max(1, math.ceil(epochs * self.num_samples / self.effective_batch_size))

    def epoch_at(self, step: int) -> float:
        """Passes over the data completed before optimizer step `step` (0-based), e.g. 1.25."""
        return step * self.effective_batch_size / self.num_samples

    def global_batch_indices(self, step: int) -> list[int]:
        """Samples of optimizer step `step` over all ranks, in order."""
        return self._positions(step * self.effective_batch_size, self.effective_batch_size)

    def batch_indices(self, step: int) -> list[int]:
        """This rank's samples for optimizer step `step` (0-based, counted across epochs)."""
        begin = step * self.effective_batch_size + self.rank * self.per_rank
        return self._positions(begin, self.per_rank)

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of one epoch."""
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a batch spans at most two epochs
                self._permutations.pop(min(self._permutations))
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.num_samples)
        return self._permutations[epoch]

    def _positions(self, begin: int, count: int) -> list[int]:
        if begin < 0:
            raise ValueError(f"optimizer steps start at 0, got a position of {begin}")
        indices: list[int] = []
        position = begin
        while len(indices) < count:
            epoch, offset = divmod(position, self.num_samples)
            take = min(count - len(indices), self.num_samples - offset)
            indices.extend(int(i) for i in self.permutation(epoch)[offset : offset + take])
            position += take
        return indices
