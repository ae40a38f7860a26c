"""The engine benchmark runs end to end on a toy model and writes its table (figures are never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_engine.py"
SECTION = "## Engine: memory switches and Hugging Face Trainer"


def test_bench_engine_quick_writes_its_section(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Another benchmark\n\nkept as it is\n")
    raw = tmp_path / "raw.json"
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--steps",
            "2",
            "--only",
            "hf,baseline",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--json",
            str(raw),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    text = out.read_text()
    assert "## Another benchmark\n\nkept as it is" in text
    assert text.count(SECTION) == 1
    section = text.split(SECTION, 1)[1]
    assert "### CPU, " in section  # one subsection per kind of machine
    assert "| configuration | tokens/s | peak RSS (MiB) |" in section
    assert "Hugging Face Trainer (reference)" in section and "memfit baseline" in section
    assert "Command: `python benchmarks/bench_engine.py --quick" in section
    assert "Machine: " in section and "Date: " in section
    runs = json.loads(raw.read_text())["runs"]
    # Same weights, same samples, same loss: the two trainers start from the same point.
    assert abs(runs["hf"][0]["first_loss"] - runs["baseline"][0]["first_loss"]) < 1e-3
    assert all(run["peak_bytes"] > 0 for name in ("hf", "baseline") for run in runs[name])


def test_write_section_replaces_only_its_section(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from _common import write_section
    finally:
        sys.path.pop(0)
    doc = tmp_path / "benchmarks.md"
    write_section(doc, "First", "one")
    write_section(doc, "Second", "two")
    write_section(doc, "First", "one again")
    write_section(doc, "Second", "cpu figures", "CPU")
    write_section(doc, "Second", "gpu figures", "GPU")
    write_section(doc, "Second", "cpu figures again", "CPU")
    text = doc.read_text()
    assert text.startswith("# Benchmarks")
    assert "one again" in text and "\none\n" not in text
    assert text.index("## First") < text.index("## Second") and "two" in text
    assert "cpu figures again" in text and "cpu figures\n" not in text and "gpu figures" in text
    assert text.index("### CPU") < text.index("### GPU")
