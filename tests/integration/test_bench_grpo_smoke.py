"""The GRPO benchmark (memfit against TRL's GRPOTrainer) runs end to end on a toy model and writes its section
(figures are never asserted, only that both tools generated and trained the same amount of work)."""

from __future__ import annotations

import pytest

from bench_sections import run_into_section

SECTION = "## Online RL (GRPO): memfit and TRL's GRPOTrainer"


def test_bench_grpo_quick_writes_its_section(tmp_path):
    pytest.importorskip("trl")
    section, data = run_into_section("bench_grpo.py", SECTION, tmp_path, "--quick", "--longest", "1MiB")
    assert "### CPU, " in section  # one subsection per kind of machine
    assert "| run | steps/s | steps/CPU s | peak RSS (MiB) | start-up (s) | mean length | load |" in section
    assert "TRL GRPOTrainer, its defaults" in section and "memfit `--task grpo`, its defaults" in section
    assert "(1) each at its defaults" in section and "(2) same settings" in section
    assert "**Longest completion within 1MiB**" in section
    assert "Command: `python benchmarks/bench_grpo.py --quick" in section
    assert "Machine: " in section and "Date: " in section and "load average" in section
    runs = data["runs"]
    assert set(runs) == {"trl", "memfit", "trl-no-ckpt", "memfit-ckpt"}
    assert all(run["peak_bytes"] > 0 and run["steps_per_second"] > 0 for results in runs.values() for run in results)
    # The same work on both sides: every step of every run generated completions of the same mean length (the toy
    # model rarely samples its EOS) and was scored by the same reward function.
    for results in runs.values():
        for run in results:
            assert len(run["mean_lengths"]) == run["steps"] and min(run["mean_lengths"]) >= 15.0, run
            assert all(0.0 <= reward <= 1.0 for reward in run["rewards"])
    assert runs["trl"][0]["ran"]["gradient_checkpointing"] is True
    assert runs["memfit-ckpt"][0]["ran"]["gradient_checkpointing"].startswith("full")
    # A 1 MiB cap: every side's first ladder length is over it, and the ladder stops there.
    assert {name: [entry["length"] for entry in entries] for name, entries in data["longest"].items()} == {
        "trl": [8], "memfit": [8], "memfit-ckpt": [8]}
    assert all(not entry["fits"] and entry["completed"] for entries in data["longest"].values() for entry in entries)


def test_bench_grpo_learning_quick_writes_its_subsection(tmp_path):
    """--learning --quick: both tools train on the token-value reward and the rises go into their own subsection."""
    pytest.importorskip("trl")
    section, data = run_into_section("bench_grpo.py", SECTION, tmp_path, "--learning", "--quick")
    assert "### CPU, 2 cores, learning: mean reward per step" in section
    assert "| tool | first 2 steps | last 2 steps | rise | rise per seed | run (s, mean) | load |" in section
    assert "| step | TRL | memfit |" in section and "Command: `python benchmarks/bench_grpo.py --learning" in section
    runs = data["learning"]
    for tool in ("trl", "memfit"):  # each step of each tool scored by the same reward, in [0, 1]
        assert len(runs[tool]) == 1 and len(runs[tool][0]["rewards"]) == 4, runs[tool]
        assert all(0.0 <= reward <= 1.0 for reward in runs[tool][0]["rewards"])
