"""memfit plan --task grpo: the generation batch and the training micro-batch that fit, and --maximize
completion-length (prediction/rl_plan.py). Each choice is checked against the estimate it was made from: what was
chosen fits the budget (with the planner's 5 % margin), and one step more (the whole step's completions generated at
once, one more completion token) does not."""

from __future__ import annotations

import pytest

from memfit.config_loading import load_config
from memfit.errors import UsageError
from memfit.prediction.estimator import estimate
from memfit.prediction.planner import MARGIN, plan
from tiny_llama import tiny_llama_config

SIZES = dict(hidden=64, layers=2, vocab=256, max_positions=8192)
COMPLETIONS = 16


def _config(**settings):
    return load_config(overrides={"model": "tiny", "task": "grpo", "seq_len": 32, "max_completion_length": 512,
                                  "num_generations": 4, "batch_size": 4, "gradient_accumulation_steps": 4,
                                  "precision": "fp32", **settings})


def _peak(config, changes) -> int:
    planned = config.replace(effective_batch_size=None, memory_budget=None, gpu=None, **changes)
    return estimate(planned, hf_config=tiny_llama_config(**SIZES)).peak_bytes


def _budget_between(low: int, high: int) -> int:
    """A budget the planner's margin puts between two peaks."""
    return int((low + high) / 2 / (1 - MARGIN))


def test_the_plan_generates_fewer_completions_at_once_where_all_of_them_do_not_fit():
    config = _config(gradient_checkpointing="full", max_completion_length=1024, batch_size=1,
                     gradient_accumulation_steps=16)
    all_at_once = _peak(config, {"generation_batch_size": COMPLETIONS})
    one_at_a_time = _peak(config, {"generation_batch_size": 1})
    budget = _budget_between(one_at_a_time, all_at_once)
    result = plan(config, budget_bytes=budget, allow="full", hf_config=tiny_llama_config(**SIZES), explain=False)
    chosen = result.plan["generation_batch_size"]
    fits = budget * (1 - MARGIN)
    print(f"budget {budget}: generating {chosen} at once, micro-batch {result.plan['batch_size']}")
    assert 1 <= chosen < COMPLETIONS
    assert _peak(config, result.plan) == result.estimated_peak_bytes <= fits
    assert _peak(config, {**result.plan, "generation_batch_size": COMPLETIONS}) > fits
    assert _peak(config, {**result.plan, "generation_batch_size": min(COMPLETIONS, 2 * chosen)}) > fits
    assert f"--generation-batch-size {chosen}" in result.command
    assert any(line.startswith(f"generation: {chosen} of the step's {COMPLETIONS}") for line in result.trades)
    assert f"--batch-size {result.plan['batch_size']}" in result.command


def test_a_budget_that_holds_every_completion_generates_them_all_at_once():
    config = _config()
    result = plan(config, budget_bytes=64 << 30, allow="full", hf_config=tiny_llama_config(**SIZES), explain=False)
    assert result.plan["generation_batch_size"] == COMPLETIONS


def test_the_longest_completion_is_the_longest_that_fits():
    config = _config(gradient_checkpointing="full", batch_size=1, gradient_accumulation_steps=16, num_generations=4)
    budget = _budget_between(_peak(config, {"max_completion_length": 300, "generation_batch_size": 1}),
                             _peak(config, {"max_completion_length": 300, "generation_batch_size": 16}))
    result = plan(config, budget_bytes=budget, allow="full", hf_config=tiny_llama_config(**SIZES), explain=False,
                  maximize="completion-length")
    longest = result.plan["max_completion_length"]
    fits = budget * (1 - MARGIN)
    print(f"budget {budget}: completions of {longest} tokens, generating {result.plan['generation_batch_size']}")
    assert _peak(config, result.plan) <= fits
    assert _peak(config, {**result.plan, "max_completion_length": longest + 1, "generation_batch_size": 1}) > fits
    assert f"--max-completion-length {longest}" in result.command


def test_completion_length_is_refused_for_a_task_that_generates_nothing():
    config = load_config(overrides={"model": "tiny", "seq_len": 32})
    with pytest.raises(UsageError, match="seq-len, batch-size") as refused:
        plan(config, budget_bytes=1 << 30, hf_config=tiny_llama_config(**SIZES), maximize="completion-length")
    assert "\n" not in str(refused.value)
