"""The training loop: a run read top to bottom as its phases, with observers called at fixed points of each step.

    train(config)
      resume   the checkpoint to continue from (--resume) or step 0; a resume that changes the run refused
      start    the step runner, the metrics, the observers; the start line
      steps    for each optimizer step:
                   observers.before_step                   the one early step the memory tracker samples
                   result = runner.run(samples)            micro-batches, exact accumulation, OOM recovery
                   scheduler.step(); the state counts it
                   observers.after_step                    first-step checks, evaluation, memory peaks, the
                                                           runner's events, changes of what runs
                   the step's line, with observers.record_fields (speed, memory, tracked memory), written
                   observers.after_record                  the console, the eval line, a checkpoint or preemption
      finish   the last checkpoint and the final model; the summary line with observers.summary_fields;
               observers.on_finish (speed calibration, the memory record)

The observers (train/observers.py, train/memory_observers.py, train/first_step.py) hold their own
state; train/step_observer.py names the points. Preemption signals are caught from the first step
through the final save. The loop never asks which engine runs (train/engine.py): resuming, saving
and the per-rank metrics are the engine's methods.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.checkpoint_files import TrainerState, resolve_resume
from memfit.config import TrainConfig
from memfit.memory.host_heap import bound_host_heap
from memfit.memory.stats import reset_peaks
from memfit.train.evaluation import Evaluator
from memfit.train.first_step import FirstStepChecks
from memfit.train.first_step import check_compiled as _check_compiled  # noqa: F401  (re-exported by its name here)
from memfit.train.memory_observers import MemoryPeaks, MemoryTracking
from memfit.train.memory_sample import OneStepSample
from memfit.train.metrics import MetricLogger, NullLogger, build_loggers
from memfit.train.observers import (
    CheckpointSaves,
    EvaluationRuns,
    ProgressDisplay,
    RunChangeLog,
    RunFactsLines,
    RunObservers,
    SpeedFacts,
    StepOutcomes,
)
from memfit.train.progress import Progress
from memfit.train.run_facts import run_facts  # noqa: F401  (re-exported: the facts the metrics lines give)
from memfit.train.saving import Saver, prepare_long_run, start_preemption
from memfit.train.setup import TrainingSession, build_session
from memfit.train.speed import SpeedMeter
from memfit.train.step import StepResult, StepRunner
from memfit.train.step_observer import FinishedStep

log = logging.getLogger("memfit")


@dataclass
class TrainResult:
    steps: int
    final_loss: float | None
    losses: list[float]
    output_dir: Path
    final_dir: Path | None
    peak_memory_bytes: int | None
    tracked_peak_bytes: int | None
    summary: dict[str, Any] = field(default_factory=dict)
    memory_steps: list = field(default_factory=list)
    """Tracked memory of each step (StepMemory), when the tracker ran."""


def make_logger(session: TrainingSession):
    if not session.dist.is_main:
        return NullLogger()
    return build_loggers(session.config, session.output_dir)  # metrics.jsonl and the --report-to trackers


def make_tracker(session: TrainingSession, always: bool = False):
    """The live-tensor tracker of every step, when asked for (or `always`) or when a memory cap must be emulated on CPU.

    Without --track-memory (and without --no-track-memory) the run tracks one early step instead
    (train.memory_sample): its report then shows the memory at the peak beside the estimate.
    """
    memory = session.config.memory
    cap = memory.memory_cap
    if session.device.type == "cuda" and cap is not None:
        from memfit.memory.cap import apply_memory_cap

        apply_memory_cap(session.device, cap)
        cap = None  # the CUDA allocator enforces it
    if not (memory.track_memory or always) and cap is None:
        return None
    from memfit.memory.tracker import MemoryTracker

    tracker = MemoryTracker(session.device, cap_bytes=cap)
    tracker.attach(session.model, session.optimizer)
    return tracker


def train(
    config: TrainConfig, session: TrainingSession | None = None, tracker: Any = None, save_outputs: bool = True
) -> TrainResult:
    """Train as `config` says; return losses, where the model went and the peak memory.

    `session` and `tracker` let `memfit profile` and tests reuse a prepared run;
    `save_outputs=False` writes no metrics, checkpoints or final model (profiling).
    """
    session = session or build_session(config)
    session.model.train()
    start = _resume(session, save_outputs)
    parts = _start(session, start, tracker, save_outputs)
    # Preemption signals are caught from the first step through the final save: a signal after the last
    # step lets the final checkpoint and model finish (the run ends normally) instead of killing the save.
    with parts.saver.preemption:
        with contextlib.ExitStack() as during_steps:
            for context in parts.step_contexts:
                during_steps.enter_context(context)
            _take_steps(session, start, parts)
        wall = time.perf_counter() - parts.started
        parts.saver.finish()  # a background write in flight completes (or raises) before the final save
        final_dir = _save_final(session, start.state) if save_outputs else None
    return _finish(session, start, parts, wall, final_dir)


@dataclass
class _StartPoint:
    """Where this launch starts: what the resume phase found."""

    state: TrainerState
    """The run's state (a checkpoint's when resumed); each step is counted into it, and checkpoints save it."""
    resume_from: Path | None
    micro_batch_size: int
    first_step: int
    """The steps done before this launch (0 for a new run)."""
    losses: list[float] = field(default_factory=list)
    """This launch's loss of each step, the mean over ranks."""


