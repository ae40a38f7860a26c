"""`memfit profile`: run a few real steps under the tracker and show where the memory goes."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from memfit.cli.flags import parse_command_line
from memfit.cli.help_text import CommandHelp, answer_help
from memfit.errors import UsageError

SUMMARY = (
    "Run a few real training steps (same flags as memfit train) with every tensor byte tracked, then print\n"
    "the peak and its breakdown by category and phase, the modules holding the most activations, the\n"
    "largest live tensors at the peak, advice computed from the measurement, and a leak warning."
)


@dataclass
class ProfileOptions:
    steps: int = 3
    """Training steps to profile."""
    plot: str | None = None
    """Write the memory timeline of the peak step, stacked by category, to this PNG file."""
    snapshot: str | None = None
    """CUDA only: dump the allocator history to this .pickle for PyTorch's memory viewer."""
    json: bool = False
    """Print one JSON object on stdout and nothing else."""
    top: int = 10
    """How many modules and tensors to list."""


HELP = CommandHelp(
    "profile", "memfit profile [--config FILE.yaml] [--FLAG VALUE ...]", SUMMARY, (ProfileOptions,),
    first=("config", "model", "dataset", "seq_len", "batch_size", "lora_r", "precision", "gradient_checkpointing",
           "memory_cap", "output_dir"),
    first_title="the training flags it reads most (it takes every memfit train flag):",
)


def run(argv: list[str]) -> int:
    if (code := answer_help(argv, HELP)) is not None:
        return code
    config, extras = parse_command_line(argv, [ProfileOptions])
    from memfit.models.model_names import check_model_flags

    check_model_flags(config)  # no such model: one line, before anything is read
    options = extras[ProfileOptions]
    if options.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {options.steps}")
    if options.plot and not options.plot.lower().endswith((".png", ".svg", ".pdf")):
        raise UsageError(f"--plot {options.plot}: give a .png, .svg or .pdf file name")
    from memfit.cli.output import print_json, stdout_to_stderr
    from memfit.train.profiling import profile_run

    with stdout_to_stderr(options.json):
        report, extra = profile_run(config.replace(max_steps=options.steps, epochs=None), options.top, options.plot, options.snapshot)
        timeline = extra.pop("timeline", None)  # for the HTML report only, not the --json object
        if config.output.report:
            from memfit.reporting.run_end import report_after_profile

            report_after_profile(config.with_seq_len(extra["run"]["seq_len"]), report, extra, timeline)  # as it ran
    if options.json:
        print_json(report.to_dict() | extra)
        return 0
    from memfit.memory.report import render

    print(render(report))
    if options.plot:
        print(f"memory timeline written to {options.plot}", file=sys.stderr)
    if options.snapshot and extra.get("snapshot"):
        print(f"allocator snapshot written to {options.snapshot} (open it at https://pytorch.org/memory_viz)", file=sys.stderr)
    return 0
