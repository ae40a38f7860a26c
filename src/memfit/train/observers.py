"""The observers of a training run's steps, and the order the loop calls them in.

    FirstStepChecks   a --compile that ran eager, adapters on PEFT's path (train/first_step.py)
    ProgressDisplay   the console's bar or periodic lines (train/progress.py)
    EvaluationRuns    evaluation when due, its line after the step's (train/evaluation.py)
    SpeedFacts        MFU per step, the speed model beside the measured step, its calibration (train/speed.py)
    MemoryPeaks       the device's peak of each step (train/memory_observers.py)
    StepOutcomes      the step runner's events (OOM splits and escalations), skipped fp16 steps
    RunChangeLog      each change of what runs (`session.run.events`), once, with its step
    MemoryTracking    the live-tensor tracker's steps and the memory record (train/memory_observers.py)
    CheckpointSaves   saves every N steps or M minutes, and on preemption (train/saving.py)
    RunFactsLines     what really runs, in the start and summary lines

Each point of a step calls them in `RunObservers.in_step_order`; the start and summary lines list their
fields in `RunObservers.in_line_order`. The points are train/step_observer.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.checkpoint_files import TrainerState
from memfit.train.evaluation import EvalResult, Evaluator
from memfit.train.first_step import FirstStepChecks
from memfit.train.memory_observers import MemoryPeaks, MemoryTracking
from memfit.train.metrics import MetricLogger
from memfit.train.progress import Progress
from memfit.train.run_facts import run_facts
from memfit.train.saving import Saver
from memfit.train.speed import SpeedMeter
from memfit.train.step import StepRunner
from memfit.train.step_observer import FinishedStep, StepObserver


class ProgressDisplay(StepObserver):
    """The step's loss, the task's own measures, tokens per second and peak on the console, once its line is
    written."""

    def __init__(self, progress: Progress, task: Any):
        self.progress = progress
        self.task = task

    def after_record(self, done: FinishedStep, record: dict[str, Any]) -> None:
        self.progress.update(done.step, done.loss, record["tokens_per_second"], record.get("peak_memory_bytes"),
                             self.task.step_scores(record))


class EvaluationRuns(StepObserver):
    """Evaluation after the steps it is due at; its line (and --save-best) after the step's line."""

    def __init__(self, evaluator: Evaluator, logger: MetricLogger, progress: Progress):
        self.evaluator = evaluator
        self.logger = logger
        self.progress = progress
        self.pending: EvalResult | None = None
        """This step's evaluation, run but not yet published."""

    def after_step(self, done: FinishedStep) -> None:
        # Before the step's memory is read and its tracked step closes: evaluation's peak is this step's "eval" phase.
        self.pending = self.evaluator.maybe_run(done.step)

    def after_record(self, done: FinishedStep, record: dict[str, Any]) -> None:
        if self.pending is not None:
            self.evaluator.publish(self.pending, self.logger, self.progress)  # the eval line, trackers, --save-best
            self.pending = None

    def summary_fields(self) -> dict[str, Any]:
        return self.evaluator.summary()


class SpeedFacts(StepObserver):
    """MFU and HFU of each timed step, the speed model's step beside the measured one, and what a planned run
    teaches the speed model at its end (train/run_calibration.py)."""

    def __init__(self, session: Any, speed: SpeedMeter, untimed_step: int | None, calibrate: bool):
        self.session = session
        self.speed = speed
        self.untimed_step = untimed_step
        """The step the memory tracker samples: it runs a few times slower, so it stays out of MFU and the
        measured step."""
        self.calibrate = calibrate

    def on_start(self) -> dict[str, Any]:
        return self.speed.start_facts()

    def record_fields(self, done: FinishedStep) -> dict[str, Any]:
        if done.step == self.untimed_step:
            return {}
        return self.speed.step(done.tokens, done.seconds)

    def summary_fields(self) -> dict[str, Any]:
        return self.speed.summary()

    def on_finish(self, summary: dict[str, Any]) -> None:
        if self.calibrate:  # a planned run on this CPU teaches the speed model its measured step
            from memfit.train.run_calibration import learn_from_run

            learn_from_run(self.session, summary, self.speed.first_step_seconds)


