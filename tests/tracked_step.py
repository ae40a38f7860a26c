"""One training step of a causal LM under memfit's tracker: the peak several technique tests compare."""

from __future__ import annotations

import torch


def tracked_step(model: torch.nn.Module, input_ids: torch.Tensor, tracker=None):
    """The tracker's report (StepMemory) of one forward (labels = the inputs) and backward of `model` on the CPU.

    `tracker`: a MemoryTracker the caller keeps to look inside the step (live tensors); a new one when None."""
    from memfit.memory.tracker import MemoryTracker

    tracker = tracker or MemoryTracker(torch.device("cpu"))
    tracker.attach(model)
    try:
        with tracker:
            with tracker.phase("forward"):
                loss = model(input_ids=input_ids, labels=input_ids).loss
            with tracker.phase("backward"):
                loss.backward()
            return tracker.end_step()
    finally:
        tracker.detach()
