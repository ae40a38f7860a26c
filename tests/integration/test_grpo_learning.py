"""`memfit train --task grpo` over several steps: a resumed run generates the same completions and reaches the same
weights, a 2x gradient error is caught by that comparison, and a reward the model can raise rises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from grpo_fixtures import (
    load_final,
    reward_file_fixture,  # noqa: F401 (the reward_file fixture)
    sampled,
    sgd_config,
    step_lines,
)

from fault_injection import assert_same_weights, final_weights, scaled_gradients
from memfit.config_loading import load_config
from memfit.train.loop import train


@pytest.fixture(scope="module")
def straight(llama_dir, reward_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grpo") / "straight"
    train(sgd_config(llama_dir, reward_file, out))
    return out


def test_a_resumed_run_generates_the_same_completions_and_weights(llama_dir, reward_file, straight, tmp_path):
    out = tmp_path / "resumed"
    train(sgd_config(llama_dir, reward_file, out, max_steps=2, save_every=1))
    resumed = train(sgd_config(llama_dir, reward_file, out, resume="auto"))
    assert resumed.steps == 3 and len(resumed.losses) == 1  # step 3 alone ran in this launch
    assert_same_weights(load_final(straight), final_weights(resumed))
    assert sampled(out, 3) == sampled(straight, 3)


def test_the_resume_check_fails_on_a_2x_gradient(llama_dir, reward_file, straight, tmp_path):
    out = tmp_path / "doubled"
    train(sgd_config(llama_dir, reward_file, out, max_steps=2, save_every=1))
    with scaled_gradients(2.0):
        resumed = train(sgd_config(llama_dir, reward_file, out, resume="auto"))
    with pytest.raises(AssertionError):
        assert_same_weights(load_final(straight), final_weights(resumed))


def test_a_reward_the_model_can_raise_rises(reward_file, tmp_path):
    """The built-in tiny model, the bundled prompts, a reward of each completion's token values: 12 AdamW steps."""
    out = tmp_path / "learn"
    train(load_config(overrides=dict(
        model="tiny", task="grpo", reward_function=f"{reward_file}:token_value", num_generations=4,
        max_completion_length=8, max_prompt_length=32, batch_size=16, max_steps=12, lr=3e-3, warmup_steps=0,
        lr_schedule="constant", output_dir=str(out), report=False)))
    rewards = [step["reward"] for step in step_lines(out)]
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards  # about 0.45 -> 0.65 on the dev machine


def test_ooms_in_generation_and_training_leave_the_completions_and_weights(llama_dir, reward_file, straight, tmp_path,
                                                                           monkeypatch):
    """Every forward of more than one row runs out of memory: generation halves its batch down to one completion at a
    time and the training pass splits its micro-batches down to one completion; neither changes a thing."""
    from transformers import LlamaForCausalLM

    forward, raised = LlamaForCausalLM.forward, {"n": 0}

    def one_row_at_a_time(self, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[0] > 1:
            raised["n"] += 1
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", one_row_at_a_time)
    out = tmp_path / "oom"
    result = train(sgd_config(llama_dir, reward_file, out))
    assert raised["n"] >= 2
    steps = step_lines(out)
    assert steps[0]["generation_batch"] == 1 and steps[0].get("generation_oom_halvings", 0) >= 1
    assert_same_weights(load_final(straight), final_weights(result))
    assert [sampled(out, step) for step in (1, 2, 3)] == [sampled(straight, step) for step in (1, 2, 3)]
