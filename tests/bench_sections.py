"""Running a benchmark script in --quick mode into a scratch benchmarks.md, as the benchmark smoke tests do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEPT = "## Another benchmark\n\nkept as it is"


def run_into_section(script: str, section: str, tmp_path: Path, *args: str) -> tuple[str, dict]:
    """Run `benchmarks/SCRIPT ARGS --out ... --json ...` over a benchmarks.md holding another section; check that
    section is kept and `section` written once; returns the text after `section`'s heading and the raw JSON."""
    out, raw = tmp_path / "benchmarks.md", tmp_path / "raw.json"
    out.write_text(f"# Benchmarks\n\n{KEPT}\n")
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args, "--out", str(out),
                             "--json", str(raw)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    text = out.read_text()
    assert KEPT in text
    assert text.count(section) == 1
    return text.split(section, 1)[1], json.loads(raw.read_text())
