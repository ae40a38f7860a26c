"""`memfit merge RUN_DIR [--output DIR]`: the base model with the run's LoRA adapters merged in."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from memfit.cli.flags import parse_command_line
from memfit.cli.help_text import CommandHelp, answer_help
from memfit.errors import UsageError

SUMMARY = (
    "Write the base model of a LoRA run with its adapters merged into the weights: safetensors and the\n"
    "tokenizer, loadable with AutoModelForCausalLM.from_pretrained. A QLoRA run merges into the unquantized\n"
    "base (loaded again without quantization)."
)


@dataclass
class MergeOptions:
    output: str | None = None
    """Directory to write the merged model to (RUN_DIR/merged when not given)."""
    best: bool = False
    """Merge the best model by eval loss (RUN_DIR/best, from --save-best) instead of the final one."""
    memory_cap: int | None = field(default=None, metadata={"size": True})
    """The most memory the merge may hold (e.g. 16GiB); it runs on the CPU, one copy of the base."""


HELP = CommandHelp(
    "merge", "memfit merge RUN_DIR [--output DIR] [--best] [--memory-cap SIZE]", SUMMARY, (MergeOptions,),
    train_flags=False, arguments=(("RUN_DIR", "The --output-dir of a memfit train run with LoRA adapters."),),
)


def split_run_dir(argv: list[str], command: str) -> tuple[str, list[str]]:
    """The RUN_DIR positional (first argument) and the options after it (a second positional is refused there)."""
    if not argv or argv[0].startswith("-"):
        raise UsageError(f"give the run directory first: memfit {command} RUN_DIR [--FLAG VALUE ...]")
    return argv[0], argv[1:]


def run(argv: list[str]) -> int:
    if (code := answer_help(argv, HELP)) is not None:
        return code
    run_dir, rest = split_run_dir(argv, "merge")
    _, extras = parse_command_line(rest, [MergeOptions], train_flags=False)
    options: MergeOptions = extras[MergeOptions]
    from memfit.train.inference import BEST_DIR, FINAL_DIR, merge_run, open_run

    trained = open_run(run_dir, BEST_DIR if options.best else FINAL_DIR)
    result = merge_run(trained, options.output, options.memory_cap)
    print(f"memfit merge: {result.note}", file=sys.stderr)
    print(result.directory)
    return 0
