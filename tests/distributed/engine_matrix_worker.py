"""Run `memfit train` once per optimizer in one process (or under torchrun, on every rank).

    python engine_matrix_worker.py RESULTS.json OUT_ROOT OPTIMIZER[,OPTIMIZER...] -- TRAIN ARGS...

Each run's exit code and the lines it printed on stderr (memfit's one-line errors and any
traceback) are written by rank 0 to RESULTS.json. Starting the interpreter and the process
group once for all optimizers keeps the matrix within seconds per cell.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def main() -> None:
    results_path, out_root, optimizers = sys.argv[1:4]
    train_args = sys.argv[sys.argv.index("--") + 1 :]
    from memfit.cli.main import main as memfit_main

    results = {}
    for optimizer in optimizers.split(","):
        out = os.path.join(out_root, optimizer)
        captured = io.StringIO()
        with contextlib.redirect_stderr(captured):
            try:
                code = memfit_main(["train", *train_args, "--optimizer", optimizer, "--output-dir", out])
            except SystemExit as error:
                code = error.code if isinstance(error.code, int) else 1
            except BaseException:  # a crash is what the matrix looks for: record it
                traceback.print_exc()
                code = 1
        results[optimizer] = {"exit_code": code, "stderr": captured.getvalue(), "output_dir": out}
        if code not in (0, 2):
            break  # after a crash on one rank the process group may be broken: later cells would hang
    if int(os.environ.get("RANK", "0")) == 0:
        with open(results_path, "w", encoding="utf-8") as handle:
            json.dump(results, handle)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not waiting for a peer that may be stuck in a collective


if __name__ == "__main__":
    main()
