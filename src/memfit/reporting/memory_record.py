"""What the tracker measured, kept beside the metrics so a report can be drawn later.

`save_memory_record(directory, tracker, steps, config, facts)` writes
`memory_timeline.json` at the end of a run that ran the tracker (every step with --track-memory,
one early step by default): the timeline of the
step where the peak happened (thinned to at most `MAX_TIMELINE_SAMPLES` samples, the
highest of each stretch kept so the peak survives), the profile (breakdown at the peak,
phases, top modules, largest tensors, advice, leak warning) and, where it can be made,
memfit's analytical estimate of the same configuration, to show beside the measurement.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.memory.report import ProfileReport, ReportContext, build_report
from memfit.reporting.run_data import MEMORY_RECORD_FILE
from memfit.resolution.resolve import resolve

if TYPE_CHECKING:
    from memfit.config import TrainConfig

log = logging.getLogger("memfit")

MAX_TIMELINE_SAMPLES = 1000
RECORD_VERSION = 1


def thin_timeline(
    timeline: Sequence[tuple[int, str, dict[str, int]]], max_samples: int = MAX_TIMELINE_SAMPLES
) -> list[tuple[int, str, dict[str, int]]]:
    """At most `max_samples` samples: of each run of consecutive samples, the one with the most bytes.

    Phase changes start a new run, so every phase keeps at least one sample.
    """
    samples = list(timeline)
    if len(samples) <= max_samples:
        return samples
    per_bucket = -(-len(samples) // max_samples)
    thinned: list[tuple[int, str, dict[str, int]]] = []
    bucket: list[tuple[int, str, dict[str, int]]] = []
    for sample in samples:
        if bucket and (len(bucket) == per_bucket or sample[1] != bucket[-1][1]):
            thinned.append(max(bucket, key=lambda item: sum(item[2].values())))
            bucket = []
        bucket.append(sample)
    if bucket:
        thinned.append(max(bucket, key=lambda item: sum(item[2].values())))
    return thinned


def timeline_to_dict(timeline: Sequence[tuple[int, str, dict[str, int]]]) -> dict[str, Any]:
    """Column form: event indices, phases run-length coded, bytes per category."""
    categories: list[str] = []
    for _, _, sizes in timeline:
        categories.extend(name for name in sizes if name not in categories)
    phases: list[list[Any]] = []
    for index, phase, _ in timeline:
        if not phases or phases[-1][1] != phase:
            phases.append([index, phase])
    return {
        "event_index": [index for index, _, _ in timeline],
        "phases": phases,
        "bytes": {name: [sizes.get(name, 0) for _, _, sizes in timeline] for name in categories},
    }


def build_memory_record(
    report: ProfileReport,
    timeline: Sequence[tuple[int, str, dict[str, int]]],
    estimate: dict[str, Any] | None = None,
    first_step: int = 1,
) -> dict[str, Any]:
    """The JSON object of `memory_timeline.json`.

    `first_step`: the run's number (1-based, as in the metrics) of the first tracked step;
    the tracker counts the steps of one launch from 0, and a resumed launch starts later.
    """
    raw_samples = len(timeline)
    thinned = thin_timeline(timeline)
    peak_step = first_step + report.peak_step
    return {
        "version": RECORD_VERSION,
        "profile": report.to_dict(),
        "peak_step": peak_step,
        "timeline": {**timeline_to_dict(thinned), "step": peak_step, "samples_recorded": raw_samples},
        "estimate": estimate,
    }


def analytical_estimate(config: TrainConfig, micro_batch_size: int | None = None) -> dict[str, Any] | None:
    """memfit's analytical estimate of `config`, or None where it cannot be made (an unknown model shape).

    `micro_batch_size`: the micro-batch that really ran, when OOM recovery made it smaller than configured.
    """
    try:
        from memfit.prediction.estimator import estimate

        if micro_batch_size and micro_batch_size != config.training.batch_size:
            config = config.replace(batch_size=micro_batch_size)
        result = estimate(config, method="analytical")
    except Exception as error:  # the estimate is an extra: a model it cannot read must not fail the run
        log.debug("memfit: no estimate for the report: %s", error)
        return None
    return {
        "method": result.method,
        "peak_bytes": result.peak_bytes,
        "breakdown": dict(result.breakdown),
        "error_band": result.error_band,
        "peak_phase": result.details.get("peak_phase"),
        "device": result.details.get("device"),
        "micro_batch_size": config.training.batch_size,
    }


def report_context(config: TrainConfig, facts: dict[str, Any]) -> ReportContext:
    """What the run already used, so the advice does not suggest it again."""
    run = resolve(config, None, "cpu")  # what the config asks for; the facts below say what ran
    if facts.get("loss_chunk_size") is not None:
        run = dataclasses.replace(run, loss_chunk_size=facts["loss_chunk_size"])
    context = ReportContext.from_run(run)
    if facts.get("gradient_checkpointing") is not None:
        context.gradient_checkpointing = facts["gradient_checkpointing"] != "off"
    return context


def run_memory_record(
    tracker: Any, steps: Sequence[Any], config: TrainConfig, facts: dict[str, Any]
) -> dict[str, Any] | None:
    """The memory record of a run that ran the tracker (see `build_memory_record`); None when no step was tracked.

    `tracker` is the run's `MemoryTracker`, `steps` the `StepMemory` of each tracked step of this launch,
    `facts` what really ran (precision, checkpointing, loss chunk size) as in the metrics' start
    line, plus "last_step" (the run's step count at the end), "micro_batch_size" (the one the tracked
    steps ran) and, when the tracked steps are not the launch's last ones (the default tracks one early
    step: train/memory_sample.py), "first_tracked_step" (the run's number of the first of them).
    """
    if not steps:
        return None
    report = build_report(
        steps, tracker.peak_snapshot(), facts.get("device", str(tracker.device)), report_context(config, facts)
    )
    first_step = facts.get("first_tracked_step") or int(facts.get("last_step") or len(steps)) - len(steps) + 1
    estimate = analytical_estimate(config, facts.get("micro_batch_size"))
    return build_memory_record(report, tracker.timeline(), estimate, int(first_step))


def summary_fields(record: dict[str, Any] | None) -> dict[str, Any]:
    """What the run's summary line says of the estimate beside the tracked peak (the console prints it)."""
    estimate = (record or {}).get("estimate")
    if not estimate:
        return {}
    return {"estimated_peak_bytes": estimate.get("peak_bytes"), "estimate_error_band": estimate.get("error_band"),
            "estimate_method": estimate.get("method")}


def write_memory_record(directory: str | Path, record: dict[str, Any]) -> Path:
    """Write `memory_timeline.json` atomically."""
    path = Path(directory) / MEMORY_RECORD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(record), encoding="utf-8")
    os.replace(temporary, path)  # a reader never sees half a file
    return path


def save_memory_record(
    directory: str | Path, tracker: Any, steps: Sequence[Any], config: TrainConfig, facts: dict[str, Any]
) -> Path | None:
    """Write `memory_timeline.json` for a run that ran the tracker (`run_memory_record`); None when no step was tracked."""
    record = run_memory_record(tracker, steps, config, facts)
    return write_memory_record(directory, record) if record is not None else None
