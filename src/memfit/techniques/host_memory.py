"""Mark tensors that live in host memory on purpose, so memory accounting files them as host bytes.

Offloading code (activation offload, offloaded checkpoints, optimizer offload) keeps
copies of device tensors in host memory. The live-storage counter
(`memfit.memory.live_storage`) counts those as *host* bytes: they are not part of the
device peak and never count against an emulated `--memory-cap`. On CUDA it can tell
them apart by itself (a pinned CPU storage is a host copy); on a CPU-only machine the
"device" is the CPU too, so offloading code says which copies are host copies:

    from memfit.techniques.host_memory import host_allocations, mark_host

    with host_allocations():          # storages allocated inside are host memory
        saved = tensor.to("cpu", copy=True)

    mark_host(existing_cpu_tensor)    # or mark one after the fact (moves its bytes)

Both are cheap no-ops for the numerics and work whether or not a counter is running.
`host_allocations()` is the better of the two: the copy is filed as host memory the
moment it is made, so it can never trip the emulated cap on its way there.

This module imports nothing from memfit: it sits with the techniques that call it, and
memory accounting (which may import techniques, never the other way) reads it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["allocating_on_host", "empty_host_like", "host_allocations", "is_host_tensor", "is_marked_host",
           "mark_host", "mark_host_all"]

_state = threading.local()
# storage key (UntypedStorage._cdata) -> weak reference to the storage: the key alone
# could be reused by a later storage at the same address.
_marked: dict[int, weakref.ref] = {}
_listeners: weakref.WeakSet = weakref.WeakSet()


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    local = getattr(tensor, "_local_tensor", None)  # a DTensor: its shard is what is stored
    try:
        return (local if local is not None else tensor).untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """File `tensor`'s storage as host memory from now until it is freed; returns `tensor`.

    Running counters move its bytes from device to host at once.
    """
    storage = _storage(tensor)
    if storage is None:
        return tensor
    key = storage._cdata
    reference = _marked.get(key)
    if reference is not None and reference() is storage:
        return tensor
    _marked[key] = weakref.ref(storage, lambda ref, key=key: _forget(key, ref))
    for listener in list(_listeners):
        listener.storage_marked_host(storage, tensor)
    return tensor


def mark_host_all(tensors) -> None:
    """`mark_host` each tensor among `tensors` (other values are skipped): for tensors made outside
    `host_allocations`, e.g. an optimizer's state made from Python numbers."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            mark_host(tensor)


def empty_host_like(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty host tensor shaped like `tensor` (contiguous), filed as host memory.

    Filed both ways: allocated inside `host_allocations` for a counter running now, and
    marked for one that starts later (an optimizer is built before tracking starts).
    """
    with host_allocations():
        host = torch.empty(tensor.size(), dtype=tensor.dtype, device="cpu", pin_memory=pin)
    return mark_host(host)


def _forget(key: int, reference: weakref.ref) -> None:
    if _marked.get(key) is reference:
        del _marked[key]


def is_host_tensor(tensor: torch.Tensor) -> bool:
    """True if `tensor`'s storage is filed as host memory (`mark_host`); False for one without a plain storage."""
    storage = _storage(tensor)
    return storage is not None and is_marked_host(storage)


def is_marked_host(storage: torch.UntypedStorage) -> bool:
    """True if `storage` was marked with `mark_host` (and is still the storage marked)."""
    reference = _marked.get(storage._cdata)
    return reference is not None and reference() is storage


@contextmanager
def host_allocations() -> Iterator[None]:
    """Storages allocated inside (on this thread) are host memory: see the module docstring."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def allocating_on_host() -> bool:
    """True inside `host_allocations()` on this thread."""
    return getattr(_state, "depth", 0) > 0


def add_listener(listener) -> None:
    """Tell `listener.storage_marked_host(storage, tensor)` about later marks (held weakly)."""
    _listeners.add(listener)


def remove_listener(listener) -> None:
    _listeners.discard(listener)
