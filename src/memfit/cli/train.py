"""`memfit train`: train or fine-tune; with no flags, the embedded default (tiny model, bundled corpus)."""

from __future__ import annotations

import sys

from memfit.cli.flags import help_text, parse_command_line

SUMMARY = (
    "Train or fine-tune a causal language model. With no flags: the built-in tiny model on the bundled\n"
    "corpus, about a minute on 2 CPU cores. Out of memory? Halve --batch-size and double\n"
    "--gradient-accumulation-steps, add --gradient-checkpointing, or let memfit plan it: --memory-budget 16GiB."
)


def run(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text("train", SUMMARY))
        return 0
    config, _ = parse_command_line(argv)
    from memfit.train.loop import train
    from memfit.train.planned import decide_before_training
    from memfit.train.run_summary import memory_report

    result = train(decide_before_training(config))
    if result.final_dir is not None:
        summary = dict(result.summary)
        print(memory_report(summary), file=sys.stderr)
        print(f"memfit: final model in {result.final_dir}", file=sys.stderr)
        if config.output.report:  # report.html beside the metrics (skipped with one line without plotly)
            from memfit.reporting.run_end import report_after_run

            report_after_run(result.output_dir, config.output.log_file)
    return 0

