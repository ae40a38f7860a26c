"""Run the real `memfit` command in a subprocess (importable from any test: tests/ is on pytest's path)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_memfit(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the real `memfit` command in a subprocess (exit code, stdout, stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "memfit", *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
