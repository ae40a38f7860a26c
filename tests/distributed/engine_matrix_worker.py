"""Run `memfit train` once per engine x optimizer in one process (or under torchrun, on every rank).

    python engine_matrix_worker.py SPEC.json

SPEC.json: {"results": RESULTS.json, "out_root": DIR, "optimizers": [...], "engines": {NAME: [flags...]},
"train_args": [...]}. Each run's exit code and the lines it printed on stderr (memfit's one-line
errors and any traceback) are written by rank 0 to RESULTS.json as {engine: {optimizer: cell}}.
Starting the interpreter and the process group once for all engines and optimizers keeps the
matrix within seconds per cell.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def _run_cell(memfit_main, argv: list[str]) -> tuple[int, str]:
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        try:
            code = memfit_main(argv)
        except SystemExit as error:
            code = error.code if isinstance(error.code, int) else 1
        except BaseException:  # a crash is what the matrix looks for: record it
            traceback.print_exc()
            code = 1
    return code, captured.getvalue()


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as handle:
        spec = json.load(handle)
    from memfit.cli.main import main as memfit_main

    results: dict[str, dict] = {}
    crashed = False
    for engine, flags in spec["engines"].items():
        results[engine] = {}
        for optimizer in spec["optimizers"]:
            out = os.path.join(spec["out_root"], engine, optimizer)
            code, stderr = _run_cell(memfit_main, ["train", *spec["train_args"], *flags, "--optimizer", optimizer, "--output-dir", out])
            results[engine][optimizer] = {"exit_code": code, "stderr": stderr, "output_dir": out}
            if code not in (0, 2):
                crashed = True  # after a crash on one rank the process group may be broken: later cells would hang
                break
        if crashed:
            break
    if int(os.environ.get("RANK", "0")) == 0:
        with open(spec["results"], "w", encoding="utf-8") as handle:
            json.dump(results, handle)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not waiting for a peer that may be stuck in a collective


if __name__ == "__main__":
    main()
