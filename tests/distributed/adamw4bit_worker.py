"""Run `memfit train` several times in one process (or one torchrun launch) for test_adamw4bit_fsdp.py.

    [torchrun --nproc_per_node 2] adamw4bit_worker.py RUNS.json

RUNS.json as exactness_worker.py's, and per run: "expect_exit" (the exit code it must end with, 0 unless given)
and "zero_4bit_state" (the fault: every 4-bit moment this rank loads from a checkpoint is zeroed, as if the
checkpoint had dropped the 4-bit state).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))  # exactness_worker

from exactness_worker import _run_logged, exit_now  # noqa: E402

from memfit.distributed.fsdp import FullyShardedEngine  # noqa: E402


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
    original = FullyShardedEngine.load_checkpoint

    def load_then_zero(self, path, scheduler):
        state = original(self, path, scheduler)
        if _zero_4bit_moments(self.optimizer) == 0:
            raise RuntimeError("the fault found no 4-bit moment to zero")
        return state

    with mock.patch.object(FullyShardedEngine, "load_checkpoint", load_then_zero):
        yield


def run_all() -> int:
    spec = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    for run in json.loads(spec.read_text()):
        log_path = spec.with_name(f"{run['name']}.rank{rank}.log")
        with dropped_4bit_state() if run.get("zero_4bit_state") else contextlib.nullcontext():
            code = _run_logged(["train", *run["args"]], log_path)
        if code != run.get("expect_exit", 0):
            print(f"run {run['name']} (rank {rank}) exited {code}:\n{log_path.read_text()[-4000:]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    exit_now(run_all())
