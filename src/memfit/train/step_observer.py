"""The points of a run where the training loop calls its observers, and what it hands them.

Everything that watches the steps (the console's progress, evaluation, checkpoint saves, the speed facts,
the memory peaks and the live-tensor tracker, the events of each step and of the run, the checks after the
first step) is a `StepObserver` that holds its own state; the loop (train/loop.py) calls every observer at
each point, in the order `RunObservers` (train/observers.py) gives:

    on_start()                   before the first step: fields of the metrics' start line
    before_step(step)            before the step runs, outside its timed span
    after_step(done)             the step is complete: the scheduler stepped, the run's state counts it
    record_fields(done)          fields of the step's metrics line (merged in order)
    after_record(done, record)   the line is written: show it, publish an evaluation, save a checkpoint
    summary_fields()             after the final save: fields of the summary line
    on_finish(summary)           the summary is written: what outlives the run (calibration, memory record)

Each point does nothing unless an observer overrides it, so an observer names only the points it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.train.step import StepResult


@dataclass(frozen=True)
class FinishedStep:
    """One completed optimizer step, as the loop hands it to the observers."""

    step: int
    """Its number, 1-based as in the metrics; the run's state counts it already."""
    result: StepResult
    """What the step runner returned: this rank's loss and tokens, the micro-batch, the OOM events."""
    loss: float
    """The step's loss, the mean over ranks."""
    tokens: int
    """Input tokens of all ranks."""
    seconds: float
    """Its wall time: the passes, the update and the scheduler's step."""
    is_first: bool
    """Whether it is the first step of this launch (after a resume: the first one it runs)."""


class StepObserver:
    """Something the loop calls at the points of a run (see the module's docstring), holding its own state."""

    def on_start(self) -> dict[str, Any]:
        """Before the first step: fields of the metrics' start line."""
        return {}

    def before_step(self, step: int) -> None:
        """Before optimizer step `step` (1-based) runs, outside its timed span."""

    def after_step(self, done: FinishedStep) -> None:
        """The step is complete; its metrics line is not built yet."""

    def record_fields(self, done: FinishedStep) -> dict[str, Any]:
        """Fields of the step's metrics line."""
        return {}

    def after_record(self, done: FinishedStep, record: dict[str, Any]) -> None:
        """The step's metrics line (`record`) is written."""

    def summary_fields(self) -> dict[str, Any]:
        """After the final save: fields of the summary line."""
        return {}

    def on_finish(self, summary: dict[str, Any]) -> None:
        """The summary line is written and the metrics closed."""
