"""Helpers of the memory tracker tests: tiny Llama models and one tracked training step.

(A plain module, not a conftest.py: other test folders import their own `conftest`.)
"""

from __future__ import annotations

import contextlib

import torch


def build_llama(layers: int = 2, hidden: int = 64, vocab: int = 256, intermediate: int | None = None):
    """A randomly initialized Llama built from a config (nothing is downloaded)."""
    from tiny_llama import tiny_llama

    model = tiny_llama(layers=layers, hidden=hidden, vocab=vocab, intermediate=intermediate, max_positions=2048)
    model.train()
    return model


def tracked_step(tracker, model, optimizer, input_ids, autocast: bool = False) -> torch.Tensor:
    """One training step with the phases the loop uses; returns the detached loss."""
    precision = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with tracker.phase("forward"), precision:
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    with tracker.phase("backward"):
        loss.backward()
    if optimizer is not None:
        with tracker.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return loss.detach()
