"""Run `memfit train` several times in one torchrun launch, some runs with a gradient scale error injected.

    torchrun --nproc_per_node 2 exactness_worker.py RUNS.json

RUNS.json: [{"args": [train flags...], "grad_scale": null | float}, ...]. One launch for
several runs saves starting the interpreters and the process group again for each.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: fault_injection

from fault_injection import scaled_gradients  # noqa: E402
from memfit.cli.main import main  # noqa: E402


def run_all() -> int:
    for run in json.loads(Path(sys.argv[1]).read_text()):
        scale = run.get("grad_scale")
        with scaled_gradients(scale) if scale is not None else contextlib.nullcontext():
            code = main(["train", *run["args"]])
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(run_all())
