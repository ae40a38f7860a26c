"""The memory a run's steps take: the allocator's peak of each step, and the live-tensor tracker's view.

    MemoryPeaks      each step's peak as the device reports it (CUDA's allocator, or the process's
                     resident set on a CPU): the step line's memory fields and the run's peak
    MemoryTracking   the memory tracker (memfit.memory.tracker) on every step (--track-memory, a
                     --memory-cap emulated on a CPU) or on one early step (train/memory_sample.py):
                     the step line's tracked fields, the summary's tracked peak and the memory record
                     that the HTML report draws (memory_timeline.json)
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.checkpoint_files import TrainerState
from memfit.memory.stats import memory_stats
from memfit.reporting.memory_record import run_memory_record, summary_fields, write_memory_record
from memfit.train.memory_sample import OneStepSample
from memfit.train.run_facts import run_facts
from memfit.train.step import StepRunner
from memfit.train.step_observer import FinishedStep, StepObserver


class MemoryPeaks(StepObserver):
    """Each step's peak memory as the device reports it (the loop resets the window before each step)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stats: dict[str, Any] = {}
        self.run_peak = 0

    def after_step(self, done: FinishedStep) -> None:
        # Read once the step is complete, evaluation included, and before the speed meter's fields: a step that
        # beats the matmul probe has it measured again, and those matmuls are no part of the step's peak.
        self.stats = memory_stats(self.device)
        self.run_peak = max(self.run_peak, self.stats.get("peak_memory_bytes") or 0)

    def record_fields(self, done: FinishedStep) -> dict[str, Any]:
        return dict(self.stats)

    def summary_fields(self) -> dict[str, Any]:
        return {"peak_memory_bytes": self.run_peak or None}


class MemoryTracking(StepObserver):
    """The live-tensor tracker's steps: every step with `tracker`, else the one step of `sample`, else none."""

    def __init__(self, session: Any, state: TrainerState, tracker: Any, sample: OneStepSample | None,
                 runner: StepRunner, evaluator: Any, save_outputs: bool):
        self.session = session
        self.state = state
        self.tracker = tracker
        self.sample = sample
        self.runner = runner
        self.evaluator = evaluator
        self.save_outputs = save_outputs
        self.sampled = False
        """Whether the step that runs now is the sample's one tracked step."""
        self.steps: list = []
        """The tracked memory of each tracked step (StepMemory)."""
        self.tracked_micro_batch: int | None = None
        """The micro-batch of the tracked steps (the estimate beside them is made for it)."""
        self.tracked_peak: int | None = None
        self.record: dict[str, Any] | None = None
        """The memory record of the run (what the report draws), once the summary is made."""

    def before_step(self, step: int) -> None:
        # The sample enters its tracker here, before the step's timed span, and hands it to the runner and the
        # evaluator: an evaluation after this step is the tracked step's "eval" phase.
        self.sampled = self.sample is not None and self.sample.begin(step, self.runner, self.evaluator)

    def record_fields(self, done: FinishedStep) -> dict[str, Any]:
        if self.tracker is None and not self.sampled:
            return {}
        # The step closes here, after the speed meter's fields: a measurement of the peak again is in its timeline.
        step_memory = (self.tracker or self.sample.tracker).end_step()
        self.steps.append(step_memory)
        self.tracked_micro_batch = done.result.micro_batch_size
        self.tracked_peak = max(self.tracked_peak or 0, step_memory.peak_bytes)
        if self.sampled:
            self.sample.end()  # later steps run untracked
        return {
            "tracked_peak_bytes": step_memory.peak_bytes,
            "tracked_breakdown": dict(step_memory.breakdown),
            "tracked_phase_peaks": {phase.name: phase.peak_bytes for phase in step_memory.phases},
        }

    def summary_fields(self) -> dict[str, Any]:
        session, steps = self.session, self.steps
        if steps and self.save_outputs and session.dist.is_main:  # what the HTML report draws of the tracker
            facts = {**run_facts(session), "last_step": self.state.step, "micro_batch_size": self.tracked_micro_batch,
                     "first_tracked_step": self.sample.step if self.sample is not None else None}
            self.record = run_memory_record(self.tracker or self.sample.tracker, steps, session.config, facts)
        return {
            "tracked_peak_bytes": self.tracked_peak,
            "tracked_breakdown": dict(max(steps, key=lambda m: m.peak_bytes).breakdown) if steps else None,
            "tracked_step": self.sample.step if self.sample is not None and steps else None,  # the default's one step
            **summary_fields(self.record),  # the estimate beside the tracked peak
        }

    def on_finish(self, summary: dict[str, Any]) -> None:
        if self.record is not None:
            write_memory_record(self.session.output_dir, self.record)
