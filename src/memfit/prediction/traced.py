"""What the traced estimate asks and answers; the tracing itself lives in `memfit.train.traced`.

The traced estimate (`memfit estimate --method traced`) runs memfit's own training step
(`memfit.train.step.StepRunner`) on fake tensors under the memory tracker. The step
belongs to train/, which sits above memory/, so the estimator reaches it through a
tracer registered here: `memfit.train.traced` registers itself when imported, and the
CLI and `memfit.estimate` import it. A caller may also pass a tracer explicitly.

    from memfit.prediction.traced import StepSetup, step_tracer
    traced = step_tracer()(hf_config, config, StepSetup(...))   # -> TracedStep
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.memory.categories import CATEGORIES


@dataclass
class StepSetup:
    """The choices the step is traced with (resolved from a TrainConfig by the estimator)."""

    batch_size: int
    seq_len: int
    weight_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    attention: str  # transformers' attn_implementation
    checkpointing: str
    checkpoint_every: int
    loss_chunk_size: int
    device: torch.device


@dataclass
class TracedStep:
    """What one steady-state training step held at its peak, in the tracker's categories."""

    peak_bytes: int
    breakdown: dict[str, int]
    """Live device bytes per category (`memfit.memory.categories.CATEGORIES`) at the peak; they add up to it."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Peak live bytes within each phase: forward, backward, optimizer."""
    peak_phase: str = ""
    host_peak_bytes: int = 0
    """Host memory held on purpose (offloaded copies) at most during the step."""

    def __post_init__(self) -> None:
        self.breakdown = {category: int(self.breakdown.get(category, 0)) for category in CATEGORIES}


StepTracer = Callable[..., TracedStep]
"""tracer(hf_config, train_config, setup: StepSetup, fake: bool = True) -> TracedStep"""

_registered: StepTracer | None = None


def register_step_tracer(tracer: StepTracer) -> None:
    """Make `tracer` the one the traced estimate uses (memfit.train.traced does this on import)."""
    global _registered
    _registered = tracer


def step_tracer(explicit: StepTracer | None = None) -> StepTracer:
    """`explicit`, else the registered tracer.

    Raises:
        RuntimeError: none is registered (import memfit.train.traced first).
    """
    tracer: Any = explicit or _registered
    if tracer is None:
        raise RuntimeError(
            "the traced estimate runs memfit's training step: import memfit.train.traced first "
            "(the memfit CLI and memfit.estimate do)"
        )
    return tracer
