"""`--task grpo --lora-r N --beta B`: the reference is the model with its adapters off (no second model), said in
the log and the start line, and it differs from the trained policy once the adapters moved (kl > 0 at step 2;
a reference that kept the adapters on would give kl 0)."""

from __future__ import annotations

import json
from pathlib import Path

from fault_injection import SGD_NO_CLIPPING
from memfit.config_loading import load_config
from memfit.train.loop import train
from memfit_cli import run_memfit

REWARDS = """
def mean_token(completions, completion_ids=None, **kwargs):
    return [sum(ids) / (256.0 * max(1, len(ids))) for ids in completion_ids]
"""


def test_lora_with_beta_uses_the_adapters_off_reference(llama_dir, tmp_path, caplog):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    out = tmp_path / "run"
    config = load_config(overrides=dict(
        model=str(llama_dir), task="grpo", chat_template="chatml", reward_function=f"{rewards}:mean_token",
        num_generations=2, max_completion_length=6, batch_size=4, max_steps=2, output_dir=str(out), lr=0.5,
        lora_r=4, beta=0.1, report=False, cache_dir=str(Path(out) / "cache"), **SGD_NO_CLIPPING))
    with caplog.at_level("INFO", logger="memfit"):
        train(config)
    assert "reference: adapters-off" in caplog.text
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    reference = next(line for line in lines if line.get("event") == "start")["task"]["reference"]
    assert reference["mode"] == "adapters-off" and not reference.get("copy_bytes")
    kl = [line["kl"] for line in lines if line.get("event") is None and "step" in line]
    assert len(kl) == 2 and kl[0] == 0.0 and kl[1] > 0.0


def test_the_report_shows_the_reward_curve_and_sampled_completions(llama_dir, tmp_path):
    out = tmp_path / "run"
    result = run_memfit("train", "--task", "grpo", "--model", llama_dir, "--chat-template", "chatml",
                        "--num-generations", "2", "--max-completion-length", "4", "--batch-size", "2",
                        "--max-steps", "2", "--output-dir", out, "--report", "true")
    assert result.returncode == 0, result.stderr
    assert "memfit: generation: transformers' forward with a key-value cache" in result.stderr
    page = (out / "report.html").read_text()
    assert "Sampled completions" in page and '"text":"reward"' in page.replace(" ", "")
