"""A CPU run's host heap: freed blocks of a few MiB go back to the system instead of staying in the process.

On a CPU the device memory is the process's resident memory (RSS), and glibc's malloc decides how much of what a
step frees stays resident. A request of M_MMAP_THRESHOLD bytes or more gets a mapping of its own, unmapped when
freed; a smaller one comes from the heap, whose freed blocks stay in the process for reuse. The threshold starts at
128 KiB and rises, up to 32 MiB, each time a mapped block is freed, so after a step or two a small model's
activations, logit chunks and gradients all come from the heap, and the heap keeps the largest footprint any step's
fragmented layout needed: on the GRPO benchmark (a 22.9M-parameter Llama, docs/benchmarks.md) the process held
about 400 MiB more than its live tensors. A fixed threshold (setting one also stops the rise) gives every block of
that size back when it is freed.

Saves: on that benchmark the peak RSS fell from about 1,110 to 1,015 MiB with the 4 MiB default (`python
benchmarks/bench_grpo.py --only memfit --repeats 2`, with and without MALLOC_MMAP_THRESHOLD_=4194304 in the
environment: the same threshold; 2-core CPU, 2026-11-28, load 0.9). Costs: the system maps and zeroes the pages of
each new large block (1-3 % of that benchmark's steps/s; 1 MiB cost 15 %, which is why the default is 4 MiB).

Applies to a run on the CPU under glibc (Linux), set once when the run starts, for the rest of the process. The
environment's MALLOC_MMAP_THRESHOLD_ (glibc's own setting) wins; `--host-mmap-threshold 0` leaves glibc as it is.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger("memfit")

DEFAULT_HOST_MMAP_THRESHOLD = 4 << 20
"""Bytes from which a CPU run's host blocks are mapped by themselves (module docstring)."""
_M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number (malloc.h)."""


def bound_host_heap(device: torch.device, threshold: int | None) -> dict[str, object]:
    """Set glibc's mmap threshold for a run on `device` (`threshold`: bytes, None the default, 0 none); the start
    line's facts: `host_mmap_threshold` (bytes, or None where glibc decides) and, where none was set, why."""
    if device.type != "cpu":
        return {}
    wanted = DEFAULT_HOST_MMAP_THRESHOLD if threshold is None else int(threshold)
    why = _why_not(wanted)
    if why:
        return {"host_mmap_threshold": None, "host_mmap_threshold_reason": why}
    if not _glibc().mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(wanted)):
        return {"host_mmap_threshold": None, "host_mmap_threshold_reason": f"glibc refused {wanted} bytes"}
    log.info("memfit: host blocks of %d KiB and more are returned to the system when freed (--host-mmap-threshold)",
             wanted >> 10)
    return {"host_mmap_threshold": wanted}


def _why_not(wanted: int) -> str:
    if wanted <= 0:
        return "--host-mmap-threshold 0"
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return "MALLOC_MMAP_THRESHOLD_ is set in the environment"
    if _glibc() is None:
        return "the C library is not glibc"
    return ""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's own C library when it is glibc (its symbols, no search for the file), else None."""
    try:
        library = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(library, "gnu_get_libc_version") or not hasattr(library, "mallopt"):
        return None
    return library
