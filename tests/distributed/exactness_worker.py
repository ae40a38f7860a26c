"""Run `memfit train` several times in one process, some runs with a gradient scale error injected.

    [torchrun --nproc_per_node 2] exactness_worker.py RUNS.json

RUNS.json: [{"name": NAME, "args": [train flags...], "grad_scale": null | float}, ...]. One
process (or one torchrun launch) for several runs saves starting the interpreters, importing
torch and transformers, and creating the process group again for each. Each run's stderr
(memfit's log lines, and a traceback if it crashes) goes to NAME.rankR.log beside RUNS.json;
a failing run's log is copied to the real stderr and the later runs are not started.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: fault_injection

from fault_injection import scaled_gradients  # noqa: E402
from memfit.cli.main import main  # noqa: E402


def _run_logged(argv: list[str], log_path: Path) -> int:
    """`memfit ARGV` with file descriptor 2 sent to `log_path` (what a separate process would print)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log_path, "w", encoding="utf-8") as log:
        os.dup2(log.fileno(), 2)
        try:
            code = main(argv)
        except SystemExit as error:
            code = error.code if isinstance(error.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
    return code


def run_all() -> int:
    spec = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    for run in json.loads(spec.read_text()):
        scale = run.get("grad_scale")
        log_path = spec.with_name(f"{run['name']}.rank{rank}.log")
        with scaled_gradients(scale) if scale is not None else contextlib.nullcontext():
            code = _run_logged(["train", *run["args"]], log_path)
        if code != 0:
            print(f"run {run['name']} (rank {rank}) exited {code}:\n{log_path.read_text()[-4000:]}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(run_all())
