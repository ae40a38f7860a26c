"""The runs of test_adamw4bit_fsdp.py in the shared torchrun launch (conftest.py), and their fault.

torchao's 4-bit AdamW, 2 ranks: ddp2 / fsdp2 (2 steps each, ddp2 checkpointed at step 2); fsdp4 (4 steps,
checkpoints at 2 and 4); fsdp4-resumed from fsdp4's step-2 checkpoint; fsdp4-zeroed, the same with the 4-bit
moments zeroed after loading (the fault, `dropped_4bit_state`, which exactness_worker.py injects by its "fault"
name); ddp-to-fsdp, ddp2's whole-tensor checkpoint resumed on FSDP2 shards (refused: exit 2). Each run's name
in the launch is "4bit-" and its key here.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from unittest import mock

LR = 1e-2
PREFIX = "4bit-"


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def adamw4bit_args(llama_dir: Path, text_file: Path) -> list[str]:
    return ["--model", str(llama_dir), "--dataset", str(text_file), "--seq-len", "32", "--batch-size", "2",
            "--loss-chunk-size", "0", "--lr", str(LR), "--lr-schedule", "constant", "--no-report",
            "--optimizer", "adamw-4bit"]


def adamw4bit_runs(llama_dir: Path, text_file: Path, root: Path) -> list[dict]:
    """The runs (see the module's doc) as run_many's runs writing under `root`; their --output-dir comes last."""
    base = adamw4bit_args(llama_dir, text_file)
    step2 = str(root / f"{PREFIX}fsdp4" / "checkpoints" / "step-2")
    runs = [
        {"name": "ddp2", "args": [*base, "--sharding", "ddp", "--max-steps", "2", "--save-every", "2"]},
        {"name": "fsdp2", "args": [*base, "--sharding", "fsdp", "--max-steps", "2"]},
        {"name": "fsdp4", "args": [*base, "--sharding", "fsdp", "--max-steps", "4", "--save-every", "2"]},
        {"name": "fsdp4-resumed", "after": [f"{PREFIX}fsdp4"],
         "args": [*base, "--sharding", "fsdp", "--max-steps", "4", "--resume", step2]},
        {"name": "fsdp4-zeroed", "after": [f"{PREFIX}fsdp4"], "fault": "adamw4bit_runs:dropped_4bit_state",
         "args": [*base, "--sharding", "fsdp", "--max-steps", "4", "--resume", step2]},
        {"name": "ddp-to-fsdp", "after": [f"{PREFIX}ddp2"], "exits": [2],
         "args": [*base, "--sharding", "fsdp", "--max-steps", "4", "--resume",
                  str(root / f"{PREFIX}ddp2" / "checkpoints" / "step-2")]},
    ]
    for run in runs:
        run["name"] = PREFIX + run["name"]
        run["args"] += ["--output-dir", str(root / run["name"])]
    return runs


def _zero_4bit_moments(optimizer) -> int:
    """Zero the scales of every 4-bit moment (its values dequantize to 0); returns how many it zeroed."""
    zeroed = 0
    for state in optimizer.state.values():
        for value in state.values():
            local = value.to_local() if hasattr(value, "to_local") else value
            if type(local).__name__ == "OptimState4bit":
                local.scale.zero_()
                zeroed += 1
    return zeroed


@contextlib.contextmanager
def dropped_4bit_state():
    """FullyShardedEngine.load_checkpoint followed by the fault; it fails when no 4-bit moment was loaded."""
    from memfit.distributed.fsdp import FullyShardedEngine

    original = FullyShardedEngine.load_checkpoint

    def load_then_zero(self, path, scheduler):
        state = original(self, path, scheduler)
        if _zero_4bit_moments(self.optimizer) == 0:
            raise RuntimeError("the fault found no 4-bit moment to zero")
        return state

    with mock.patch.object(FullyShardedEngine, "load_checkpoint", load_then_zero):
        yield
