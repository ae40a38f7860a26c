"""The planned-run-against-Trainer benchmark runs end to end on a toy model and writes its section (figures are
never asserted: they are what the machine measured)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_planned_vs_trainer.py"
SECTION = "## Planned run with trials against the Trainer's best setting"


@pytest.mark.slow
def test_bench_planned_quick_writes_its_section(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Another benchmark\n\nkept as it is\n")
    completed = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--no-bf16"],
                               capture_output=True, text=True, timeout=900, cwd=REPO)
    assert completed.returncode == 0, completed.stderr[-3000:]
    text = out.read_text()
    assert "## Another benchmark\n\nkept as it is" in text
    section = text[text.index(SECTION):]
    assert "Command: `python benchmarks/bench_planned_vs_trainer.py --quick`" in section
    assert "memfit planned, default ISA, empty cache (trials run)" in section
    assert "rho before calibration" in section
    # the trials ran (forced for this short run) and each candidate says what became of it
    assert "| measured |" in section or "| over cap |" in section