@dataclass
class _RunParts:
    """What the steps and the finish run with, made by the start phase."""

    runner: StepRunner
    logger: MetricLogger
    saver: Saver
    observers: RunObservers
    step_contexts: list[Any]
    """Entered in order around the steps (the memory tracker, the console, activation offload, fatal OOM)."""
    started: float
    """When the steps began (time.perf_counter), for the summary's wall time."""


def _resume(session: TrainingSession, save_outputs: bool) -> _StartPoint:
    """The resume phase: the checkpoint --resume names (its state and micro-batch), or a new run at step 0."""
    config = session.config
    resume_from = resolve_resume(config.output.resume, config.output.output_dir)
    state = TrainerState(step=0)
    micro_batch_size = config.training.batch_size
    if resume_from is not None:
        state = session.engine.load_checkpoint(resume_from, session.scheduler)
        if state.micro_batch_size:
            micro_batch_size = min(micro_batch_size, state.micro_batch_size)  # do not repeat an OOM
        if session.dist.is_main:
            log.info("memfit: resumed from %s at step %d (micro-batch %d)", resume_from, state.step, micro_batch_size)
    # A resume that changes the run, a disk too small for the checkpoints: refused before the first step.
    state.extra["run"] = prepare_long_run(session, resume_from, state.step, save_outputs)
    return _StartPoint(state, resume_from, micro_batch_size, first_step=state.step)


def _start(session: TrainingSession, start: _StartPoint, tracker: Any, save_outputs: bool) -> _RunParts:
    """The start phase: the output directory, the memory tracker, the step runner and the observers; the start
    line of the metrics."""
    if session.dist.is_main and save_outputs:
        session.output_dir.mkdir(parents=True, exist_ok=True)
    tracker = tracker if tracker is not None else make_tracker(session)
    # Without a tracker on every step, the default tracks one early step (train/memory_sample.py) for the report.
    sample = OneStepSample.for_run(session, start.state.step, save_outputs) if tracker is None else None
    logger = make_logger(session) if save_outputs else NullLogger()
    runner = StepRunner.from_session(session, tracker=tracker, micro_batch_size=start.micro_batch_size)
    describe_run(session, start.micro_batch_size)
    speed = SpeedMeter.from_session(session)  # MFU per step; the planner's step time beside the measured one
    resumed = start.resume_from is not None
    evaluator = Evaluator.from_session(session, runner, tracker, resumed=resumed) if save_outputs else None
    saver = Saver(session, logger, start_preemption(session, save_outputs), enabled=save_outputs)  # train/saving.py
    progress = Progress(session.total_steps, start.state.step, session.config.output.log_every,
                        enabled=session.dist.is_main)
    observers = RunObservers(
        first_step=FirstStepChecks(session, logger, tracked=tracker is not None),
        progress=ProgressDisplay(progress, session.task),
        evaluation=EvaluationRuns(evaluator, logger, progress) if evaluator is not None else None,
        speed=SpeedFacts(session, speed, sample.step if sample is not None else None, calibrate=save_outputs),
        memory_peaks=MemoryPeaks(session.device),
        outcomes=StepOutcomes(session, logger, runner),
        run_changes=RunChangeLog(session, logger),
        memory=MemoryTracking(session, start.state, tracker, sample, runner, evaluator, save_outputs),
        checkpoints=CheckpointSaves(saver, start.state),
        facts=RunFactsLines(session),
    )
    start_fields = {name: value for observer in observers.in_line_order() for name, value in observer.on_start().items()}
    start_fields |= bound_host_heap(session.device, session.config.memory.host_mmap_threshold)  # CPU runs only
    logger.log({"event": "start", **start_fields, "resumed_from": str(start.resume_from) if resumed else None})
    contexts = [tracker if tracker is not None else contextlib.nullcontext(), progress,
                _activation_offload_context(session), _oom_is_fatal(runner, session.config),
                sample if sample is not None else contextlib.nullcontext()]
    return _RunParts(runner, logger, saver, observers, contexts, started=time.perf_counter())


