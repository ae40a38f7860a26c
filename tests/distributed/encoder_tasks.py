"""The encoder tasks beyond BERT's sequence classification that the shared torchrun launches carry.

Each is a 3-step SGD run (no clipping) over the same 24 DNA rows of 8 to 40 bases as the sequence
classifier of conftest.py, so every micro-batch pads differently: regression (one number a sample),
token classification (one label a base: normalised per labelled token), masked LM (masks seeded by
the run seed, the step and the sample's index, normalised per masked token) on the tiny BERT, and
sequence classification on the tiny ESM (rotary positions, pre-norm blocks). Only the per-sample or
per-token normalisation over the global batch, not each rank's share, gives the one-process update.
"""

from __future__ import annotations

from pathlib import Path

from fault_injection import SGD_FLAGS

ENCODER_TASKS = {
    "regression": ("bert", ["--task", "regression", "--label-fields", "value"]),
    "tokens": ("bert", ["--task", "token-classification", "--label-fields", "tags"]),
    "mlm": ("bert", ["--task", "masked-lm", "--mlm-probability", "0.3"]),
    "esm": ("esm", ["--task", "sequence-classification"]),
}
"""Run key -> (tiny encoder family, task flags)."""


def encoder_task_args(model_dirs: dict[str, Path], table: Path) -> dict[str, list[str]]:
    """The flags of each run of ENCODER_TASKS (batch, engine and output directory left to the launch)."""
    return {key: ["--model", str(model_dirs[family]), "--dataset", str(table), *flags, "--seq-len", "64",
                  "--max-steps", "3", "--no-report", *SGD_FLAGS, "--lr", "0.5"]
            for key, (family, flags) in ENCODER_TASKS.items()}


def encoder_task_runs(args: dict[str, list[str]], engine: str, flags: list[str],
                      fault: float | None = None) -> list[dict]:
    """One run per task named encoder-KEY-ENGINE, and with `fault` its twin whose gradients are scaled by it
    (conftest.FAULT: halved, the normaliser not divided by the world size) named encoder-KEY-ENGINE-fault."""
    runs = []
    for key, task_args in args.items():
        for scale in (None, fault) if fault is not None else (None,):
            name = f"encoder-{key}-{engine}" + ("" if scale is None else "-fault")
            runs.append({"name": name, "grad_scale": scale, "args": [*task_args, *flags]})
    return runs
