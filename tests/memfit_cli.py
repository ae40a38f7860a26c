"""Run the real `memfit` command in a subprocess (importable from any test: tests/ is on pytest's path).

`run_memfit` starts a fresh interpreter per command. `WarmMemfit` (the `warm_memfit` fixture)
saves that start for the many short commands of the CLI tests: one server process imports
torch, transformers and memfit's training modules once, then forks a child per command, which
runs `python -m memfit ARGS` (the package's __main__, with the caller's environment, its exit
code, its own stdout and stderr) in a process of its own.
What the server printed while importing is put in front of every child's stdout and stderr, as
a fresh interpreter would print it, so "exactly one line on stderr" stays as strict.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Imported by the server before it answers; then whatever a warm-up command imported (see _serve).
# transformers' model-loading code is imported lazily (on the first from_pretrained); importing it here rather than
# in the warm-up child keeps the server from importing it twice.
WARM_MODULES = ("torch", "transformers", "transformers.modeling_utils", "memfit.cli.main", "memfit.cli.train",
                "memfit.cli.estimate", "memfit.cli.plan", "memfit.cli.profile", "memfit.cli.find_batch_size")


def run_memfit(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the real `memfit` command in a subprocess (exit code, stdout, stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "memfit", *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


class WarmMemfit:
    """`memfit ARGS` in a child forked from a server that has imported torch and memfit already."""

    def __init__(self, *warmup: str) -> None:
        """`warmup`: a command whose imports the server makes its own (one that goes as deep as the commands will)."""
        self._server = subprocess.Popen(
            [sys.executable, __file__, "--serve", json.dumps(list(map(str, warmup)))], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, cwd=REPO,
        )
        ready = json.loads(self._server.stdout.readline() or "null")
        assert ready is not None, "the memfit server did not start"
        self.import_stdout: str = ready["import_stdout"]
        self.import_stderr: str = ready["import_stderr"]

    def run(self, *args: str, timeout: int = 300, cwd: str | os.PathLike | None = None,
            file_size_limit: int | None = None, hidden: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`memfit ARGS` in a forked child; `cwd`: its working directory (the repository's by default);
        `file_size_limit`: bytes, the child's RLIMIT_FSIZE (`ulimit -f`), none by default; `hidden`: packages the
        child cannot import (their `sys.modules` entries set to None, as for a missing package); `env`: variables
        set for this command only, over the caller's environment (a `sitecustomize` on its PYTHONPATH, such as
        tests/fault_shim's, runs in the child before the command, as a fresh interpreter would run it at start)."""
        command = ["memfit", *map(str, args)]
        request = {"args": command[1:], "timeout": timeout, "env": {**os.environ, **(env or {})},  # the caller's, now
                   "cwd": str(cwd or REPO), "file_size_limit": file_size_limit, "hidden": list(hidden)}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        answer = json.loads(self._server.stdout.readline() or "null")
        assert answer is not None, "the memfit server died"
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, answer["stdout"], answer["stderr"])
        return subprocess.CompletedProcess(command, answer["returncode"], self.import_stdout + answer["stdout"],
                                           self.import_stderr + answer["stderr"])

    def close(self) -> None:
        self._server.stdin.close()
        self._server.wait(timeout=30)


