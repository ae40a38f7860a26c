"""The techniques benchmark runs end to end on a toy model and writes its tables (figures are never asserted)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from memfit.memory.categories import CATEGORIES

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_techniques.py"
SECTION = "## Techniques, one by one and stacked"


def _bench_module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_techniques
    finally:
        sys.path.pop(0)
    return bench_techniques


def test_bench_techniques_quick_writes_its_section(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Another benchmark\n\nkept as it is\n")
    raw = tmp_path / "raw.json"
    command = [sys.executable, str(SCRIPT), "--quick", "--only", "baseline,offload", "--device", "cpu"]
    result = subprocess.run(
        [*command, "--out", str(out), "--json", str(raw)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    text = out.read_text()
    assert "## Another benchmark\n\nkept as it is" in text
    assert text.count(SECTION) == 1
    section = text.split(SECTION, 1)[1]
    assert "### CPU, " in section
    assert "| row | tokens/s | vs base | peak RSS, steps (MiB) |" in section
    assert "| row | parameters | gradients | optimizer state | activations | other |" in section
    assert "Command: `python benchmarks/bench_techniques.py --quick" in section
    assert "Machine: " in section and "load average" in section and "Date: " in section
    runs = json.loads(raw.read_text())
    assert set(runs) == {"baseline", "offload"}
    for run in runs.values():
        assert run["peak_bytes"] > 0 and run["process_peak_bytes"] > 0 and run["tracked_peak_bytes"] > 0
        assert set(run["tracked_breakdown"]) == set(CATEGORIES)
    # Optimizer offload has nothing to do on a CPU: the run says so, and the table shows it.
    # Activation offload runs on CPU too (its copies count as host memory), so it is no fallback.
    assert set(runs["offload"]["fallbacks"]) == {"optimizer_offload"}
    assert "optimizer_offload: optimizer offload has no effect on CPU" in section


def test_every_row_is_accepted_by_memfit_flags(tmp_path):
    from memfit.cli.flags import parse_command_line

    bench = _bench_module()
    args = argparse.Namespace(batch_size=2, seq_len=1024)
    rows = {name: flags for name, _, flags in bench.all_rows()}
    assert list(rows)[0] == "baseline" and len(rows) == len(set(rows))
    for name, flags in rows.items():
        config, _ = parse_command_line(bench.memfit_flags(args, tmp_path / "model", tmp_path / "cache", flags))
        assert config.data.seq_len == 1024 and config.memory.loss_chunk_size is not None, name
        # Every row trains on the same samples per optimizer step.
        assert config.training.batch_size * config.training.gradient_accumulation_steps == 2, name
    # Stacked rows keep what the rows before them switched on.
    last, _ = parse_command_line(
        bench.memfit_flags(args, tmp_path / "model", tmp_path / "cache", rows["stack-chunked-loss"])
    )
    assert last.memory.precision == "amp" and last.memory.gradient_checkpointing == "full"
    assert last.optimizer.optimizer == "adamw-8bit" and last.training.gradient_accumulation_steps == 2
    assert last.lora.lora_r == 16 and last.lora.quantize == "4bit" and last.memory.loss_chunk_size == 512
