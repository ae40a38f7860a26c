"""A task whose loss is its own sum over whole samples: a preference pair, an online-RL completion.

Such a task counts one unit a sample (a pair, a completion), so the step divides the summed loss of its
micro-batches by the samples of the effective batch, and it runs its own `loss_sum` instead of memfit's causal loss,
handed every collated tensor beyond the model's rows (the reference's log-probabilities, advantages, ...) as keyword
arguments. memfit.tasks.preference and memfit.tasks.grpo build on it.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.tasks.base import LossFunction, Task

MODEL_ROWS = ("input_ids", "labels", "attention_mask", "position_ids")
"""Batch keys the step passes to the loss itself: what `loss_inputs` leaves out."""


class SampleLossTask(Task):
    """A task that counts samples and computes its loss sum itself (module docstring); subclasses write `loss_sum`."""

    def count(self, sample: dict) -> int:
        return 1

    def loss_function(self, default: LossFunction) -> LossFunction:
        return self.loss_sum

    def loss_inputs(self, batch: dict) -> dict[str, Any]:
        return {name: value for name, value in batch.items() if name not in MODEL_ROWS}

    def loss_sum(self, model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, chunk_size: int = 0, **inputs: Any) -> torch.Tensor:
        """The micro-batch's loss, summed over its samples (the step divides by the effective batch's)."""
        raise NotImplementedError
