"""A memory cap: behave as if the device had only so much memory (`--memory-cap`).

On CUDA the caching allocator enforces the cap itself (`apply_memory_cap`), so the
real out-of-memory error comes from PyTorch. On the CPU nothing stops an allocation
short of the machine's RAM, so the live-storage counter (`memfit.memory.live_storage`,
under `MemoryTracker(cap_bytes=...)`) enforces the cap through `refuse_over_cap`, the one
place the decision is made: it raises `torch.OutOfMemoryError` at the first operator (or
storage resize) whose new bytes would take the live *device* bytes past the cap. Host
copies made by offloading (`memfit.techniques.host_memory`) never count against it. Either way the caller sees the
same exception type, and `is_out_of_memory` recognizes both.
"""

from __future__ import annotations

import torch

from memfit.errors import UsageError
from memfit.units import format_bytes

# The message the CPU allocator puts in the RuntimeError it raises when malloc fails.
_CPU_ALLOCATOR_OOM = "DefaultCPUAllocator: can't allocate memory"


def cap_exceeded_error(requested_bytes: int, live_bytes: int, cap_bytes: int) -> torch.OutOfMemoryError:
    """The error the tracker raises when an allocation would pass the emulated cap."""
    return torch.OutOfMemoryError(
        f"memfit memory cap: tried to allocate {format_bytes(requested_bytes)} with "
        f"{format_bytes(live_bytes)} live; cap is {format_bytes(cap_bytes)} (--memory-cap)"
    )


def refuse_over_cap(requested_bytes: int, live_bytes: int, cap_bytes: int | None) -> torch.OutOfMemoryError | None:
    """The cap error if `requested_bytes` more device bytes would pass `cap_bytes`, else None.

    Returns the error rather than raising it so the caller can drop what the refused
    operator made before raising (nothing of a refused attempt stays counted).
    """
    if cap_bytes is None or requested_bytes <= 0 or live_bytes + requested_bytes <= cap_bytes:
        return None
    return cap_exceeded_error(requested_bytes, live_bytes, cap_bytes)


def is_out_of_memory(exc: BaseException) -> bool:
    """True if `exc` means the device ran out of memory (real or emulated cap).

    Recognizes `torch.OutOfMemoryError` (CUDA, and memfit's emulated cap) and the
    `RuntimeError` the CPU allocator raises when the machine's RAM runs out.
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    # The CPU allocator has no exception type of its own: only its message says OOM.
    return isinstance(exc, RuntimeError) and _CPU_ALLOCATOR_OOM in str(exc)


def apply_memory_cap(device: torch.device | str, cap_bytes: int | None) -> float | None:
    """Limit the CUDA caching allocator of `device` to `cap_bytes`; returns the fraction set.

    On CUDA this calls `torch.cuda.set_per_process_memory_fraction(cap / total)`, so
    allocations past the cap raise `torch.OutOfMemoryError` (the cap covers what the
    allocator reserves, cache and fragmentation included). On other devices it does
    nothing and returns None: give the cap to `MemoryTracker(cap_bytes=...)` instead.
    `cap_bytes=None` removes a CUDA cap.

    Raises:
        UsageError: the cap is larger than the GPU's memory.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if cap_bytes is None:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        return 1.0
    total = torch.cuda.get_device_properties(index).total_memory
    if cap_bytes > total:
        raise UsageError(
            f"--memory-cap {format_bytes(cap_bytes)} is more than the {format_bytes(total)} "
            f"this GPU has; give a smaller cap or leave it out"
        )
    fraction = cap_bytes / total
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction
