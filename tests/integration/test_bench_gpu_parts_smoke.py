"""The overlap part of benchmarks/gpu_truth.sh runs its offload row on a CPU, in this process, on the tiny model
(figures are never asserted; what the offload moved is)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_offload_row_moves_at_least_the_estimated_bytes_and_fetches_ahead(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_offload_overlap
        from _common import byte_corpus
    finally:
        sys.path.pop(0)
    row = "+ --activation-offload"
    spec = {"model": "tiny", "row": row, "dataset": byte_corpus(tmp_path, 256 * 3), "seq_len": 256,
            "batch_size": 1, "steps": 1, "warmup": 0, "output_dir": str(tmp_path / "run"),
            "cache_dir": str(tmp_path / "cache")}
    result = bench_offload_overlap.worker(spec)
    assert result["step_seconds"] > 0 and result["tokens_per_second"] > 0 and result["oom_events"] == 0
    # Out in forward and back in backward: every block input and what the head saves for the loss cross.
    assert result["offloaded_bytes_per_micro_batch"] >= result["estimated_pcie_bytes"] > 0
    assert result["fetched_ahead"] > 0  # backward brought block inputs back ahead of their use
    cells = bench_offload_overlap._row("tiny", 1, row, result, result, "")
    assert len(cells) == len(bench_offload_overlap.HEADERS) and cells[5] == "1.000"
