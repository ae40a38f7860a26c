"""`memfit generate RUN_DIR --prompt TEXT | --messages FILE`: sample from the model a run trained."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from memfit.cli.flags import parse_command_line
from memfit.cli.help_text import CommandHelp, answer_help
from memfit.cli.merge import split_run_dir
from memfit.errors import UsageError

SUMMARY = (
    "Sample from the final model of a run (base + adapters for LoRA) through the tokenizer's chat template,\n"
    "to see what the fine-tune learned; a tokenizer without one continues the plain prompt. The same --seed\n"
    "gives the same text."
)


@dataclass
class GenerateOptions:
    prompt: str | None = None
    """Text to answer: one user turn through the chat template (or plain text to continue without one)."""
    messages: str | None = None
    """A JSON file holding a conversation: a list of {role, content} turns, or {"messages": [...]}."""
    max_new_tokens: int = 128
    """The most tokens to generate."""
    temperature: float = 0.7
    """Sampling temperature; 0 decodes greedily."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this."""
    seed: int = 0
    """Seed of the sampling: the same seed gives the same text."""
    best: bool = False
    """Use the best model by eval loss (RUN_DIR/best, from --save-best) instead of the final one."""
    memory_cap: int | None = field(default=None, metadata={"size": True})
    """Behave as if the device had only this much memory (e.g. 8GiB); generation that needs more stops (exit 3)."""


HELP = CommandHelp(
    "generate", "memfit generate RUN_DIR (--prompt TEXT | --messages FILE.json) [--FLAG VALUE ...]", SUMMARY,
    (GenerateOptions,), train_flags=False, arguments=(("RUN_DIR", "The --output-dir of a memfit train run."),),
)


def read_messages(path: str) -> list[dict]:
    """The conversation of a --messages file; UsageError naming what is wrong."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--messages {path} does not exist; give a JSON file with a list of {{role, content}} turns")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UsageError(f"--messages {path} is not JSON ({str(error).splitlines()[0][:120]})") from None
    turns = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(turns, list) or not turns:
        raise UsageError(f"--messages {path}: expected a non-empty list of {{role, content}} turns (or {{\"messages\": [...]}})")
    for number, turn in enumerate(turns, 1):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise UsageError(f"--messages {path}: turn {number} is not {{\"role\": ..., \"content\": \"...\"}}")
    return turns


def run(argv: list[str]) -> int:
    if (code := answer_help(argv, HELP)) is not None:
        return code
    run_dir, rest = split_run_dir(argv, "generate")
    _, extras = parse_command_line(rest, [GenerateOptions], train_flags=False)
    options: GenerateOptions = extras[GenerateOptions]
    if (options.prompt is None) == (options.messages is None):
        raise UsageError("give --prompt TEXT or --messages FILE (one of them)")
    if options.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {options.max_new_tokens}")
    if options.temperature < 0 or not 0 < options.top_p <= 1:
        raise UsageError("--temperature must be 0 or more and --top-p between 0 (excluded) and 1")
    messages = read_messages(options.messages) if options.messages is not None else None
    from memfit.hardware import training_device
    from memfit.train.inference import BEST_DIR, FINAL_DIR, generate, load_for_inference, open_run

    trained = open_run(run_dir, BEST_DIR if options.best else FINAL_DIR)
    model, tokenizer = load_for_inference(trained, training_device())
    text = generate(model, tokenizer, options.prompt, messages, options.max_new_tokens, options.seed,
                    options.temperature, options.top_p, options.memory_cap)
    print(text)
    return 0
