"""Run reports a person looks at: one self-contained HTML file per run, or per comparison of runs.

    write_report("runs/memfit")                  # -> runs/memfit/report.html
    write_compare(["runs/a", "runs/b"], "compare.html")

The report reads what a run left in its output directory (`run_data`), draws it with
plotly (`figures`, an optional dependency: pip install 'memfit[report]') and writes one
HTML file with plotly.js inline, which opens without a network (`page`).
`memory_record` keeps what the tracker measured beside the metrics so the report can
show the timeline of a step, the modules and tensors at the peak, and the advice.
This package reads run directories and may use `memfit.memory`; it never imports `memfit.train`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from memfit.reporting.figures import plotly_available, require_plotly
from memfit.reporting.run_data import RunData, load_run

REPORT_FILE = "report.html"

__all__ = ["REPORT_FILE", "RunData", "load_run", "plotly_available", "require_plotly", "write_compare", "write_report"]


def write_report(run: str | Path | RunData, output: str | Path | None = None) -> Path:
    """Write the report of a run directory (or of a `RunData`) to `output` (default: report.html in the run directory).

    Raises:
        UsageError: plotly is missing, or the directory holds no metrics.
    """
    from memfit.reporting.page import render_report, write_html

    require_plotly()
    data = run if isinstance(run, RunData) else load_run(run)
    if output is None:
        output = Path(data.source) / REPORT_FILE
    return write_html(output, render_report(data))


def write_compare(runs: Sequence[str | Path | RunData], output: str | Path) -> Path:
    """Write one page with the runs overlaid (loss, tokens/s, peak memory).

    Raises:
        UsageError: plotly is missing, or a directory holds no metrics.
    """
    from memfit.reporting.page import render_compare, write_html

    require_plotly()
    loaded = [run if isinstance(run, RunData) else load_run(run) for run in runs]
    _distinct_names(loaded)
    return write_html(output, render_compare(loaded))


def _distinct_names(runs: list[RunData]) -> None:
    """Runs whose directories share a name (a/run, b/run) are told apart by their parent."""
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.name] = seen.get(run.name, 0) + 1
    for number, run in enumerate(runs):
        if seen[run.name] > 1:
            parent = Path(run.source).parent.name
            run.name = f"{parent}/{run.name}" if parent else f"{run.name} ({number + 1})"
