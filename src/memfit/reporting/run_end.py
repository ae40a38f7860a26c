"""The report written at the end of `memfit train` and `memfit profile` (unless --no-report).

A finished run is never failed by its report: without plotly the report is skipped with
one log line, and an error while drawing is logged as a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.reporting import REPORT_FILE, write_report
from memfit.reporting.figures import plotly_available
from memfit.reporting.memory_record import analytical_estimate, build_memory_record
from memfit.reporting.run_data import RunData
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.config import TrainConfig
    from memfit.memory.report import ProfileReport

log = logging.getLogger("memfit")

SKIPPED = "memfit: no HTML report: it needs plotly (pip install 'memfit[report]'); --no-report silences this line"


def report_after_run(output_dir: str | Path, metrics_file: str | Path | None = None) -> Path | None:
    """Write report.html in a training run's output directory; the path, or None when skipped."""
    from memfit.reporting.run_data import load_run

    if not plotly_available():
        log.info(SKIPPED)
        return None
    try:
        path = write_report(load_run(output_dir, metrics_file=metrics_file), Path(output_dir) / REPORT_FILE)
    except Exception as error:  # the run itself succeeded: say what went wrong and go on
        log.warning("memfit: the HTML report could not be written: %s: %s", type(error).__name__, error)
        return None
    log.info(
        "memfit: report in %s (%s; open it in a browser, it needs no network)", path, format_bytes(path.stat().st_size)
    )
    return path


def profile_run_data(
    config: TrainConfig, report: ProfileReport, extra: dict[str, Any], timeline: list | None
) -> RunData:
    """A `RunData` for a profiling run, which writes no metrics: its losses, tracked peaks and profile."""
    facts = dict(extra.get("run") or {})
    losses = extra.get("losses") or []
    steps = []
    for number, loss in enumerate(losses, start=1):
        record: dict[str, Any] = {"step": number, "loss": loss}
        if number - 1 < len(report.step_peak_bytes):
            record["tracked_peak_bytes"] = report.step_peak_bytes[number - 1]
        steps.append(record)
    memory = build_memory_record(report, timeline or [], analytical_estimate(config), first_step=1)
    return RunData(
        name=str(facts.get("model", "profile")),
        source=str(config.output.output_dir),
        facts=facts,
        steps=steps,
        config=config.flat(),
        memory=memory,
        kind="profile",
    )


def report_after_profile(
    config: TrainConfig, report: ProfileReport, extra: dict[str, Any], timeline: list | None = None
) -> Path | None:
    """Write report.html for `memfit profile` in the output directory; the path, or None when skipped."""
    if not plotly_available():
        log.info(SKIPPED)
        return None
    try:
        path = write_report(
            profile_run_data(config, report, extra, timeline), Path(config.output.output_dir) / REPORT_FILE
        )
    except Exception as error:  # the profile was printed already: say what went wrong and go on
        log.warning("memfit: the HTML report could not be written: %s: %s", type(error).__name__, error)
        return None
    log.info(
        "memfit: report in %s (%s; open it in a browser, it needs no network)", path, format_bytes(path.stat().st_size)
    )
    return path
