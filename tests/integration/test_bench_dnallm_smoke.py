"""The DNALLM benchmark runs end to end at its quick sizes and writes its section (figures are not asserted, except
that each side measured something and the table holds the four rows)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_dnallm.py"
SECTION = "## DNALLM's Trainer against memfit (DNA sequence classification)"


def test_bench_dnallm_quick_writes_its_section(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Another benchmark\n\nkept as it is\n")
    raw = tmp_path / "raw.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--json", str(raw)],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    text = out.read_text()
    assert "kept as it is" in text and SECTION in text
    for row in ("samples/s", "tracked peak (live tensors)", "process peak RSS", "longest sequence under a"):
        assert row in text
    data = json.loads(raw.read_text())
    for kind in ("hf", "memfit"):
        assert data["throughput"][kind]["samples_per_second"] > 0
        assert data["throughput"][kind]["tracked_peak_bytes"] > 0
    assert data["longest"]["hf"] >= 32  # the cap is the Trainer's own peak at the first length: it fits that one
    assert data["cap_bytes"] > 0
