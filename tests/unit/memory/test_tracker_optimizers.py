"""Optimizer state is optimizer state, however the optimizer is organised."""

from __future__ import annotations

import torch

from memfit.memory.tracker import MemoryTracker
from memfit.techniques.optimizer_in_backward import OptimizerInBackward


def test_per_parameter_optimizers_state_counts_as_optimizer_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = OptimizerInBackward(model, lambda params: torch.optim.AdamW(params, foreach=False))
    tracker = MemoryTracker(torch.device("cpu"))
    tracker.attach(model, optimizer)
    with tracker:
        with tracker.phase("backward"):
            model(torch.randn(4, 64)).sum().backward()
        step = tracker.end_step()
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    step_counters = 4 * sum(1 for _ in model.parameters())  # one fp32 step tensor per parameter
    assert step.live_breakdown_at_end["optimizer_states"] == 2 * parameter_bytes + step_counters
    assert step.live_breakdown_at_end["gradients"] == 0  # freed as soon as each parameter is updated
