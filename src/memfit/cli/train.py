"""`memfit train`: train or fine-tune; with no flags, the embedded default (tiny model, bundled corpus)."""

from __future__ import annotations

import sys

from memfit.cli.flags import parse_command_line
from memfit.cli.help_text import CommandHelp, answer_help

SUMMARY = (
    "Train or fine-tune a causal language model; with no flags, the built-in tiny model on the bundled corpus "
    "(about a minute on 2 CPU cores). Out of memory? Halve --batch-size and double --gradient-accumulation-steps, "
    "add --gradient-checkpointing, or plan it: --memory-budget 16GiB."
)
HELP = CommandHelp(
    "train", "memfit train [--config FILE.yaml] [--FLAG VALUE ...]", SUMMARY,
    first=("config", "model", "dataset", "output_dir", "task", "seq_len", "batch_size", "gradient_accumulation_steps",
           "max_steps", "epochs", "lr", "lora_r", "quantize", "precision", "gradient_checkpointing", "memory_budget",
           "gpu", "resume"),
)


def run(argv: list[str]) -> int:
    if (code := answer_help(argv, HELP)) is not None:
        return code
    config, _ = parse_command_line(argv)
    from memfit.models.model_names import check_model_flags

    check_model_flags(config)  # no such model: one line, before anything is read
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

