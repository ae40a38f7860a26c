"""The live-storage core: every tensor storage alive on the device (and in host memory), counted once.

Both the memory tracker (`memfit profile`, the emulated cap) and the traced estimate
(`memfit estimate --method traced`, the same step on fake tensors) count through this
one class, so they agree on what a byte is and which category it falls in
(`memfit.memory.categories`).

    storages = LiveStorages("cpu", cap_bytes=2 * 2**30)
    with storages:                        # a dispatch mode + a hook on UntypedStorage.resize_
        ...                               # every aten operator is seen
    storages.live[DEVICE], storages.live[HOST], storages.totals[DEVICE][category]

How it counts:
- A storage is counted once, at its real `nbytes()`, however many views share it; it
  is held weakly (a `weakref` with a callback), so counting never keeps memory alive,
  and its bytes go when the storage is freed (applied at the next operator: `flush`).
- Storages that existed before counting began are adopted the first time an
  operator reads them (and by whoever walks the model: `track`).
- `UntypedStorage.resize_` is counted: FSDP2 frees a gathered parameter by resizing
  its storage to 0 bytes and gathers it again by resizing it back up. Resizes made by
  the `aten.resize_` operator are seen through the operator's output.
- Fake tensors (`FakeTensorMode`) are counted like real ones, at their fake device.

Device and host: storages on the device count as device bytes: the peak, the
categories, the emulated cap. Host copies made on purpose (pinned CPU storages on a
CUDA run; on any run, storages made inside `memfit.techniques.host_memory.host_allocations()` or
marked with `memfit.techniques.host_memory.mark_host`) count as host bytes, reported beside the
device figures and never against the cap. Other CPU storages of a CUDA run (a batch
before it is moved) are not counted.

The emulated cap (CPU runs, `--memory-cap`): an operator whose new device storages
would take the live device bytes past `cap_bytes` raises `torch.OutOfMemoryError`
(`memfit.memory.cap.refuse_over_cap` decides); its outputs are dropped uncounted.

What a storage's category is depends on what made it and what holds it (a parameter,
saved for backward, ...): the owner of the counter describes each new storage
(`describe_birth`) and changes a record's fields through `update`, which moves its
bytes between categories. A `listener` sees every change (peaks, timelines).
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.memory.cap import refuse_over_cap
from memfit.memory.categories import DEVICE, HOST, empty_breakdown
from memfit.memory.storage_records import StorageRecord
from memfit.techniques import host_memory as host

__all__ = ["DEVICE", "EXISTING_OP", "HOST", "LiveStorages", "StorageListener"]

EXISTING_OP = "(existing)"
RESIZE_OP = "UntypedStorage.resize_"


class StorageListener(Protocol):
    """What the owner of a counter learns about every change of the live bytes."""

    def before_change(self, place: str, category: str, delta: int) -> None: ...

    def after_change(self, place: str, category: str, delta: int) -> None: ...

    def before_recategorize(self, record: StorageRecord) -> None: ...

    def recategorized(self, record: StorageRecord, source: str, target: str) -> None: ...


class LiveStorages:
    """Counts live tensor storages on `device` (and host copies), by category.

    Args:
        device: the training device; storages elsewhere are not counted, except host copies.
        cap_bytes: emulated cap on live device bytes (see the module docstring).
    """

    def __init__(self, device: torch.device | str, cap_bytes: int | None = None) -> None:
        self.device = torch.device(device)
        self.cap_bytes = cap_bytes
        self.records: dict[int, StorageRecord] = {}
        self.totals = {DEVICE: empty_breakdown(), HOST: empty_breakdown()}
        self.live = {DEVICE: 0, HOST: 0}
        self.births = 0
        # Frees and released saves, queued by callbacks and applied at safe points.
        self.events: collections.deque = collections.deque()
        self.listener: StorageListener | None = None
        self.describe_birth: Callable[[StorageRecord, torch.Tensor | None], None] | None = None
        self.after_operator: Callable[[], None] | None = None
        self._depth = 0
        self._mode: _CountingMode | None = None

    # ------------------------------------------------------------ entering

    def __enter__(self) -> LiveStorages:
        self._depth += 1
        if self._depth == 1:
            _install_resize_hook(self)
            host.add_listener(self)
            self._mode = _CountingMode(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._mode.__exit__(*exc_info)
            self._mode = None
            host.remove_listener(self)
            _remove_resize_hook(self)
            self.flush()

    @property
    def active(self) -> bool:
        return self._depth > 0

    # ------------------------------------------------------------ placement

    def place_of(self, tensor: torch.Tensor, storage: torch.UntypedStorage, born_now: bool) -> str | None:
        """DEVICE, HOST or None (not counted) for a storage seen through `tensor`."""
        # Fake tensors keep their storage on "meta": the tensor says where it would be.
        device = tensor.device
        on_device = device.type == self.device.type and (self.device.index is None or device.index == self.device.index)
        if device.type == "cpu" and self._is_host_copy(storage, born_now):
            return HOST
        return DEVICE if on_device else None

    def _is_host_copy(self, storage: torch.UntypedStorage, born_now: bool) -> bool:
        if born_now and host.allocating_on_host():
            return True
        if host.is_marked_host(storage):
            return True
        # Only an accelerator run pins memory; asking on a CPU-only build would fail.
        return self.device.type == "cuda" and storage.device.type == "cpu" and storage.is_pinned()

    @staticmethod
    def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
        local = getattr(tensor, "_local_tensor", None)  # a DTensor: count its local shard
        if local is not None:
            tensor = local
        try:
            return tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None  # sparse, nested, or a subclass without a plain storage

    # ------------------------------------------------------------ counting

    def track(self, tensor: torch.Tensor, op: str = EXISTING_OP, born_now: bool = False) -> StorageRecord | None:
        """The record of `tensor`'s storage, counting it first if new; None if not counted here."""
        storage = self.storage_of(tensor)
        if storage is None:
            return None
        record = self.records.get(storage._cdata)
        if record is not None and record.ref() is storage:
            self._follow_resize(record, storage)
            return record
        if isinstance(tensor, torch.Tensor) and hasattr(tensor, "_local_tensor"):
            tensor = tensor._local_tensor
        place = self.place_of(tensor, storage, born_now)
        if place is None:
            return None
        return self._new_record(storage, tensor, op, place)

    def _new_record(self, storage, tensor: torch.Tensor | None, op: str, place: str) -> StorageRecord:
        key = storage._cdata
        record = StorageRecord(key, self.births, storage.nbytes(), tensor, op, place)
        self.births += 1
        if self.describe_birth is not None:
            self.describe_birth(record, tensor)
        events = self.events
        record.ref = weakref.ref(storage, lambda ref, key=key: events.append(("free", key, ref)))
        self.records[key] = record
        self._apply(place, record.category, record.nbytes)
        return record

    def _follow_resize(self, record: StorageRecord, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        if nbytes != record.nbytes:
            delta, record.nbytes = nbytes - record.nbytes, nbytes
            self._apply(record.place, record.category, delta)

    def adopt_inputs(self, args: tuple, kwargs: dict) -> bool:
        """Count the storages an operator reads that were made before counting saw them.

        Returns whether it reads a host copy (an offloaded tensor being brought back).
        """
        self.flush()
        reads_host = False
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                record = self.track(leaf)
                reads_host = reads_host or (record is not None and record.place == HOST)
        return reads_host

    def count_outputs(self, func, out, from_host: bool = False) -> torch.OutOfMemoryError | None:
        """Count the outputs of `func`; return the cap error instead if they do not fit.

        `from_host`: the operator read a host copy; its new device storages are restored
        activations (offloaded ones coming back for backward).
        """
        self.flush()
        new: dict[int, tuple[torch.UntypedStorage, torch.Tensor, str]] = {}
        requested = 0
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            storage = self.storage_of(leaf)
            if storage is None:
                continue
            key = storage._cdata
            record = self.records.get(key)
            if record is not None and record.ref() is storage:
                self._follow_resize(record, storage)  # in-place or view: only a resize counts
            elif key not in new:
                place = self.place_of(leaf, storage, born_now=True)
                if place is not None:
                    new[key] = (storage, leaf, place)
                    requested += storage.nbytes() if place == DEVICE else 0
        error = refuse_over_cap(requested, self.live[DEVICE], self.cap_bytes) if new else None
        if error is None and new:
            op = str(func.overloadpacket)
            for storage, tensor, place in new.values():
                record = self._new_record(storage, tensor, op, place)
                if from_host and place == DEVICE:
                    self.update(record, restored=True)
        if self.after_operator is not None:
            self.after_operator()
        return error

    def flush(self) -> bool:
        """Apply the frees and released saves that callbacks have queued; True if any."""
        events = self.events
        changed = False
        while events:
            kind, item, ref = events.popleft()
            changed = True
            if kind == "free":
                record = self.records.get(item)
                if record is None or record.ref is not ref:
                    continue  # the address was reused by a storage counted since
                del self.records[item]
                self._apply(record.place, record.category, -record.nbytes)
            else:  # "unsave": autograd released a saved tensor
                self.update(item, saved=item.saved - 1)
        if changed and self.after_operator is not None:
            self.after_operator()
        return changed

    def is_counted(self, record: StorageRecord) -> bool:
        return self.records.get(record.key) is record

    def update(self, record: StorageRecord, **fields) -> None:
        """Change a record's fields (role, saved, place, ...), moving its bytes to its new category."""
        counted = self.is_counted(record)
        if counted and self.listener is not None:
            self.listener.before_recategorize(record)
        source, source_place = record.category, record.place
        for name, value in fields.items():
            setattr(record, name, value)
        target = record.category
        if not counted or (source == target and source_place == record.place) or not record.nbytes:
            return
        self._apply(source_place, source, -record.nbytes)
        self._apply(record.place, target, record.nbytes)
        if self.listener is not None:
            self.listener.recategorized(record, source, target)

    def _apply(self, place: str, category: str, delta: int) -> None:
        listener = self.listener
        if listener is not None:
            listener.before_change(place, category, delta)
        self.totals[place][category] += delta
        self.live[place] += delta
        if listener is not None:
            listener.after_change(place, category, delta)

    # ------------------------------------------------------------ hooks from outside

    def storage_marked_host(self, storage: torch.UntypedStorage, tensor: torch.Tensor) -> None:
        """`memfit.techniques.host_memory.mark_host` was called: the storage's bytes are host bytes now."""
        self.flush()
        record = self.records.get(storage._cdata)
        if record is not None and record.ref() is storage:
            self.update(record, place=HOST)
        elif tensor.device.type == "cpu":
            self._new_record(storage, tensor, EXISTING_OP, HOST)

    def resize_requested(self, storage: torch.UntypedStorage, size: int) -> torch.OutOfMemoryError | None:
        """Before `storage.resize_(size)`: the cap error if the growth does not fit on the device."""
        self.flush()
        record = self.records.get(storage._cdata)
        if record is not None and record.ref() is storage:
            place, current = record.place, record.nbytes
        else:
            on_device = storage.device.type == self.device.type
            place, current = (DEVICE if on_device else None), storage.nbytes()
        if place != DEVICE:
            return None
        return refuse_over_cap(size - current, self.live[DEVICE], self.cap_bytes)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """After `storage.resize_(...)`: count the new size (a first sight counts it whole)."""
        record = self.records.get(storage._cdata)
        if record is not None and record.ref() is storage:
            self._follow_resize(record, storage)
        elif storage.nbytes() and storage.device.type == self.device.type:
            place = HOST if self.device.type == "cpu" and self._is_host_copy(storage, True) else DEVICE
            self._new_record(storage, None, RESIZE_OP, place)
        if self.after_operator is not None:
            self.after_operator()


class _CountingMode(TorchDispatchMode):
    """Sees every aten operator: counts the storages it reads and allocates."""

    def __init__(self, storages: LiveStorages) -> None:
        super().__init__()
        self.storages = storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from_host = self.storages.adopt_inputs(args, kwargs)
        out = func(*args, **kwargs)
        error = self.storages.count_outputs(func, out, from_host)
        if error is not None:
            del out  # the traceback must not keep the refused outputs alive
            try:
                raise error
            finally:
                # A local naming the exception would make frame -> error -> traceback ->
                # frame a cycle, keeping every tensor of the failed attempt until gc runs.
                error = None
        return out


# ---------------------------------------------------------------- UntypedStorage.resize_
#
# A storage resize is no aten operator: it reaches the allocator without dispatch, so
# no mode sees it. While any counter is active, the method is replaced by one that
# tells every active counter before (the cap) and after (the new size).

_ACTIVE: list[LiveStorages] = []
_original_resize = None
_own_resize = False  # whether UntypedStorage defined resize_ itself (not inherited)


def _counted_resize(storage, size):
    for storages in list(_ACTIVE):
        error = storages.resize_requested(storage, int(size))
        if error is not None:
            raise error
    result = _original_resize(storage, size)
    for storages in list(_ACTIVE):
        storages.resized(storage)
    return result


def _install_resize_hook(storages: LiveStorages) -> None:
    global _original_resize, _own_resize
    if not _ACTIVE:
        _own_resize = "resize_" in vars(torch.UntypedStorage)
        _original_resize = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = _counted_resize
    _ACTIVE.append(storages)


def _remove_resize_hook(storages: LiveStorages) -> None:
    global _original_resize
    _ACTIVE.remove(storages)
    if not _ACTIVE and _original_resize is not None:
        if _own_resize:
            torch.UntypedStorage.resize_ = _original_resize
        else:
            del torch.UntypedStorage.resize_
        _original_resize = None