class StepOutcomes(StepObserver):
    """What the step runner reports of each step: its events (OOM splits and escalations), in the metrics before
    the step's line, and the counts the summary gives."""

    def __init__(self, session: Any, logger: MetricLogger, runner: StepRunner):
        self.session = session
        self.logger = logger
        self.runner = runner
        self.skipped_steps = 0
        self.oom_events = 0

    def after_step(self, done: FinishedStep) -> None:
        self.skipped_steps += int(done.result.skipped)
        self.oom_events += sum(1 for event in done.result.events if event.get("event") == "oom")
        for event in done.result.events:
            self.logger.log({"step": done.step, **event})

    def record_fields(self, done: FinishedStep) -> dict[str, Any]:
        if self.session.scaler is None:
            return {}
        return {"skipped_steps": self.skipped_steps}  # fp16: the steps the grad scaler skipped so far

    def summary_fields(self) -> dict[str, Any]:
        return {"oom_events": self.oom_events, "micro_batch_size": self.runner.micro_batch_size,
                "skipped_steps": self.skipped_steps}


class RunChangeLog(StepObserver):
    """Each change of what runs after the start (`session.run.events`: an OOM escalation, compile falling back
    to eager) in the metrics, once, with the step it happened in: the run's lines then say when what ran changed."""

    def __init__(self, session: Any, logger: MetricLogger):
        self.session = session
        self.logger = logger
        self.logged = len(session.run.events)
        """How many of the run's events are accounted for: those of building the run precede the start line."""

    def after_step(self, done: FinishedStep) -> None:
        events = self.session.run.events
        for event in events[self.logged:]:
            self.logger.log({"step": done.step, **event.as_record()})
        self.logged = len(events)


class CheckpointSaves(StepObserver):
    """A checkpoint when one is due or a stop was asked, after the step's lines; the summary's save stalls."""

    def __init__(self, saver: Saver, state: TrainerState):
        self.saver = saver
        self.state = state

    def after_record(self, done: FinishedStep, record: dict[str, Any]) -> None:
        self.saver.after_step(self.state)  # every N steps or M minutes; on a preemption signal: save, then exit 75

    def summary_fields(self) -> dict[str, Any]:
        return self.saver.summary()


class RunFactsLines(StepObserver):
    """What really runs (train/run_facts.py), in the start line and again in the summary (fallbacks change)."""

    def __init__(self, session: Any):
        self.session = session

    def on_start(self) -> dict[str, Any]:
        return run_facts(self.session)

    def summary_fields(self) -> dict[str, Any]:
        return run_facts(self.session)


@dataclass
class RunObservers:
    """The observers of one run, by role; `evaluation` is None when the run does not evaluate."""

    first_step: FirstStepChecks
    progress: ProgressDisplay
    evaluation: EvaluationRuns | None
    speed: SpeedFacts
    memory_peaks: MemoryPeaks
    outcomes: StepOutcomes
    run_changes: RunChangeLog
    memory: MemoryTracking
    checkpoints: CheckpointSaves
    facts: RunFactsLines

    def in_step_order(self) -> list[StepObserver]:
        """The order each point of a step calls them in.

        After a step: evaluation runs before the memory is read (its peak is the step's), the memory before the
        speed meter's fields (which may time matmuls), the runner's events before the run's changes they caused.
        Once the line is written: the console, then the eval line, then a checkpoint (which may end the run).
        """
        return [observer for observer in (self.first_step, self.progress, self.evaluation, self.speed,
                                          self.memory_peaks, self.outcomes, self.run_changes, self.memory,
                                          self.checkpoints, self.facts) if observer is not None]

    def in_line_order(self) -> list[StepObserver]:
        """The order the start and summary lines list their fields in."""
        return [observer for observer in (self.memory_peaks, self.memory, self.outcomes, self.facts, self.speed,
                                          self.checkpoints, self.evaluation) if observer is not None]
