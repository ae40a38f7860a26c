"""`memfit report RUN_DIR [-o report.html]`: the HTML report of a run directory, written again or elsewhere."""

from __future__ import annotations

from pathlib import Path

from memfit.cli.help_text import CommandHelp, answer_help
from memfit.errors import UsageError

USAGE = "usage: memfit report RUN_DIR [-o FILE.html]"
HELP = CommandHelp(
    "report", USAGE.removeprefix("usage: "),
    "Write one self-contained HTML file (plotly.js inline, no network needed to open it) about a run: what ran and "
    "what fell back, loss, learning rate, gradient norm, tokens/s and peak memory over the steps with OOM recoveries "
    "and resumes marked, and, when the tracker ran (one early step by default; every step with --track-memory or a "
    "memory cap on CPU), the memory at the peak "
    "by category beside memfit's estimate, one step's timeline stacked by category, the modules and tensors holding "
    "the most, and advice. memfit train writes the same file as RUN_DIR/report.html at the end of every run "
    "(--no-report skips it).",
    train_flags=False,
    arguments=(("RUN_DIR", "The --output-dir of a memfit train run (or its metrics.jsonl)."),
               ("-o, --output FILE.html", "Where to write the report. Default: RUN_DIR/report.html.")),
)


def parse_arguments(argv: list[str], usage: str) -> tuple[list[str], str | None]:
    """Positional run directories and the -o/--output file; a UsageError for anything else."""
    runs: list[str] = []
    output = None
    index = 0
    while index < len(argv):
        token = argv[index]
        index += 1
        name, has_value, value = token.partition("=")
        if name in ("-o", "--output"):
            if not has_value:
                if index >= len(argv):
                    raise UsageError(f"{name} needs a file name; {usage}")
                value = argv[index]
                index += 1
            output = value
        elif token.startswith("-"):
            raise UsageError(f"unknown option {token}; {usage}")
        else:
            runs.append(token)
    if output is not None and not output.lower().endswith((".html", ".htm")):
        raise UsageError(f"--output {output}: give a .html file name")
    return runs, output


def run(argv: list[str]) -> int:
    if (code := answer_help(argv, HELP)) is not None:
        return code
    runs, output = parse_arguments(argv, USAGE)
    if len(runs) != 1:
        raise UsageError(f"give one run directory ({len(runs)} given); {USAGE} (memfit compare overlays several)")
    from memfit.reporting import REPORT_FILE, load_run, require_plotly, write_report

    require_plotly()
    data = load_run(runs[0])  # checks the directory before anything is written
    path = write_report(data, output or Path(data.source) / REPORT_FILE)
    print_written(path)
    return 0


def print_written(path: Path) -> None:
    from memfit.units import format_bytes

    print(f"{path} ({format_bytes(path.stat().st_size)}; opens offline in any browser)")
