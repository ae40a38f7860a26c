"""Process and device memory statistics: the one place memfit reads peaks from.

On CUDA: allocator peaks (allocated, reserved), % of capacity, allocator retries and OOM
count since the last reset. On CPU: the process's peak resident set (VmHWM), reset per
step by writing 5 to /proc/self/clear_refs where the kernel allows it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_peak_rss_bytes() -> int | None:
    """High-water mark of the process's resident memory (Linux), or None elsewhere."""
    value = _status_bytes("VmHWM")
    if value is None:
        try:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        except (ImportError, OSError):
            return None
    return value


def process_rss_bytes() -> int | None:
    return _status_bytes("VmRSS")


def reset_process_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open(_CLEAR_REFS, "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def reset_peaks(device: torch.device) -> None:
    """Start a new measurement window (call at the start of each step)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_process_peak()


def memory_stats(device: torch.device) -> dict[str, float | int | None]:
    """Peaks since the last reset_peaks, in bytes (and % of capacity on CUDA)."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        capacity = torch.cuda.get_device_properties(device).total_memory
        peak_allocated = stats.get("allocated_bytes.all.peak", 0)
        peak_reserved = stats.get("reserved_bytes.all.peak", 0)
        return {
            "peak_memory_bytes": peak_allocated,
            "peak_allocated_bytes": peak_allocated,
            "peak_reserved_bytes": peak_reserved,
            "peak_reserved_pct": round(100.0 * peak_reserved / capacity, 2),
            # The allocator counts these since the process started: report what the last window added.
            "alloc_retries": _since_last_call(device, "num_alloc_retries", stats.get("num_alloc_retries", 0)),
            "num_ooms": _since_last_call(device, "num_ooms", stats.get("num_ooms", 0)),
        }
    return {"peak_memory_bytes": process_peak_rss_bytes(), "rss_bytes": process_rss_bytes()}


_LAST_COUNTS: dict[tuple[str, str], int] = {}


def _since_last_call(device: torch.device, counter: str, total: int) -> int:
    key = (str(device), counter)
    previous = _LAST_COUNTS.get(key, 0)
    _LAST_COUNTS[key] = total
    return total - previous


def configure_cuda_allocator() -> str | None:
    """Use expandable segments unless the user configured the allocator (less fragmentation).

    Must run before CUDA is initialised; returns what was set, or None.
    """
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return None
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return "expandable_segments:True"
