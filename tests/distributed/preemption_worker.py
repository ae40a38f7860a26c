"""Run `memfit train` several times in one torchrun launch, each with its own environment, keeping every exit code.

    torchrun --nproc_per_node 2 preemption_worker.py RUNS.json

RUNS.json: [{"name": NAME, "args": [train flags...], "env": {VAR: VALUE}, "half_step": bool}, ...]. Unlike
exactness_worker.py, a run that exits non-zero (a preempted run exits 75) does not stop the later ones;
NAME.rankR.code holds its code. "half_step": the run trains under fault_injection.half_applied_step_after_sigterm
(its fault twin shares the launch of the good runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from exactness_worker import _run_logged, environment, exit_now

from fault_injection import half_applied_step_after_sigterm


def run_all() -> int:
    spec = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    for run in json.loads(spec.read_text()):
        fault = half_applied_step_after_sigterm() if run.get("half_step") else contextlib.nullcontext()
        with environment(run.get("env", {})), fault:
            code = _run_logged(["train", *run["args"]], spec.with_name(f"{run['name']}.rank{rank}.log"))
        spec.with_name(f"{run['name']}.rank{rank}.code").write_text(str(code))
    return 0


if __name__ == "__main__":
    exit_now(run_all())
