"""`memfit profile` through the real CLI: JSON schema, advice from the measurement, the plot, the cap.

Each command runs in a process forked from the warm server (warm_memfit): the import of torch is paid once,
and the tracked bytes, the plot and the exit codes are the child's own.
"""

from __future__ import annotations

import json

from memfit.memory.categories import CATEGORIES


def test_profile_json_and_plot(warm_memfit, llama_dir, text_file, tmp_path):
    plot = tmp_path / "timeline.png"
    result = warm_memfit.run(
        "profile", "--model", llama_dir, "--dataset", text_file, "--seq-len", "256", "--batch-size", "8",
        "--loss-chunk-size", "0", "--steps", "2", "--plot", plot, "--json", "--output-dir", tmp_path / "out",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"device", "steps", "peak_bytes", "breakdown", "phases", "top_modules", "advice"} <= set(report)
    assert set(report["breakdown"]) == set(CATEGORIES)
    assert report["steps"] == 2 and report["device"] == "cpu"
    assert [phase["name"] for phase in report["phases"]] == ["forward", "backward", "optimizer"]
    assert sum(report["breakdown"].values()) == report["peak_bytes"]
    # Long sequences on a small model: activations dominate, and the advice says what to switch on.
    assert report["breakdown"]["activations"] > 0.5 * report["peak_bytes"]
    assert report["advice"][0]["flag"].startswith("--gradient-checkpointing")
    assert 0 < report["advice"][0]["saves_bytes"] < report["breakdown"]["activations"]
    assert plot.read_bytes()[:4] == b"\x89PNG"
    # Profiling writes no checkpoints, metrics or final model.
    assert not (tmp_path / "out" / "final").exists() and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_profile_text_report(warm_memfit, llama_dir, text_file, tmp_path):
    result = warm_memfit.run("profile", "--model", llama_dir, "--dataset", text_file, "--seq-len", "64", "--steps", "1",
                        "--gradient-checkpointing", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "peak" in result.stdout and "activations" in result.stdout and "optimizer" in result.stdout


def test_cap_below_the_peak_is_a_clear_error_without_recovery(warm_memfit, llama_dir, text_file, tmp_path):
    args = ["--model", llama_dir, "--dataset", text_file, "--seq-len", "128", "--batch-size", "4", "--loss-chunk-size", "0",
            "--output-dir", tmp_path]
    measured = json.loads(warm_memfit.run("profile", *args, "--steps", "1", "--json").stdout)["peak_bytes"]
    below = warm_memfit.run("train", *args, "--max-steps", "1", "--memory-cap", str(int(measured * 0.97)), "--no-oom-recovery")
    assert below.returncode == 3 and "memory cap" in below.stderr and "Traceback" not in below.stderr
    above = warm_memfit.run("train", *args, "--max-steps", "1", "--memory-cap", str(int(measured * 1.03)), "--no-oom-recovery")
    assert above.returncode == 0, above.stderr
