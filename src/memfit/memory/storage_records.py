"""The records behind `MemoryTracker`: one per live storage, per saved tensor, per peak.

Kept apart from the tracker so that its module holds the accounting logic alone.
"""

from __future__ import annotations

import collections
import weakref

import torch

from memfit.memory.categories import ACTIVATIONS, OTHER


class StorageRecord:
    """What the tracker knows about one live storage."""

    __slots__ = ("key", "born", "ref", "nbytes", "role", "saved", "shape", "dtype", "op", "module", "phase")

    def __init__(
        self, key: int, born: int, nbytes: int, tensor: torch.Tensor, op: str, module: str, phase: str
    ) -> None:
        self.key = key
        self.born = born  # order of first sight, to tell whether it was alive at a past peak
        self.ref: weakref.ref | None = None
        self.nbytes = nbytes
        self.role = OTHER  # parameters / gradients / optimizer_states, or other
        self.saved = 0  # how many saved-for-backward references are alive
        self.shape = tuple(tensor.shape)
        self.dtype = str(tensor.dtype).removeprefix("torch.")
        self.op = op
        self.module = module
        self.phase = phase

    @property
    def category(self) -> str:
        if self.role != OTHER:
            return self.role
        return ACTIVATIONS if self.saved > 0 else OTHER


class SavedTensor:
    """What autograd keeps instead of a saved tensor; its death releases the saving."""

    __slots__ = ("tensor", "record", "events")

    def __init__(self, tensor: torch.Tensor, record: StorageRecord, events: collections.deque) -> None:
        self.tensor = tensor
        self.record = record
        self.events = events

    def __del__(self) -> None:
        # Only queue: this can run in the middle of the tracker's own bookkeeping.
        self.events.append(("unsave", self.record, None))


class PeakRecord:
    """A peak of live bytes: its size, its breakdown, and how many storages were born by then."""

    __slots__ = ("peak", "breakdown", "born")

    def __init__(self, peak: int, breakdown: dict[str, int], born: int) -> None:
        self.peak = peak
        self.breakdown = breakdown
        self.born = born

    def raise_to(self, current: int, by_category: dict[str, int], born: int) -> bool:
        if current <= self.peak:
            return False
        self.peak, self.breakdown, self.born = current, dict(by_category), born
        return True

    def reclassify(self, record: StorageRecord, source: str, target: str) -> None:
        # A storage alive now and born before the peak was alive at the peak.
        if record.born < self.born and self.breakdown.get(source, 0) >= record.nbytes:
            self.breakdown[source] -= record.nbytes
            self.breakdown[target] += record.nbytes


def optimizers_within(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """The optimizer and those it delegates to (one per parameter under optimizer-in-backward)."""
    if optimizer is None:
        return []
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, dict):
        inner = list(inner.values())
    return [optimizer, *(inner or [])]
