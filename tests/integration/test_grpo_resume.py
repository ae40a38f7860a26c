"""--task grpo --num-iterations 2 resumed: from a checkpoint on a rollout boundary the run generates the same
completions and reaches the uninterrupted run's weights (a 2x gradient breaks that); from a checkpoint inside a
rollout the rollout is generated again from the checkpoint's weights, and the log says so. A run killed with
SIGKILL in step 3 resumes to the same completions and weights."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from grpo_fixtures import (
    load_final,
    reward_file_fixture,  # noqa: F401 (the reward_file fixture)
    sampled,
    sgd_config,
)
from test_preference_resume import HOLD, _killed_in_step, _losses_after_last_start, _weights

from fault_injection import SGD_FLAGS, assert_same_weights, final_weights, scaled_gradients
from memfit.train.loop import train


def config(model_dir, rewards, out, **extra):
    return sgd_config(model_dir, rewards, out, **{"num_iterations": 2, "max_steps": 4} | extra)


@pytest.fixture(scope="module")
def straight(llama_dir, reward_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grpo_mu") / "straight"
    train(config(llama_dir, reward_file, out))
    return out


def test_resumed_on_a_rollout_boundary_gives_the_same_completions_and_weights(llama_dir, reward_file, straight,
                                                                               tmp_path):
    out = tmp_path / "resumed"
    train(config(llama_dir, reward_file, out, max_steps=2, save_every=2))
    resumed = train(config(llama_dir, reward_file, out, resume="auto"))
    assert resumed.steps == 4 and len(resumed.losses) == 2
    assert_same_weights(load_final(straight), final_weights(resumed))
    after = [step for step in (3, 4) if sampled(straight, step)]
    assert after and all(sampled(out, step) == sampled(straight, step) for step in after)


def test_the_boundary_resume_check_fails_on_a_2x_gradient(llama_dir, reward_file, straight, tmp_path):
    out = tmp_path / "doubled"
    train(config(llama_dir, reward_file, out, max_steps=2, save_every=2))
    with scaled_gradients(2.0):
        resumed = train(config(llama_dir, reward_file, out, resume="auto"))
    with pytest.raises(AssertionError):
        assert_same_weights(load_final(straight), final_weights(resumed))


def test_resumed_inside_a_rollout_says_it_generates_it_again(llama_dir, reward_file, tmp_path, caplog):
    out = tmp_path / "inside"
    train(config(llama_dir, reward_file, out, max_steps=3, save_every=1))
    with caplog.at_level(logging.WARNING):
        resumed = train(config(llama_dir, reward_file, out, resume="auto"))
    assert resumed.steps == 4 and len(resumed.losses) == 1
    assert "trains on the rollout of step 3" in caplog.text and "generated again" in caplog.text


def _grpo_command(model: Path, rewards: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--task", "grpo", "--model", str(model), "--chat-template", "chatml", "--reward-function",
            f"{rewards}:token_value", "--num-generations", "2", "--max-completion-length", "6", "--batch-size", "4",
            "--max-steps", "3", "--no-report", *SGD_FLAGS, "--lr", "0.5", "--output-dir", str(out), *extra]


def test_a_run_killed_in_step_3_resumes_to_the_same_completions_and_weights(llama_dir, reward_file, warm_memfit,
                                                                            tmp_path):
    """SIGKILL while step 3 is in its optimizer step (step 2 saved), as tests/integration/test_preference_resume.py."""
    straight, killed, hold = tmp_path / "straight", tmp_path / "killed", tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLD)
    assert warm_memfit.run(*_grpo_command(llama_dir, reward_file, straight)).returncode == 0
    _killed_in_step(warm_memfit, _grpo_command(llama_dir, reward_file, killed, "--save-every", "1"), killed, 3, hold)
    resumed = warm_memfit.run(*_grpo_command(llama_dir, reward_file, killed, "--save-every", "1", "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(_losses_after_last_start(killed)) == [3]
    assert_same_weights(_weights(straight), _weights(killed))
    assert sampled(straight, 3) and sampled(killed, 3)[-len(sampled(straight, 3)):] == sampled(straight, 3)
