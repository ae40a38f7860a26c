"""Preemption under torchrun (2 gloo ranks, FSDP2): a signal on rank 1 only stops both ranks after the same step,
each rank writes its shards of that step, and resuming ends on the uninterrupted run's weights.

The fault twin applies the step in flight on rank 1 to half of its parameters only (fault_injection), as a rank
that saved in the middle of its update would: the resumed weights then differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_helpers import EXTENSIONS_CACHE, REPO, final_weights

from fault_injection import SGD_FLAGS
from memfit.checkpoint_files import checkpoint_problem, list_checkpoints
from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("preemption_worker.py")


def _launch(runs: list[dict], root: Path, env: dict | None = None) -> dict[str, list[int]]:
    """One torchrun launch of `runs`; returns each run's exit code per rank."""
    root.mkdir(parents=True, exist_ok=True)
    spec = root / "runs.json"
    spec.write_text(json.dumps(runs))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER), str(spec)]
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_CACHE), "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO, env=environment)
    assert done.returncode == 0, done.stderr[-6000:]
    return {run["name"]: [int((root / f"{run['name']}.rank{r}.code").read_text()) for r in (0, 1)] for run in runs}


@pytest.fixture(scope="module")
def launches(run_args, tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt-torchrun")
    args = [*run_args, *SGD_FLAGS, "--lr", "0.5", "--max-steps", "4", "--batch-size", "2", "--sharding", "fsdp"]
    signal_rank1 = {"MEMFIT_PREEMPT_AT": "forward:2:1"}  # rank 1 only: rank 0 learns it from the agreement

    def runs(prefix: str, half_step: bool = False) -> list[dict]:
        out = root / prefix
        return [{"name": f"{prefix}-preempted", "args": [*args, "--output-dir", str(out)], "env": signal_rank1,
                 "half_step": half_step},
                {"name": f"{prefix}-resumed", "args": [*args, "--output-dir", str(out), "--resume", "auto"],
                 "half_step": half_step}]

    # One launch: starting two ranks costs more than these 4-step runs. The twin's fault is put into its own two
    # runs in the worker (fault_injection.half_applied_step_after_sigterm), where a second launch set it for the
    # whole process through the environment (MEMFIT_FAULT_PREEMPT_PARTIAL).
    codes = _launch([{"name": "straight", "args": [*args, "--output-dir", str(root / "straight")]}, *runs("good"),
                     *runs("twin", half_step=True)], root / "launch")
    return root, codes


def test_signal_on_one_rank_stops_both_after_the_same_step_and_resumes_exactly(launches):
    root, codes = launches
    assert codes["straight"] == [0, 0] and codes["good-preempted"] == [75, 75] and codes["good-resumed"] == [0, 0]
    events = [r for r in read_metrics(root / "good" / "metrics.jsonl") if r.get("event") == "preempted"]
    assert [(e["step"], e["signal"]) for e in events] == [(2, "another rank's signal")]  # rank 0 logs; rank 1 was signalled
    checkpoint = root / "good" / "checkpoints" / "step-2"
    assert checkpoint in list_checkpoints(root / "good") and checkpoint_problem(checkpoint) is None
    assert (checkpoint / "shards").is_dir() and (checkpoint / "rng-1.pt").is_file()
    straight, resumed = final_weights(root / "straight"), final_weights(root / "good")
    for name, tensor in straight.items():
        assert torch.equal(resumed[name], tensor), name


def test_fault_twin_step_half_applied_on_one_rank_fails_the_check(launches):
    root, codes = launches
    assert codes["twin-preempted"] == [75, 75] and codes["twin-resumed"] == [0, 0]
    straight, resumed = final_weights(root / "straight"), final_weights(root / "twin")
    assert any(not torch.equal(resumed[name], tensor) for name, tensor in straight.items())
