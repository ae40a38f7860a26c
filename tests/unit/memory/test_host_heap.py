"""A CPU run's host heap (memory/host_heap.py): large freed blocks go back to the system, and the run says so.

The effect is measured in a fresh interpreter: after glibc's threshold has risen (a 16 MiB block freed), twenty
8 MiB blocks with small live ones between them are freed; with the run's threshold their pages leave the process,
without it they stay resident (the control, which shows the measurement can fail).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from memfit.memory import host_heap

pytestmark = pytest.mark.skipif(host_heap._glibc() is None, reason="glibc's mallopt is Linux's")

FREED_BLOCKS = """
import sys
sys.path.insert(0, {src!r})
from memfit.memory.host_heap import bound_host_heap

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

class Cpu:
    type = "cpu"

if {bound}:
    print(bound_host_heap(Cpu(), None), file=sys.stderr)
block = bytearray(16 << 20)  # mapped, and freed: glibc's own threshold rises to 16 MiB
del block
before = resident()
blocks, small = [], []
for _ in range(20):
    blocks.append(bytearray(8 << 20))
    blocks[-1][::4096] = b"x" * 2048  # a byte a page: resident
    small.append(bytearray(b"y" * 4096))  # stays alive between them
del blocks
print((resident() - before) >> 20)
"""


def _resident_after_freeing(bound: bool) -> int:
    """MiB the process still holds after freeing 160 MiB of 8 MiB blocks."""
    src = str(__import__("pathlib").Path(host_heap.__file__).resolve().parents[2])
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_MMAP_THRESHOLD_ from the caller's environment
    result = subprocess.run([sys.executable, "-c", FREED_BLOCKS.format(src=src, bound=bound)], capture_output=True,
                            text=True, env=env, timeout=60, check=True)
    return int(result.stdout.strip())


def test_freed_large_blocks_leave_the_process_with_the_threshold_and_stay_without():
    bounded, default = _resident_after_freeing(True), _resident_after_freeing(False)
    print(f"resident after freeing 160 MiB: {bounded} MiB with the threshold, {default} MiB without")
    assert bounded < 20
    assert default > 100


def test_the_run_says_what_it_set_and_why_not(monkeypatch):
    calls = []

    class Glibc:
        def mallopt(self, parameter, value):
            calls.append((parameter, value.value))
            return 1

    monkeypatch.setattr(host_heap, "_glibc", lambda: Glibc())
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    cpu = torch.device("cpu")
    assert host_heap.bound_host_heap(cpu, None) == {"host_mmap_threshold": 4 << 20}
    assert host_heap.bound_host_heap(cpu, 8 << 20) == {"host_mmap_threshold": 8 << 20}
    assert calls == [(-3, 4 << 20), (-3, 8 << 20)]
    assert host_heap.bound_host_heap(cpu, 0)["host_mmap_threshold_reason"] == "--host-mmap-threshold 0"
    assert host_heap.bound_host_heap(torch.device("meta"), None) == {}  # not a CPU run: the device is elsewhere
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert "environment" in host_heap.bound_host_heap(cpu, None)["host_mmap_threshold_reason"]
    assert len(calls) == 2  # the user's setting and 0 set nothing
