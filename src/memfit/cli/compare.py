"""`memfit compare RUN_A RUN_B ... [-o compare.html]`: several runs overlaid in one HTML page."""

from __future__ import annotations

from memfit.cli.help_text import CommandHelp, answer_help
from memfit.cli.report import parse_arguments, print_written
from memfit.errors import UsageError

USAGE = "usage: memfit compare RUN_A RUN_B [RUN ...] [-o FILE.html]"
HELP = CommandHelp(
    "compare", USAGE.removeprefix("usage: "),
    "Write one self-contained HTML page (no network needed to open it) that puts several runs side by side: a table "
    "of what each ran (precision, optimizer, checkpointing, micro-batch) and got (final loss, tokens/s, peak memory, "
    "OOM recoveries, fallbacks), then their loss, tokens/s and peak memory over the steps overlaid, and the memory "
    "at each run's peak by category when the tracker ran. It shows what a technique bought: train twice with one "
    "flag changed, then compare.",
    train_flags=False,
    arguments=(("RUN_A RUN_B ...", "The --output-dir of memfit train runs (or their metrics.jsonl)."),
               ("-o, --output FILE.html", "Where to write the page. Default: compare.html.")),
)


def run(argv: list[str]) -> int:
    if (code := answer_help(argv, HELP)) is not None:
        return code
    runs, output = parse_arguments(argv, USAGE)
    if len(runs) < 2:
        raise UsageError(f"give two or more run directories ({len(runs)} given); {USAGE}")
    from memfit.reporting import load_run, require_plotly, write_compare

    require_plotly()
    loaded = [load_run(path) for path in runs]  # every directory is checked before anything is written
    print_written(write_compare(loaded, output or "compare.html"))
    return 0
