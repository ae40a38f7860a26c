"""`memfit train --task grpo` end to end on a saved tiny Llama, and what stays exact.

The rollout is generated with the weights of the step it trains (never a step early), each completion seeded by
itself; TRL-named metrics reach the step lines; accumulation over completions and an out-of-memory split of a
training micro-batch give the weights of one micro-batch; a 2x gradient error does not; a resumed run generates the
same completions and reaches the same weights; a reward the model can raise rises.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fault_injection import (
    SGD_NO_CLIPPING,
    assert_same_weights,
    final_weights,
    oom_in_backward_of_linear,
    scaled_gradients,
)
from memfit.config_loading import load_config
from memfit.train.loop import train
from memfit_cli import run_memfit

REWARDS = """
def letter_e(completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [text.count("e") / max(1, len(text)) for text in texts]

def token_value(completions, completion_ids=None, **kwargs):
    return [sum(token % 10 for token in ids) / (10 * max(1, len(ids))) for ids in completion_ids]
"""
TRL_NAMES = ("reward", "reward_std", "rewards/letter_e/mean", "completions/mean_length", "completions/clipped_ratio",
             "clip_ratio/region_mean")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_lines(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") is None and "step" in r]


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    return path


def grpo_config(model_dir, rewards, out, function="letter_e", **extra):
    values = dict(model=str(model_dir), task="grpo", chat_template="chatml", reward_function=f"{rewards}:{function}",
                  num_generations=2, max_completion_length=6, temperature=1.0, batch_size=4, max_steps=2,
                  output_dir=str(out), lr=0.5, report=False, cache_dir=str(Path(out) / "cache"), **SGD_NO_CLIPPING)
    return load_config(overrides=values | extra)


def test_memfit_train_task_grpo_writes_trls_metrics_and_samples(llama_dir, reward_file, tmp_path):
    out = tmp_path / "run"
    result = run_memfit("train", "--task", "grpo", "--model", llama_dir, "--chat-template", "chatml",
                        "--reward-function", f"{reward_file}:letter_e", "--num-generations", "2",
                        "--max-completion-length", "6", "--batch-size", "4", "--max-steps", "2", "--beta", "0.04",
                        "--output-dir", out, "--report", "false")
    assert result.returncode == 0, result.stderr
    assert "memfit: reference: copy" in result.stderr
    steps = step_lines(out)
    assert len(steps) == 2
    for name in (*TRL_NAMES, "kl", "entropy"):
        assert all(name in step for step in steps), name
    # a tiny random model's distributions are near uniform over its 257 tokens: the entropy is near log 257
    assert all(0 < step["entropy"] <= math.log(257) + 1e-4 for step in steps)
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert {sample["step"] for sample in samples} == {1, 2} and all("reward" in sample for sample in samples)


def test_grpo_refuses_a_batch_that_splits_a_prompts_completions(llama_dir, reward_file, tmp_path):
    result = run_memfit("train", "--task", "grpo", "--model", llama_dir, "--reward-function",
                        f"{reward_file}:letter_e", "--num-generations", "3", "--batch-size", "4",
                        "--output-dir", tmp_path / "x")
    assert result.returncode == 2 and "multiple of --num-generations (3)" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def one_micro_batch(llama_dir, reward_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "one"
    return final_weights(train(grpo_config(llama_dir, reward_file, out, function="token_value")))


def test_accumulation_over_completions_is_exact(llama_dir, reward_file, one_micro_batch, tmp_path):
    split = train(grpo_config(llama_dir, reward_file, tmp_path / "acc", function="token_value", batch_size=2,
                              gradient_accumulation_steps=2))
    assert_same_weights(one_micro_batch, final_weights(split))


def test_an_oom_in_the_training_pass_keeps_the_update(llama_dir, reward_file, one_micro_batch, tmp_path):
    with oom_in_backward_of_linear(64, 128, above_batch=2) as raised:
        result = train(grpo_config(llama_dir, reward_file, tmp_path / "oom", function="token_value"))
    assert raised["n"] >= 1
    assert any(r.get("event") == "oom" for r in records(tmp_path / "oom"))
    assert_same_weights(one_micro_batch, final_weights(result))


def test_the_exactness_check_fails_on_a_2x_gradient(llama_dir, reward_file, one_micro_batch, tmp_path):
    with scaled_gradients(2.0):
        doubled = train(grpo_config(llama_dir, reward_file, tmp_path / "x2", function="token_value"))
    with pytest.raises(AssertionError):
        assert_same_weights(one_micro_batch, final_weights(doubled))


def test_a_resumed_run_generates_the_same_completions_and_weights(llama_dir, reward_file, tmp_path):
    straight = train(grpo_config(llama_dir, reward_file, tmp_path / "straight", function="token_value", max_steps=3))
    first = grpo_config(llama_dir, reward_file, tmp_path / "resumed", function="token_value", max_steps=2, save_every=1)
    train(first)
    resumed = train(grpo_config(llama_dir, reward_file, tmp_path / "resumed", function="token_value", max_steps=3,
                                resume="auto"))
    assert_same_weights(final_weights(straight), final_weights(resumed))
    completions = [json.loads(line) for line in (tmp_path / "straight" / "completions.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (tmp_path / "resumed" / "completions.jsonl").read_text().splitlines()]
    assert [c for c in completions if c["step"] == 3] == [c for c in again if c["step"] == 3]
