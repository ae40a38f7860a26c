"""Run `memfit train` several times in one process, some runs with a gradient scale error injected.

    [torchrun --nproc_per_node 2] exactness_worker.py RUNS.json

RUNS.json: [{"name": NAME, "args": [train flags...], "grad_scale": null | float}, ...]. One
process (or one torchrun launch) for several runs saves starting the interpreters, importing
torch and transformers, and creating the process group again for each. Each run's stderr
(memfit's log lines, and a traceback if it crashes) goes to NAME.rankR.log beside RUNS.json;
a failing run's log is copied to the real stderr and the later runs are not started.

A run that reads an earlier run's output names it in "after": rank 0 waits until every rank has finished those
runs (NAME.rankR.done), then copies "checkpoint_copy": [SOURCE, TARGET, LAST_STEP] (torchrun_helpers.checkpoint_copy)
and adds "--memory-cap" computed from the tracked run "cap_from" (torchrun_helpers.rank1_split_cap); the other
ranks wait for the arguments it wrote. "env": variables set for that run only. So runs that depend on others
share their launch instead of starting the ranks again.

"exits": the exit codes the run may end with ([0] unless given); each run's code goes to NAME.rankR.exit. A run
marked "record" (the engine matrix's cells, last in a launch) may end with any code: one outside "exits" (a crash,
after which the process group may be broken) ends the launch's later runs, with exit status 0, for the test to
report. "fault": "MODULE:NAME", a context manager of a module beside this file, injected around that run only.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: fault_injection

from torchrun_helpers import checkpoint_copy, rank1_split_cap  # noqa: E402

from fault_injection import scaled_gradients  # noqa: E402
from memfit.cli.main import main  # noqa: E402

WAIT_SECONDS = 900  # a rank that crashed never marks its run done: fail rather than hang the launch


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


def _wait_for(paths: list[Path]) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_SECONDS} s for {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.05)


def _prepared_args(run: dict, spec: Path, rank: int, world: int) -> list[str]:
    """The run's arguments, once what it reads from the runs in its "after" is there (see the module's doc)."""
    if not run.get("after"):
        return run["args"]
    ready = spec.with_name(f"{run['name']}.args.json")
    if rank == 0:
        _wait_for([spec.with_name(f"{name}.rank{r}.done") for name in run["after"] for r in range(world)])
        args = list(run["args"])
        if "checkpoint_copy" in run:
            source, target, last_step = run["checkpoint_copy"]
            checkpoint_copy(Path(source), Path(target), last_step)
        if "cap_from" in run:
            args += ["--memory-cap", str(rank1_split_cap(Path(run["cap_from"])))]
        written = ready.with_suffix(".tmp")
        written.write_text(json.dumps(args))
        written.rename(ready)  # whole or absent: another rank never reads half the file
    _wait_for([ready])
    return json.loads(ready.read_text())


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """Set these environment variables inside, as they were after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _fault(run: dict):
    """The run's "fault" (MODULE:NAME of a module in this directory), or no fault."""
    if not run.get("fault"):
        return contextlib.nullcontext()
    module, name = run["fault"].split(":")
    return getattr(importlib.import_module(module), name)()


def run_all() -> int:
    spec = Path(sys.argv[1])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    for run in json.loads(spec.read_text()):
        scale = run.get("grad_scale")
        log_path = spec.with_name(f"{run['name']}.rank{rank}.log")
        args = _prepared_args(run, spec, rank, world)
        with (scaled_gradients(scale) if scale is not None else contextlib.nullcontext(),
              environment(run.get("env") or {}), _fault(run)):
            code = _run_logged(["train", *args], log_path)
        spec.with_name(f"{run['name']}.rank{rank}.exit").write_text(str(code))
        if code not in run.get("exits", [0]):
            if run.get("record"):
                return 0  # the cell's test reports the crash; the cells after it are not run
            print(f"run {run['name']} (rank {rank}) exited {code}:\n{log_path.read_text()[-4000:]}", file=sys.stderr)
            return code or 1
        spec.with_name(f"{run['name']}.rank{rank}.done").touch()
    return 0


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown: freeing torch's, transformers' and DeepSpeed's modules
    one by one takes about 5 s of a launch (measured), and every file a run writes is closed by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(run_all())
