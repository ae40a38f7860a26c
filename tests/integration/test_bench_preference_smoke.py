"""The DPO benchmark (memfit against TRL's DPOTrainer) runs end to end on a toy model and writes its section
(figures are never asserted, only that both tools trained the same pairs alike)."""

from __future__ import annotations

import sys

import pytest

from bench_sections import REPO, run_into_section

SECTION = "## Preference tuning (DPO): memfit and TRL's DPOTrainer"


def test_bench_preference_quick_writes_its_section(tmp_path):
    pytest.importorskip("trl")
    section, data = run_into_section("bench_preference.py", SECTION, tmp_path, "--quick", "--longest", "2GiB")
    assert "### CPU, " in section  # one subsection per kind of machine
    assert "| run | pairs/s | pairs/CPU s | peak RSS (MiB) | start-up (s) | loss at step 2 | load |" in section
    assert "TRL DPOTrainer, its defaults" in section and "memfit `--task dpo`, its defaults" in section
    assert "(1) each at its defaults" in section and "(2) same settings" in section
    assert "**Longest pair within 2GiB**" in section
    assert "Command: `python benchmarks/bench_preference.py --quick" in section
    assert "Machine: " in section and "Date: " in section and "load average" in section
    runs = data["runs"]
    assert set(runs) == {"trl", "memfit", "trl-no-ckpt", "memfit-ckpt", "trl-precompute", "memfit-cached"}
    assert all(run["peak_bytes"] > 0 and run["pairs_per_second"] > 0 for results in runs.values() for run in results)
    # Same weights, same pairs in the same order, same settings: the same loss after the first update.
    second = [run["losses"][1] for results in runs.values() for run in results]
    assert max(second) - min(second) < 1e-4, second
    assert runs["trl"][0]["ran"]["reference"] == "frozen copy" and runs["memfit"][0]["ran"]["reference"] == "copy"
    assert runs["trl-precompute"][0]["ran"]["reference"] == "precomputed"
    assert runs["memfit-cached"][0]["ran"]["reference"] == "cached"
    assert [entry["length"] for entry in data["longest"]["memfit"]] == [128, 256]


def test_longest_interpolates_between_the_ladder_lengths():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from peer_runs import longest_of
    finally:
        sys.path.pop(0)
    mib = 1024**2
    ladder = [{"length": 512, "completed": True, "peak_bytes": 600 * mib, "fits": True},
              {"length": 1024, "completed": True, "peak_bytes": 1000 * mib, "fits": False}]
    assert longest_of(ladder, 800 * mib)[:2] == (512, 768)
    assert longest_of(ladder[:1], 800 * mib)[:2] == (512, None)  # the whole ladder fits: a bound, no estimate
    failed = [ladder[0], {"length": 1024, "completed": False, "peak_bytes": None, "fits": False}]
    assert longest_of(failed, 800 * mib) == (512, None, "512 to 1024")
