"""Entry point of the `memfit` command: dispatch to a subcommand, turn errors into one line."""

from __future__ import annotations

import importlib
import logging
import os
import sys

from memfit.config_loading import suggest
from memfit.errors import MemfitError

# subcommand -> (module under memfit.cli, one-line summary)
COMMANDS = {
    "train": ("train", "train or fine-tune a causal language model"),
    "estimate": ("estimate", "will it fit? predicted memory breakdown"),
    "plan": ("plan", "the fastest configuration that fits a GPU or a budget"),
    "profile": ("profile", "run a few steps and show where the memory goes"),
    "find-batch-size": ("find_batch_size", "the largest micro-batch that fits"),
    "presets": ("presets", "the models and GPUs the offline tables know"),
    "report": ("report", "a run's HTML report: curves, memory at the peak, advice (offline)"),
    "compare": ("compare", "several runs overlaid in one HTML page"),
    "data": ("data", "a dataset as the model sees it: rendered samples, loss masks, lengths, packing"),
    "merge": ("merge", "a LoRA run's base model with its adapters merged (safetensors, from_pretrained)"),
    "generate": ("generate", "sample from the model a run trained, through its chat template"),
}

USAGE = "usage: memfit {" + ",".join(COMMANDS) + "} [--FLAG VALUE ...]   (memfit COMMAND --help for its flags)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["help"] and len(argv) > 1:  # `memfit help train [SECTION]` is `memfit train --help [SECTION]`
        argv = [argv[1], "--help", *argv[2:]]
    if not argv or argv[0] in ("-h", "--help", "help"):
        if not argv:
            argv = ["train"]  # the embedded default is the first thing a newcomer types
        else:
            from memfit.cli.help_text import main_help

            print(main_help(COMMANDS))
            return 0
    command, rest = argv[0], argv[1:]
    if command.startswith("--"):
        command, rest = "train", argv
    if command not in COMMANDS:
        print(f"memfit: unknown command {command!r}{suggest(command, COMMANDS)}; {USAGE}", file=sys.stderr)
        return 2
    logging.basicConfig(level=os.environ.get("MEMFIT_LOG_LEVEL", "INFO"), format="%(message)s", stream=sys.stderr)
    # Optional libraries announce things at import that say nothing about the run
    # (torchao's kernels for other GPUs, deprecation notices, DeepSpeed's accelerator probe).
    for noisy in ("torch.utils._pytree", "torchao", "DeepSpeed", "deepspeed", "accelerate", "bitsandbytes"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    # huggingface_hub's HTTP layer warns twice per retry ("'...' thrown while requesting HEAD ...", "Retrying in
    # 8s"), every file, five times. memfit's own look-up of a model name is never retried and an unreachable Hub
    # turns the run to the cache (models/model_names.py, check_model_flags); what is left is transformers' downloads
    # riding out a flaky network, which fail or succeed with their own message. Only that module is quieted.
    logging.getLogger("huggingface_hub.utils._http").setLevel(logging.ERROR)
    module = importlib.import_module(f"memfit.cli.{COMMANDS[command][0]}")
    try:
        return module.run(rest)
    except MemfitError as error:
        print(f"memfit {command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"memfit {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `memfit ... | head`: the reader left, nothing is wrong
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps Python from complaining at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
