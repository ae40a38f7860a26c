"""The frontier benchmark's CPU path: the planner's longest context and the full fine-tune train under the cap."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_frontier_gpu.py"


@pytest.mark.slow
def test_frontier_benchmark_trains_the_planned_runs_under_the_cap(tmp_path):
    pytest.importorskip("bitsandbytes")  # QLoRA
    spec = importlib.util.spec_from_file_location("bench_frontier_gpu", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--device", "cpu", "--quick", "--steps", "2", "--out", str(tmp_path / "bench.md")])
    assert len(rows) == 2
    for name, row in rows.items():
        # trained under the emulated cap without running out of memory
        assert row["tracked_peak_bytes"] <= 24 * 2**20, name
        assert len(row["losses"]) == 2
    full = next(row for name, row in rows.items() if name.startswith("full"))
    assert abs(full["estimated_peak_bytes"] / full["tracked_peak_bytes"] - 1) <= 0.10
    qlora = next(row for name, row in rows.items() if name.startswith("QLoRA"))
    # A 2-block toy QLoRA run carries fixed costs the estimate does not model (measured -20 %);
    # at the benchmark's reduced shape the error is -3 % (docs/long-context.md). Bound it here
    # so that a larger drift fails.
    assert abs(qlora["estimated_peak_bytes"] / qlora["tracked_peak_bytes"] - 1) <= 0.25
    assert qlora["plan"]["seq_len"] >= 1024 and qlora["plan"]["quantize"] == "4bit"
    assert "Frontier runs" in (tmp_path / "bench.md").read_text()
