"""What `memfit estimate --json` and `memfit plan --json` answer on a fixed grid, saved and compared.

A refactoring of how a configuration becomes a run must not change what memfit predicts. This script asks the
command line itself (in this process, one call per configuration) for the estimate of every configuration of a
grid (dense decoders, mixtures of experts, encoders with task heads; every memory technique alone and some stacked)
and for a few plans, and writes the answers to one JSON file. With `--compare OLD.json` it lists every field that
differs from the earlier snapshot (numbers: relative change above --tolerance), and exits 1 when any does.

    python benchmarks/prediction_snapshot.py --out before.json
    python benchmarks/prediction_snapshot.py --out after.json --compare before.json

Nothing is downloaded: the models are presets (their shapes, from the offline tables). Plans that measure
(`--trial`) are left out: they time real steps and would differ run to run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import re
import sys
import time
from pathlib import Path

# Each entry: a name and the flags after `memfit estimate` (a GPU is named so that the CUDA terms count).
DENSE = "--model llama-3.2-1b --gpu rtx-4090 --seq-len 2048 --batch-size 2 --dtype bf16"
BIG = "--model llama-3.1-8b --gpu rtx-4090 --seq-len 4096 --batch-size 1 --dtype bf16"
ESTIMATES: list[tuple[str, str]] = [
    ("dense plain fp32", "--model llama-3.2-1b --gpu a100-80gb --seq-len 1024 --batch-size 2"),
    ("dense bf16", DENSE + " --precision bf16"),
    ("dense checkpointing full", DENSE + " --gradient-checkpointing full"),
    ("dense checkpointing selective", DENSE + " --gradient-checkpointing selective"),
    ("dense checkpointing every 2nd", DENSE + " --gradient-checkpointing full --checkpoint-every 2"),
    ("dense checkpointing auto", DENSE + " --gradient-checkpointing auto"),
    ("dense loss chunk", DENSE + " --loss-chunk-size 512"),
    ("dense adamw-8bit", DENSE + " --optimizer adamw-8bit"),
    ("dense paged adamw-8bit", DENSE + " --optimizer paged-adamw-8bit"),
    ("dense adafactor", DENSE + " --optimizer adafactor"),
    ("dense sgd", DENSE + " --optimizer sgd"),
    ("dense galore", DENSE + " --optimizer galore-adamw"),
    ("dense apollo-mini", DENSE + " --optimizer apollo-mini"),
    ("dense adam-mini", DENSE + " --optimizer adam-mini"),
    ("dense adamw-4bit", DENSE + " --optimizer adamw-4bit"),
    ("dense optimizer in backward", DENSE + " --optimizer-in-backward"),
    ("dense optimizer offload", DENSE + " --optimizer-offload"),
    ("dense activation offload", DENSE + " --gradient-checkpointing full --activation-offload"),
    ("dense activation offload 8 blocks", DENSE + " --gradient-checkpointing full --activation-offload-blocks 8"),
    ("dense tiled mlp", DENSE + " --tiled-mlp 4"),
    ("dense efficient norm off", DENSE + " --no-efficient-norm"),
    ("dense compile", DENSE + " --compile"),
    ("dense liger", DENSE + " --kernels liger"),
    ("dense eager attention", DENSE + " --attention eager"),
    ("dense memory cap", DENSE + " --memory-cap 12GiB"),
    ("dense accumulation", DENSE + " --gradient-accumulation-steps 4"),
    ("dense lora", DENSE + " --lora-r 16"),
    ("dense lora all-linear", DENSE + " --lora-r 16 --lora-targets all-linear"),
    ("dense efficient lora off", DENSE + " --lora-r 16 --no-efficient-lora"),
    ("dense qlora", DENSE + " --lora-r 16 --quantize 4bit"),
    ("dense qlora head", DENSE + " --lora-r 16 --quantize 4bit --quantize-head --embedding-on-host"),
    ("dense rope scale", DENSE + " --rope-scale 4 --seq-len 65536 --gradient-checkpointing full --loss-chunk-size 1024"),
    ("8b qlora long", BIG + " --lora-r 32 --quantize 4bit --gradient-checkpointing full --loss-chunk-size 1024"
                            " --tiled-mlp 8 --seq-len 32768"),
    ("8b full stacked", BIG + " --optimizer apollo-mini --optimizer-in-backward --gradient-checkpointing full"
                              " --activation-offload --loss-chunk-size 1024"),
    ("8b fsdp 4", BIG + " --sharding fsdp --world-size 4 --gradient-checkpointing full"),
    ("8b zero3 4", BIG + " --zero-stage 3 --world-size 4 --gradient-checkpointing full"),
    ("moe olmoe lora", "--model olmoe-1b-7b --gpu rtx-4090 --seq-len 2048 --dtype bf16 --lora-r 16"),
    ("moe olmoe qlora", "--model olmoe-1b-7b --gpu rtx-4090 --seq-len 2048 --dtype bf16 --lora-r 16 --quantize 4bit"),
    ("moe qwen3 expert offload", "--model qwen3-30b-a3b --gpu h100-80gb --seq-len 2048 --dtype bf16 --lora-r 16"
                                 " --expert-offload --gradient-checkpointing full"),
    ("moe gpt-oss qlora groups", "--model gpt-oss-20b --gpu rtx-4090 --seq-len 2048 --dtype bf16 --lora-r 16"
                                 " --quantize 4bit --expert-dequant-group 4 --gradient-checkpointing full"),
    ("moe tiled experts", "--model qwen3-30b-a3b --gpu h100-80gb --seq-len 32768 --dtype bf16 --lora-r 16"
                          " --quantize 4bit --tiled-mlp 8 --gradient-checkpointing full"),
    ("encoder classification", "--model esm2-150m --gpu rtx-4090 --seq-len 1024 --batch-size 8"
                               " --task sequence-classification --num-labels 3"),
    ("encoder regression lora", "--model dnabert-2-117m --gpu rtx-4090 --seq-len 512 --batch-size 16"
                                " --task regression --lora-r 8"),
    ("encoder token classification", "--model nt-v2-100m --gpu rtx-4090 --seq-len 1024 --batch-size 4"
                                     " --task token-classification --num-labels 2 --gradient-checkpointing full"),
    ("encoder masked lm", "--model modernbert-base --gpu rtx-4090 --seq-len 2048 --batch-size 4 --task masked-lm"),
    ("gpt2 plain", "--model gpt2 --gpu rtx-4090 --seq-len 1024 --batch-size 8"),
    ("gemma tied head chunk", "--model gemma-3-1b --gpu rtx-4090 --seq-len 4096 --dtype bf16 --loss-chunk-size 1024"),
]
PLANS: list[tuple[str, str]] = [
    ("plan 1b budget", "--model llama-3.2-1b --memory-budget 16GiB --seq-len 2048 --no-trial"),
    ("plan 8b 4090", "--model llama-3.1-8b --gpu rtx-4090 --seq-len 2048 --host-memory 64GiB --no-trial"),
    ("plan 8b longest qlora", "--model llama-3.1-8b --gpu rtx-4090 --allow qlora --lora-r 32 --lora-targets all-linear"
                              " --maximize seq-len --host-memory 32GiB --no-trial"),
    ("plan 8b full batch 2", "--model llama-3.1-8b --gpu rtx-4090 --allow full --seq-len 2048 --batch-size 2"
                             " --host-memory 64GiB --no-trial"),
    ("plan encoder batch", "--model esm2-150m --gpu rtx-4090 --task sequence-classification --num-labels 2"
                           " --maximize batch-size --no-trial"),
]
# Fields that say when or where, not what: left out of the comparison.
VOLATILE = {"host_available_bytes", "host_fits", "elapsed_seconds", "created"}


def ask(command: str, flags: str) -> dict:
    """`memfit COMMAND FLAGS --json`, in this process: its JSON, or the error it gave and its exit code."""
    from memfit.cli.main import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main([command, *flags.split(), "--json"])
        except SystemExit as stop:
            code = stop.code
    text = stdout.getvalue().strip()
    if code == 0 and text:
        return json.loads(text)
    return {"exit_code": code, "error": (stderr.getvalue().strip().splitlines() or [""])[-1]}


def snapshot() -> dict:
    logging.disable(logging.CRITICAL)  # the answers are on stdout; progress lines would only slow the grid
    answers = {}
    for kind, grid in (("estimate", ESTIMATES), ("plan", PLANS)):
        for name, flags in grid:
            start = time.monotonic()
            answers[f"{kind}: {name}"] = {"flags": flags, "answer": ask(kind, flags)}
            print(f"snapshot: {kind}: {name} ({time.monotonic() - start:.1f} s)", file=sys.stderr)
    return answers


AVAILABLE_NOW = re.compile(r"this machine has [0-9.]+ [KMGT]iB available now \((NOT )?enough here\)")
"""How much host memory is free as the plan is made: part of a plan's words, but measured, not predicted."""


