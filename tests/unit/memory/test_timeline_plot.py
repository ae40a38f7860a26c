"""The timeline plot: a readable PNG of one step, and a clear error without matplotlib."""

from __future__ import annotations

import sys

import pytest
import torch
from tracker_helpers import build_llama, tracked_step

from memfit.errors import UsageError
from memfit.memory.plot import plot_timeline
from memfit.memory.tracker import MemoryTracker


def test_plot_writes_a_png_of_a_tracked_step(tmp_path):
    model = build_llama(layers=2)
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = MemoryTracker("cpu")
    tracker.attach(model, optimizer)
    with tracker:
        tracked_step(tracker, model, optimizer, torch.randint(0, 256, (2, 64)))
        tracker.end_step()
    path = plot_timeline(tracker.timeline(), tmp_path / "plots" / "memory.png", title="tiny llama")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_plot_of_an_empty_timeline_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no memory timeline"):
        plot_timeline([], tmp_path / "memory.png")


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    sample = (0, "forward", {"parameters": 1, "gradients": 0, "optimizer_states": 0, "activations": 0, "other": 0})
    with pytest.raises(UsageError, match="matplotlib"):
        plot_timeline([sample], tmp_path / "memory.png")
