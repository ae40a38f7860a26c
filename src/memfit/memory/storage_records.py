"""The records behind the live-storage counter: one per live storage, per saved tensor, per peak."""

from __future__ import annotations

import collections
import weakref

import torch

from memfit.memory.categories import (
    ACTIVATION_GRADIENTS,
    ACTIVATIONS,
    DEVICE,
    LOGITS,
    OTHER,
    RECOMPUTED_ACTIVATIONS,
)


class StorageRecord:
    """What the counter knows about one live storage.

    Its category follows from the fields: a role (parameters, gradients, optimizer
    state) first, then logits-shaped, then made by a checkpoint's recompute, then saved
    for backward or brought back from an offloaded host copy, then made by backward,
    else other.
    """

    __slots__ = (
        "key", "born", "ref", "nbytes", "place", "role", "saved", "logits", "recomputed", "restored", "backward",
        "shape", "dtype", "op", "module", "phase",
    )  # fmt: skip

    def __init__(
        self, key: int, born: int, nbytes: int, tensor: torch.Tensor | None, op: str, place: str = DEVICE
    ) -> None:
        self.key = key
        self.born = born  # order of first sight, to tell whether it was alive at a past peak
        self.ref: weakref.ref | None = None
        self.nbytes = nbytes
        self.place = place  # device, or host (an offloaded copy)
        self.role = OTHER  # parameters / gradients / optimizer_states, or other
        self.saved = 0  # how many saved-for-backward references are alive
        self.logits = False
        self.recomputed = False  # made by a checkpointed block's recompute in backward
        self.restored = False  # brought back from a host copy (offloaded activations) for backward
        self.backward = False  # made by backward outside a recompute
        # A storage first seen through a resize has no tensor: describe it as raw bytes.
        self.shape = tuple(tensor.shape) if tensor is not None else (nbytes,)
        self.dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "uint8"
        self.op = op
        self.module = ""
        self.phase = ""

    @property
    def category(self) -> str:
        if self.role != OTHER:
            return self.role
        if self.logits:
            return LOGITS
        if self.recomputed:
            return RECOMPUTED_ACTIVATIONS
        if self.saved > 0 or self.restored:
            return ACTIVATIONS
        if self.backward:
            return ACTIVATION_GRADIENTS
        return OTHER


class SavedTensor:
    """What autograd keeps instead of a saved tensor; its death releases the saving."""

    __slots__ = ("tensor", "record", "events")

    def __init__(self, tensor: torch.Tensor, record: StorageRecord, events: collections.deque) -> None:
        self.tensor = tensor
        self.record = record
        self.events = events

    def __del__(self) -> None:
        # Only queue: this can run in the middle of the counter's own bookkeeping.
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