def differences(old, new, path: str, tolerance: float) -> list[str]:
    """Every leaf that differs, as `path: old -> new` (numbers: relative change above `tolerance`)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new)):
            if key in VOLATILE:
                continue
            if key not in old or key not in new:
                found.append(f"{path}.{key}: {'absent' if key not in old else old[key]!r} -> "
                             f"{'absent' if key not in new else new[key]!r}")
            else:
                found += differences(old[key], new[key], f"{path}.{key}", tolerance)
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new, strict=True))
                for d in differences(a, b, f"{path}[{i}]", tolerance)]
    numbers = (int, float)
    if isinstance(old, numbers) and isinstance(new, numbers) and not isinstance(old, bool):
        scale = max(abs(old), abs(new), 1e-12)
        return [] if math.isclose(old, new) or abs(old - new) / scale <= tolerance else [f"{path}: {old} -> {new}"]
    if isinstance(old, str) and isinstance(new, str):  # the machine's free memory now is not a prediction
        old, new = (AVAILABLE_NOW.sub("this machine has N GiB available now", text) for text in (old, new))
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write this snapshot (JSON)")
    parser.add_argument("--compare", type=Path, help="an earlier snapshot: list every difference, exit 1 if any")
    parser.add_argument("--tolerance", type=float, default=0.0, help="relative change of a number still counted equal")
    options = parser.parse_args()
    answers = snapshot()
    options.out.write_text(json.dumps(answers, indent=1, sort_keys=True))
    failed = [name for name, entry in answers.items() if "exit_code" in entry["answer"]]
    print(f"snapshot: {len(answers)} configurations, {len(failed)} refused (kept as answers): {failed}",
          file=sys.stderr)
    if not options.compare:
        return 0
    old = json.loads(options.compare.read_text())
    found = differences(old, answers, "", options.tolerance)
    for line in found:
        print(line)
    print(f"snapshot: {len(found)} differences against {options.compare}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
