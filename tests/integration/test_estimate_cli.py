"""`memfit estimate`, `memfit plan` and `memfit presets` through the real command line."""

from __future__ import annotations

import json

from memfit.cli.main import main

KEYS = {"model", "method", "peak_bytes", "breakdown", "budget_bytes", "fits", "headroom_bytes", "error_band"}


def test_estimate_json_is_one_object_on_stdout(warm_memfit):
    # forked from the session's warm server (tests/memfit_cli.py), whose import-time output leads stdout as a fresh
    # interpreter's would: json.loads below still fails on anything but the one object
    result = warm_memfit.run("estimate", "--model", "tiny", "--seq-len", "128", "--json", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(result.stdout)  # nothing else on stdout
    assert KEYS <= set(data)
    assert sum(data["breakdown"].values()) == data["peak_bytes"] > 0


def test_estimate_table_says_whether_it_fits(capsys):
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpu", "rtx-4090", "--seq-len", "2048",
                 "--lora-r", "16", "--dtype", "bf16", "--gradient-checkpointing", "full", "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "activations per layer" in out and "GiB" in out and "%" in out
    assert "fits in 23.64 GiB: headroom" in out
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpu", "rtx-4090", "--method", "traced",
                 "--seq-len", "256", "--batch-size", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["method"] == "traced" and data["fits"] is False


def test_plan_json_and_exit_code_when_nothing_fits(capsys):
    assert main(["plan", "--model", "tiny", "--memory-budget", "1GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"fits", "plan", "estimated_peak_bytes", "budget_bytes", "relative_speed", "command", "alternatives"} <= set(data)
    assert data["fits"] and data["estimated_peak_bytes"] <= data["budget_bytes"]
    assert main(["plan", "--model", "tiny", "--memory-budget", "1MiB"]) == 3
    assert "needs" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny", "--memory-budget", "1GiB"]) == 0
    assert "run the best with:\n  memfit train --model tiny" in capsys.readouterr().out


def test_presets_and_bad_names(capsys):
    assert main(["presets", "models"]) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-70b" in out and "70.55B" in out and "qwen2.5-0.5b" in out
    assert main(["presets", "gpus"]) == 0
    assert "rtx-4090" in capsys.readouterr().out
    assert main(["estimate", "--model", "tiny", "--gpu", "rtx-9999"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert main(["estimate", "--model", "no-such-model"]) == 2


def test_plans_best_configuration_trains_under_the_budget_without_oom(llama_dir, text_file, tmp_path):
    """The planner's choice, run with the budget as an emulated memory cap, never runs out of memory."""
    from memfit.config_loading import load_config
    from memfit.prediction.planner import plan, plan_to_overrides
    from memfit.train.loop import train
    from memfit.train.metrics import read_metrics

    budget = 8 * 1000**2  # between what micro-batch 2 and micro-batch 8 need at seq-len 128
    config = load_config(overrides=dict(model=str(llama_dir), dataset=str(text_file), seq_len=128, batch_size=8,
                                        max_steps=2, output_dir=str(tmp_path)))
    result = plan(config, budget_bytes=budget, allow="full")
    assert result.fits
    planned = config.replace(**plan_to_overrides(result), memory_cap=budget)
    assert planned.effective_batch_for() == 8  # the plan keeps the effective batch
    trained = train(planned)
    assert trained.steps == 2
    assert not [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "oom"]


def test_train_with_a_budget_plans_first_and_prints_the_plan(llama_dir, text_file, tmp_path, warm_memfit):
    # forked from the session's warm server (tests/memfit_cli.py): the real command without a fresh import
    result = warm_memfit.run("train", "--model", llama_dir, "--dataset", text_file, "--seq-len", "128", "--batch-size",
                             "8", "--max-steps", "1", "--memory-budget", "8MB", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "planned for" in result.stderr
    assert (tmp_path / "final").is_dir()
