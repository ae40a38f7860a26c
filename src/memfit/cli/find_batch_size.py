"""`memfit find-batch-size`: the largest micro-batch that fits, by measurement."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.cli.flags import parse_command_line
from memfit.cli.help_text import CommandHelp, answer_help
from memfit.errors import UsageError
from memfit.units import format_bytes

SUMMARY = (
    "Find the largest micro-batch that fits: full training steps at the worst case (full --seq-len windows),\n"
    "doubling from 1 then bisecting, under --memory-cap or the device's memory less --margin."
)


@dataclass
class FindBatchSizeOptions:
    margin: float = 0.1
    """Safety margin kept free, as a fraction of the cap or the device's memory."""
    json: bool = False
    """Print one JSON object on stdout and nothing else."""


HELP = CommandHelp(
    "find-batch-size", "memfit find-batch-size [--config FILE.yaml] [--FLAG VALUE ...]", SUMMARY,
    (FindBatchSizeOptions,),
    first=("config", "model", "seq_len", "lora_r", "precision", "gradient_checkpointing", "memory_cap"),
    first_title="the training flags it reads most (it takes every memfit train flag):",
)


def run(argv: list[str]) -> int:
    if (code := answer_help(argv, HELP)) is not None:
        return code
    config, extras = parse_command_line(argv, [FindBatchSizeOptions])
    from memfit.models.model_names import check_model_flags

    check_model_flags(config)  # no such model: one line, before anything is read
    options = extras[FindBatchSizeOptions]
    if not 0 <= options.margin < 1:
        raise UsageError(f"--margin must be a fraction between 0 and 1 (e.g. 0.1), got {options.margin}")
    from memfit.cli.output import print_json, stdout_to_stderr
    from memfit.train.batch_size import find_batch_size

    with stdout_to_stderr(options.json):
        result = find_batch_size(config, options.margin)
    if options.json:
        print_json(result.to_dict())
        return 0
    print(f"largest micro-batch that fits: {result.max_batch_size} (limit {format_bytes(result.limit_bytes)})")
    for probe in result.probes:
        peak = format_bytes(probe.peak_bytes) if probe.peak_bytes else "out of memory"
        print(f"  probe {probe.batch_size:>5}: {'fits' if probe.fits else 'does not fit':<13} {peak}")
    print(
        f"recommended: --batch-size {result.recommended_batch_size} --gradient-accumulation-steps"
        f" {result.gradient_accumulation_steps} (peak {format_bytes(result.peak_bytes_at_recommended or 0)})"
    )
    return 0