def _take_steps(session: TrainingSession, start: _StartPoint, parts: _RunParts) -> None:
    """The steps phase: each optimizer step left to run, with the observers called at their points."""
    observers = parts.observers.in_step_order()
    session.task.step_metrics()  # forget what losses computed before the first step (probes) would have added
    on_policy = session.task.prepares_on_policy  # online RL: a step's samples are generated by the model it trains
    upcoming = None if on_policy else _samples_of(session, start.state.step)
    for step in range(start.state.step, session.total_steps):
        for observer in observers:
            observer.before_step(step + 1)
        reset_peaks(session.device)
        step_started = time.perf_counter()
        # The next step's samples are fetched now so its first micro-batch is prepared during this step.
        samples, upcoming = (_samples_of(session, step), None) if on_policy else (upcoming, _samples_of(session, step + 1))
        result = parts.runner.run(samples, next_samples=upcoming)
        session.scheduler.step()
        done = _count_step(session, start, parts.runner, result, time.perf_counter() - step_started)
        for observer in observers:
            observer.after_step(done)
        record = _step_line(session, done)
        record.update(session.task.step_metrics())  # the task's own (a preference task's rewards/*, logps/*)
        for observer in observers:
            record.update(observer.record_fields(done))
        record.update(session.engine.step_metrics(record))  # every rank takes part
        parts.logger.log(record)
        for observer in observers:
            observer.after_record(done, record)


def _count_step(session: TrainingSession, start: _StartPoint, runner: StepRunner, result: StepResult,
                seconds: float) -> FinishedStep:
    """Count a completed step into the run's state and this launch's losses; the step as the observers see it."""
    # Data-parallel groups: the ranks of a context group share their samples, and their losses sum to the samples'.
    state, world_size = start.state, session.dist.data_world_size
    state.step += 1
    state.tokens_seen += result.input_tokens * world_size
    state.micro_batch_size = runner.micro_batch_size
    loss = session.dist.all_reduce_sum(result.loss) / world_size
    start.losses.append(loss)
    return FinishedStep(step=state.step, result=result, loss=loss, tokens=result.input_tokens * world_size,
                        seconds=seconds, is_first=state.step == start.first_step + 1)


def _step_line(session: TrainingSession, done: FinishedStep) -> dict[str, Any]:
    """The fields of a step's metrics line that the step itself gives; the observers add theirs after them."""
    result, world_size = done.result, session.dist.data_world_size
    return {
        "step": done.step,
        "loss": done.loss,
        "lr": session.scheduler.get_last_lr()[0],
        "grad_norm": result.grad_norm,
        "tokens": done.tokens,
        "padding_tokens": (result.padded_positions - result.input_tokens) * world_size,
        "tokens_per_second": done.tokens / max(done.seconds, 1e-9),
        "micro_batch_size": result.micro_batch_size,
        "gradient_accumulation_steps": result.accumulation_steps,
        "precision": session.precision.name,
        "optimizer": session.optimizer_name,
        "attention": session.attention.implementation,
    }


def _finish(session: TrainingSession, start: _StartPoint, parts: _RunParts, wall: float,
            final_dir: Path | None) -> TrainResult:
    """The finish phase, after the final save: the summary line, then what the observers keep of the run."""
    summary = {"event": "summary", **_launch_summary(session, start, wall)}
    for observer in parts.observers.in_line_order():
        summary.update(observer.summary_fields())
    summary.update(session.engine.summary_metrics(summary))
    parts.logger.log(summary)
    parts.logger.close()
    for observer in parts.observers.in_step_order():
        observer.on_finish(summary)
    memory = parts.observers.memory
    return TrainResult(
        start.state.step, summary["final_loss"], start.losses, session.output_dir, final_dir,
        summary["peak_memory_bytes"], memory.tracked_peak, summary, memory.steps,
    )


