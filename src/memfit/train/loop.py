"""The training loop: one readable loop over optimizer steps.

    session = build_session(config)          # engine, model, techniques, optimizer, data
    runner = StepRunner.from_session(session)
    for step in steps:
        samples = effective batch of this step   # depends only on seed and effective batch
        result = runner.run(samples)             # micro-batches, exact accumulation, OOM recovery
        scheduler.step(); log metrics; maybe engine.save_checkpoint
    engine.save_checkpoint; engine.save_final_model

The loop never asks which engine runs (train/engine.py): resuming, saving and the
per-rank metrics are the engine's methods.
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
from memfit.data.samples import dataset_facts
from memfit.memory.stats import memory_stats, reset_peaks
from memfit.reporting.memory_record import run_memory_record, summary_fields, write_memory_record
from memfit.resolution.resolve import report as run_report
from memfit.techniques.packed_attention import packing_facts
from memfit.train.evaluation import Evaluator
from memfit.train.memory_sample import OneStepSample
from memfit.train.metrics import NullLogger, build_loggers
from memfit.train.progress import Progress
from memfit.train.saving import Saver, prepare_long_run, start_preemption
from memfit.train.setup import TrainingSession, build_session
from memfit.train.speed import SpeedMeter
from memfit.train.step import StepRunner

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
    config = session.config
    engine = session.engine
    model = session.model
    model.train()
    resume_from = resolve_resume(config.output.resume, config.output.output_dir)
    state = TrainerState(step=0)
    micro_batch_size = config.training.batch_size
    if resume_from is not None:
        state = engine.load_checkpoint(resume_from, session.scheduler)
        if state.micro_batch_size:
            micro_batch_size = min(micro_batch_size, state.micro_batch_size)  # do not repeat an OOM
        if session.dist.is_main:
            log.info("memfit: resumed from %s at step %d (micro-batch %d)", resume_from, state.step, micro_batch_size)
    # A resume that changes the run, a disk too small for the checkpoints: refused before the first step.
    state.extra["run"] = prepare_long_run(session, resume_from, state.step, save_outputs)

    if session.dist.is_main and save_outputs:
        session.output_dir.mkdir(parents=True, exist_ok=True)
    tracker = tracker if tracker is not None else make_tracker(session)
    # Without a tracker on every step, the default tracks one early step (train/memory_sample.py) for the report.
    sample = OneStepSample.for_run(session, state.step, save_outputs) if tracker is None else None
    logger = make_logger(session) if save_outputs else NullLogger()
    runner = StepRunner.from_session(session, tracker=tracker, micro_batch_size=micro_batch_size)
    describe_run(session, micro_batch_size)
    speed = SpeedMeter.from_session(session)  # MFU per step; the planner's step time beside the measured one
    evaluator = Evaluator.from_session(session, runner, tracker, resumed=resume_from is not None) if save_outputs else None
    saver = Saver(session, logger, start_preemption(session, save_outputs), enabled=save_outputs)  # train/saving.py
    logger.log({"event": "start", **run_facts(session), **speed.start_facts(),
                "resumed_from": str(resume_from) if resume_from else None})

    losses: list[float] = []
    memory_steps: list = []
    tracked_micro_batch = None  # the micro-batch of the tracked steps (the estimate beside them is made for it)
    skipped_steps = 0
    oom_events = 0
    run_peak = 0
    tracked_peak = None
    world_size = session.dist.world_size
    progress = Progress(session.total_steps, state.step, config.output.log_every, enabled=session.dist.is_main)
    activation_offload = _activation_offload_context(session)
    started = time.perf_counter()
    # Preemption signals are caught from the first step through the final save: a signal after the last
    # step lets the final checkpoint and model finish (the run ends normally) instead of killing the save.
    with saver.preemption:
        with (tracker if tracker is not None else contextlib.nullcontext(), progress, activation_offload,
              _oom_is_fatal(runner, config), sample if sample is not None else contextlib.nullcontext()):
            upcoming = _samples_of(session, state.step)
            first_step = state.step
            for step in range(state.step, session.total_steps):
                sampled = sample is not None and sample.begin(step + 1, runner, evaluator)  # the one tracked step
                reset_peaks(session.device)
                step_started = time.perf_counter()
                # The next step's samples are fetched now so its first micro-batch is prepared during this step.
                samples, upcoming = upcoming, _samples_of(session, step + 1)
                result = runner.run(samples, next_samples=upcoming)
                if step == first_step:
                    _check_compiled(session, logger, tracker is not None)
                    _check_efficient_lora(session, logger)
                session.scheduler.step()
                elapsed = time.perf_counter() - step_started
                state.step = step + 1
                state.tokens_seen += result.input_tokens * world_size
                state.micro_batch_size = runner.micro_batch_size
                # Before the tracker closes the step: evaluation's peak is this step's "eval" phase.
                evaluation = evaluator.maybe_run(state.step) if evaluator is not None else None
                skipped_steps += int(result.skipped)
                oom_events += sum(1 for event in result.events if event.get("event") == "oom")
                for event in result.events:
                    logger.log({"step": state.step, **event})
                loss = session.dist.all_reduce_sum(result.loss) / world_size
                losses.append(loss)
                stats = memory_stats(session.device)
                run_peak = max(run_peak, stats.get("peak_memory_bytes") or 0)
                record = {
                    "step": state.step,
                    "loss": loss,
                    "lr": session.scheduler.get_last_lr()[0],
                    "grad_norm": result.grad_norm,
                    "tokens": result.input_tokens * world_size,
                    "padding_tokens": (result.padded_positions - result.input_tokens) * world_size,
                    "tokens_per_second": result.input_tokens * world_size / max(elapsed, 1e-9),
                    "micro_batch_size": result.micro_batch_size,
                    "gradient_accumulation_steps": result.accumulation_steps,
                    "precision": session.precision.name,
                    "optimizer": session.optimizer_name,
                    "attention": session.attention.implementation,
                    # The tracked step runs a few times slower: its time stays out of MFU and the measured step.
                    **(speed.step(result.input_tokens * world_size, elapsed) if not sampled else {}),
                    **stats,
                }
                if session.scaler is not None:
                    record["skipped_steps"] = skipped_steps
                if tracker is not None or sampled:
                    step_memory = (tracker or sample.tracker).end_step()
                    memory_steps.append(step_memory)
                    tracked_micro_batch = result.micro_batch_size
                    tracked_peak = max(tracked_peak or 0, step_memory.peak_bytes)
                    record["tracked_peak_bytes"] = step_memory.peak_bytes
                    record["tracked_breakdown"] = dict(step_memory.breakdown)
                    record["tracked_phase_peaks"] = {phase.name: phase.peak_bytes for phase in step_memory.phases}
                record.update(engine.step_metrics(record))  # every rank takes part
                logger.log(record)
                progress.update(state.step, loss, record["tokens_per_second"], stats.get("peak_memory_bytes"))
                if sampled:
                    sample.end()  # later steps run untracked
                if evaluation is not None:
                    evaluator.publish(evaluation, logger, progress)  # the eval line, trackers, --save-best
                saver.after_step(state)  # every N steps or M minutes; on a preemption signal: save, then exit 75
        wall = time.perf_counter() - started
        saver.finish()  # a background write in flight completes (or raises) before the final save
        final_dir = _save_final(session, state) if save_outputs else None
    memory_record = None
    if memory_steps and save_outputs and session.dist.is_main:  # what the HTML report draws of the tracker
        facts = {**run_facts(session), "last_step": state.step, "micro_batch_size": tracked_micro_batch,
                 "first_tracked_step": sample.step if sample is not None else None}
        memory_record = run_memory_record(tracker or sample.tracker, memory_steps, config, facts)
    resumed = resume_from is not None and bool(losses)
    summary = {
        "event": "summary",
        "steps": state.step,
        "final_loss": losses[-1] if losses else None,
        # The run's first loss (step 1), also after a resume: the metrics file of the run holds it (None if it is gone).
        "first_loss": (_first_loss_of_run(session) if resumed else losses[0]) if losses else None,
        **({"resumed_at_step": first_step, "launch_first_loss": losses[0]} if resumed else {}),
        "tokens_seen": state.tokens_seen,
        "wall_seconds": round(wall, 3),
        "peak_memory_bytes": run_peak or None,
        "tracked_peak_bytes": tracked_peak,
        "tracked_breakdown": dict(max(memory_steps, key=lambda m: m.peak_bytes).breakdown) if memory_steps else None,
        "tracked_step": sample.step if sample is not None and memory_steps else None,  # the default's one step
        **summary_fields(memory_record),  # the estimate beside the tracked peak
        "oom_events": oom_events,
        "micro_batch_size": runner.micro_batch_size,
        "skipped_steps": skipped_steps,
        **run_facts(session),
        **speed.summary(),
        **saver.summary(),
        **(evaluator.summary() if evaluator is not None else {}),
    }
    summary.update(engine.summary_metrics(summary))
    if save_outputs:  # a planned run on this CPU teaches the speed model its measured step (train/run_calibration.py)
        from memfit.train.run_calibration import learn_from_run

        learn_from_run(session, summary, speed.first_step_seconds)
    logger.log(summary)
    logger.close()
    if memory_record is not None:
        write_memory_record(session.output_dir, memory_record)
    return TrainResult(
        state.step, summary["final_loss"], losses, session.output_dir, final_dir, summary["peak_memory_bytes"], tracked_peak,
        summary, memory_steps,
    )


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


def _check_compiled(session: TrainingSession, logger, tracked: bool) -> None:
    """After the first step of a --compile run: when the blocks ran eager, say so.

    Compiling is lazy and Dynamo falls back silently: under the memory tracker's dispatch
    mode always, elsewhere when it compiled nothing. The metrics must name what ran, not what
    was asked.
    """
    if not session.run.compiled:
        return
    from memfit.techniques.compile import compile_stats

    # Under the tracker's dispatch mode Dynamo never runs compiled code, even graphs compiled
    # before; otherwise no graph in the process after a step means nothing compiled.
    if not tracked and compile_stats()["compiled_graphs"]:
        return
    why = ("the memory tracker (--memory-cap or --track-memory on a CPU) watches every operator, and Dynamo"
           " does not run under it" if tracked else "Dynamo fell back to eager")
    reason = f"no graph was compiled in the first step: {why}; the blocks ran eager"
    session.fallbacks["compile"] = reason
    session.change_run("compile", reason, step=1, compiled=False)
    log.warning("memfit: --compile: %s", reason)
    logger.log({"event": "fallback", "technique": "compile", "reason": reason})


def _check_efficient_lora(session: TrainingSession, logger) -> None:
    """After the first step: adapters that ran PEFT's path instead of memfit's efficient one, and why."""
    if not session.run.efficient_lora:
        return
    from memfit.techniques.efficient_lora import fallback_reasons

    reasons = fallback_reasons(session.model)
    if reasons:
        reason = "; ".join(reasons) + ": those adapters keep PEFT's copies of their inputs"
        session.fallbacks["efficient_lora"] = reason
        logger.log({"event": "fallback", "technique": "efficient_lora", "reason": reason})


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


def run_facts(session: TrainingSession) -> dict[str, Any]:
    """What really runs: recorded in the metrics' start and summary lines."""
    from memfit.models.experts import experts_facts
    from memfit.techniques.expert_quant import experts_precision
    from memfit.techniques.expert_streaming import expert_streaming_facts
    from memfit.techniques.lora import lora_facts
    from memfit.techniques.staged_weights import staged_load_facts
    from memfit.techniques.tiled_experts import tiled_experts_facts

    config = session.config
    return {
        "model": config.model.model,
        "device": str(session.device),
        "world_size": session.dist.world_size,
        "precision": session.precision.name,
        "precision_reason": session.precision.reason,
        "optimizer": session.optimizer_name,
        "attention": session.attention.implementation,
        "gradient_checkpointing": session.checkpointing,
        "loss_chunk_size": session.run.loss_chunk_size,
        "loss_head_gradient": session.run.head_gradient or None,  # in place / per chunk (chunked loss)
        "effective_batch_size": session.effective_batch_size,
        "seq_len": config.data.seq_len,
        "kernels": session.applied.get("kernels", "none"),
        "compile": session.compiled,
        "compiled_ran": session.run.compiled,  # what code reads; "compile" is for people
        "techniques": run_report(session.run),  # what each technique of the registry says about this run
        "rope_scaling": session.loaded.rope_scaling.describe() if session.loaded.rope_scaling else None,
        "packing": packing_facts(session.dataset),
        "data": dataset_facts(session.dataset),
        "fallbacks": dict(session.fallbacks),
        # Settings memfit chose from others the user gave (config.derived): in the fallbacks above, but nothing asked
        # for fell back; the report shows them apart.
        "derived_settings": dict(config.derived) or None,
        "task": session.task.facts(),  # what is learned: the console, the summary and the report word its results
        "lora": lora_facts(session.model, config.lora) if config.lora.lora_r > 0 else None,  # what trains
        "experts": experts_facts(session.model),  # MoE: the experts implementation that ran, active parameters
        "experts_weights": experts_precision(session.model),  # MoE: "experts nf4" (QLoRA) or the load dtype
        "tiled_experts": tiled_experts_facts(session.model),  # MoE layers whose experts ran over token tiles
        "expert_offload": expert_streaming_facts(session.model),  # --expert-offload: host bytes, bytes streamed
        "staged_load": staged_load_facts(session.model),  # weights loaded into host memory, moved in final form
    }


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