def _child(args: list[str], stdout_path: str, stderr_path: str, env: dict | None = None, cwd: str | None = None,
           file_size_limit: int | None = None, hidden: list[str] | None = None) -> None:
    """In the forked child: `python -m memfit ARGS`, exit as the interpreter would."""
    import atexit
    import runpy
    import traceback

    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:  # relative paths of the command resolve where the caller's would
        os.chdir(cwd)

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the child's own streams on the new descriptors
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.argv = [str(REPO / "src" / "memfit" / "__main__.py"), *args]
    for name in hidden or ():  # `import NAME` (and of its submodules) now raises ImportError, even if the server had it
        # A submodule the server holds would still import by its full name (Python looks it up before its parent).
        for loaded in [name, *(key for key in sys.modules if key.startswith(name + "."))]:
            sys.modules[loaded] = None
    if file_size_limit is not None:
        # Set once the output files above are open. Python ignores SIGXFSZ (the server, so this child, too), so a
        # write past the limit fails with EFBIG, as in a fresh interpreter.
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    try:  # a failure of either is the command's, in its stderr: this child never returns to the server's loop
        _site_customize((env or {}).get("PYTHONPATH", ""))
        runpy.run_module("memfit", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as error:
        if error.code is None or isinstance(error.code, int):
            code = error.code or 0
        else:
            print(error.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        import threading

        threading._shutdown()  # what the interpreter does on its way out: wait for non-daemon threads,
        atexit._run_exitfuncs()  # then run the exit handlers
    except BaseException:
        traceback.print_exc()
        code = code or 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _site_customize(pythonpath: str) -> None:
    """What a fresh interpreter does at start-up with this PYTHONPATH: run the first `sitecustomize` on it (the
    fault shim's, tests/fault_shim), unless it is the one the server ran itself."""
    import importlib.util

    for entry in filter(None, pythonpath.split(os.pathsep)):
        path = Path(entry, "sitecustomize.py")
        if path.is_file():
            ran = getattr(sys.modules.get("sitecustomize"), "__file__", None)
            if ran is None or Path(ran).resolve() != path.resolve():
                # Imported as a module and kept in sys.modules, as at start-up: what it holds stays referenced (the
                # shim's entered fault would be lifted if its namespace were collected).
                spec = importlib.util.spec_from_file_location("sitecustomize", path)
                module = importlib.util.module_from_spec(spec)
                sys.modules["sitecustomize"] = module
                spec.loader.exec_module(module)
            return


def _quiet_as_memfit_does() -> list:
    """The loggers that memfit's main quiets before it imports a command's modules, quieted the same way.

    Read from main's own constants; if they cannot be found, nothing is quieted (and the tests
    that count stderr lines fail rather than pass on less than a real run prints).
    """
    import logging

    from memfit.cli.main import main

    names = next((c for c in main.__code__.co_consts if isinstance(c, tuple) and "torchao" in c), ())
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    return loggers


def _modules_imported_by(warmup: list[str], scratch: str) -> list[str]:
    """The modules a forked child had imported, in order, after running `memfit WARMUP` (output under scratch)."""
    if not warmup:
        return []
    listing = os.path.join(scratch, "modules.json")
    pid = os.fork()
    if pid == 0:
        import atexit

        atexit.register(lambda: Path(listing).write_text(json.dumps(list(sys.modules))))
        # Its own speed cache: what the warm-up measured never ranks a test's plan (tests/conftest.py).
        _child([arg.replace("{scratch}", scratch) for arg in warmup], os.path.join(scratch, "warmup.stdout"),
               os.path.join(scratch, "warmup.stderr"), {**os.environ, "MEMFIT_CACHE_DIR": os.path.join(scratch, "cache")})
    os.waitpid(pid, 0)
    return json.loads(Path(listing).read_text()) if os.path.exists(listing) else []


def _serve() -> None:
    """Import once, then fork a child per request line on stdin; answer one line per request on stdout."""
    import importlib
    import logging
    import shutil
    import signal
    import tempfile
    import time

    sys.path[0] = str(REPO)  # as `python -m memfit` run in REPO has it (not tests/)
    replies = os.fdopen(os.dup(1), "w")  # only the answers go to the client
    scratch = tempfile.mkdtemp(prefix="memfit-warm-")
    import_out, import_err = os.path.join(scratch, "import.stdout"), os.path.join(scratch, "import.stderr")
    saved_stderr = os.dup(2)
    os.dup2(os.open(import_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    os.dup2(os.open(import_err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    quieted = _quiet_as_memfit_does()
    try:
        for name in WARM_MODULES:
            importlib.import_module(name)
        for name in _modules_imported_by(json.loads(sys.argv[2]), scratch):
            if name not in sys.modules:
                with contextlib.suppress(Exception):  # modules made at run time (torch's) do not import by name
                    importlib.import_module(name)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_stderr, 2)
        for logger in quieted:  # as in a fresh interpreter: memfit's main sets them itself
            logger.setLevel(logging.NOTSET)
    replies.write(json.dumps({"import_stdout": Path(import_out).read_text(),
                              "import_stderr": Path(import_err).read_text()}) + "\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        pid = os.fork()
        if pid == 0:
            _child(request["args"], out, err, request.get("env"), request.get("cwd"), request.get("file_size_limit"),
                   request.get("hidden"))
        deadline, status, timed_out = time.monotonic() + request["timeout"], None, False
        while status is None:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = raw
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                status, timed_out = os.waitpid(pid, 0)[1], True
            else:
                time.sleep(0.01)
        code = os.waitstatus_to_exitcode(status)
        replies.write(json.dumps({"returncode": code, "timed_out": timed_out, "stdout": Path(out).read_text(),
                                  "stderr": Path(err).read_text()}) + "\n")
        replies.flush()
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    _serve()