def _launch_summary(session: TrainingSession, start: _StartPoint, wall: float) -> dict[str, Any]:
    """The summary's fields of the steps and losses (the observers' come after them)."""
    state, losses = start.state, start.losses
    resumed = start.resume_from is not None and bool(losses)
    return {
        "steps": state.step,
        "final_loss": losses[-1] if losses else None,
        # The run's first loss (step 1), also after a resume: the metrics file of the run holds it (None if it is gone).
        "first_loss": (_first_loss_of_run(session) if resumed else losses[0]) if losses else None,
        **({"resumed_at_step": start.first_step, "launch_first_loss": losses[0]} if resumed else {}),
        "tokens_seen": state.tokens_seen,
        "wall_seconds": round(wall, 3),
    }


def _first_loss_of_run(session: TrainingSession) -> float | None:
    """The loss of step 1 of a resumed run, from the run's metrics file (the last step-1 line: that run's); None if gone."""
    from memfit.reporting.run_data import read_jsonl

    output = session.config.output
    path = Path(output.log_file) if output.log_file else Path(session.output_dir) / "metrics.jsonl"
    if not session.dist.is_main or not path.is_file():
        return None
    found = None
    for record in read_jsonl(path):
        if record.get("event") is None and record.get("step") == 1 and isinstance(record.get("loss"), (int, float)):
            found = float(record["loss"])
    return found


def _samples_of(session: TrainingSession, step: int) -> list[dict] | None:
    """The samples of optimizer step `step` (None past the last step)."""
    if step >= session.total_steps:
        return None
    indices = session.schedule.batch_indices(step)
    # The task prepares them for this step (masked LM: masks drawn from the seed, the step and each sample's index).
    return session.task.prepare([session.dataset[i] for i in indices], indices, step)


def _save_final(session: TrainingSession, state: TrainerState) -> Path | None:
    """The last checkpoint and the final model (every rank takes part; the engine decides who writes)."""
    engine = session.engine
    engine.save_checkpoint(session.output_dir, state, session.scheduler, session.config.to_dict())
    final_dir = engine.save_final_model(session.output_dir / "final", session.loaded.tokenizer)
    if session.config.lora.merge_adapter and session.dist.is_main:
        from memfit.techniques.lora_merge import merge_and_save

        merge_and_save(session.model, session.output_dir / "merged")
    return final_dir


@contextlib.contextmanager
def _oom_is_fatal(runner: StepRunner, config: TrainConfig):
    """An OOM the step runner could not recover from ends the run with exit code 3 and one line."""
    from memfit.errors import DoesNotFitError
    from memfit.memory.cap import is_out_of_memory

    try:
        yield
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        if runner.oom_recovery:
            advice = "it happened outside a training step"
        elif config.memory.oom_recovery and config.memory.optimizer_in_backward:
            advice = "OOM recovery cannot split micro-batches under --optimizer-in-backward (each backward applies an update)"
        elif config.memory.oom_recovery:
            advice = "OOM recovery is not possible under this sharding engine (ranks exchange shards mid-pass)"
        else:
            advice = "OOM recovery is off (--no-oom-recovery)"
        raise DoesNotFitError(
            f"out of memory at micro-batch {runner.micro_batch_size} ({first}); {advice}; lower --batch-size or --seq-len,"
            " or see memfit plan for what fits"
        ) from None


def _activation_offload_context(session: TrainingSession):
    if not session.run.activation_offload:
        return contextlib.nullcontext()
    from memfit.techniques.offload import activation_offload

    context, reason = activation_offload(session.device, model=session.model,
                                         blocks=session.run.activation_offload_blocks)
    if reason:
        session.fallbacks["activation_offload"] = reason
    return context


def describe_run(session: TrainingSession, micro_batch_size: int) -> None:
    if not session.dist.is_main:
        return
    config = session.config
    params = sum(p.numel() for p in session.model.parameters())
    trainable = sum(p.numel() for p in session.model.parameters() if p.requires_grad)
    log.info("memfit: model %s: %.2fM parameters (%.2fM trainable)", session.loaded.source, params / 1e6, trainable / 1e6)
    log.info("memfit: data %s", session.dataset.description)
    log.info(
        "memfit: %d steps x %d samples (micro-batch %d x %d accumulation x %d ranks) of %d tokens on %s",
        session.total_steps,
        session.effective_batch_size,
        micro_batch_size,
        session.accumulation_steps,
        session.dist.world_size,
        config.data.seq_len,
        session.device,
    )
    log.info(
        "memfit: precision %s | optimizer %s | attention %s | checkpointing %s | loss chunk %s",
        session.precision.name,
        session.optimizer_name,
        session.attention.implementation,
        session.checkpointing,
        session.run.loss_chunk_size or "off",
    )
    for technique, fallback in session.fallbacks.items():
        log.warning("memfit: %s: %s", technique, fallback)
