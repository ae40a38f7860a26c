"""Send signals to a `memfit train` run of the warm server (tests/memfit_cli.py) at a chosen moment."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (the warm server's forked runs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _steps_logged(metrics: Path) -> int:
    """Step lines the run has written so far; read while the run writes, so a last line not yet ended by its
    newline (half written, or cut by a kill) is not counted and not parsed."""
    if not metrics.is_file():
        return 0
    complete = metrics.read_text().split("\n")[:-1]
    return sum(1 for line in complete if line.strip() and "event" not in _parsed(line))


def _parsed(line: str) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError:  # a line a SIGKILL cut, followed by the resumed run's first line
        return {"event": "unreadable"}


def run_with_signals(warm_memfit, args: list[str], out: Path, signals: list[int], delay: float):
    """Run `memfit ARGS` and send `signals` to it once it has logged a step (beyond those already in its
    metrics) and `delay` seconds more; returns the CompletedProcess."""
    result = {}
    before = _steps_logged(out / "metrics.jsonl")
    thread = threading.Thread(target=lambda: result.update(done=warm_memfit.run(*args)))
    thread.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and thread.is_alive() and _steps_logged(out / "metrics.jsonl") <= before:
        time.sleep(0.01)
    time.sleep(delay)
    for number in signals:
        for child in children(warm_memfit._server.pid):
            os.kill(child, number)
        time.sleep(0.005)
    thread.join(timeout=600)
    return result["done"]
