"""Generation for online RL: each completion seeded by itself, so batching and out-of-memory halving change nothing."""

from __future__ import annotations

import functools

import pytest
import torch

from memfit.tasks.rollout import Sampling, completion_seed, sample_completions
from tiny_llama import tiny_llama

PROMPTS = [[5, 9, 12, 7], [3, 4], [8, 8, 8, 1, 2, 6], [10]]
SAMPLING = Sampling(max_completion_length=8, temperature=1.0, top_p=1.0, eos_token_ids=(2,), pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3).eval()


def _seeds(count: int, step: int = 0) -> list[int]:
    return [completion_seed(7, step, index, 0) for index in range(count)]


def test_completions_do_not_depend_on_the_generation_batch(model):
    together = sample_completions(model, PROMPTS, _seeds(4), SAMPLING, generation_batch=4)
    one_by_one = sample_completions(model, PROMPTS, _seeds(4), SAMPLING, generation_batch=1)
    pairs = sample_completions(model, PROMPTS, _seeds(4), SAMPLING, generation_batch=2)
    assert together.completions == one_by_one.completions == pairs.completions
    assert all(0 < len(c) <= 8 for c in together.completions)
    assert together.truncated == [len(c) == 8 and c[-1] != 2 for c in together.completions]


def test_other_seeds_give_other_completions(model):
    first = sample_completions(model, PROMPTS, _seeds(4, step=0), SAMPLING, generation_batch=4)
    later = sample_completions(model, PROMPTS, _seeds(4, step=1), SAMPLING, generation_batch=4)
    assert first.completions != later.completions


def test_an_oom_while_generating_halves_the_batch_and_keeps_the_completions(model, monkeypatch):
    expected = sample_completions(model, PROMPTS, _seeds(4), SAMPLING, generation_batch=4)
    forward = type(model).forward
    raised = {"n": 0}

    def failing(self, input_ids=None, **kwargs):
        if input_ids.shape[0] > 1:
            raised["n"] += 1
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(type(model), "forward", failing)
    recovered = sample_completions(model, PROMPTS, _seeds(4), SAMPLING, generation_batch=4)
    assert raised["n"] == 2 and recovered.generation_batch == 1 and len(recovered.events) == 2
    assert recovered.completions == expected.completions


def test_top_p_near_zero_is_greedy_and_temperature_is_read(model):
    greedy = Sampling(max_completion_length=6, top_p=1e-6, eos_token_ids=(), pad_token_id=0)
    completions = sample_completions(model, PROMPTS[:1], _seeds(1), greedy, generation_batch=1).completions[0]
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        for token in completions:
            assert token == int(model(input_ids=ids).logits[0, -1].argmax())
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    cold = Sampling(max_completion_length=6, temperature=1e-4, eos_token_ids=(), pad_token_id=0)
    assert sample_completions(model, PROMPTS[:1], _seeds(1), cold, generation_batch=1).completions[0] == completions
    hot = Sampling(max_completion_length=6, temperature=50.0, eos_token_ids=(), pad_token_id=0)
    draws = {tuple(sample_completions(model, PROMPTS[:1], [seed], hot, generation_batch=1).completions[0])
             for seed in range(6)}
    assert len(draws) > 3  # near-uniform draws from a 256-token vocabulary differ


def test_a_prompt_shared_by_completions_runs_once_with_its_last_logits_only(model, monkeypatch):
    shared = [PROMPTS[0]] * 3 + [PROMPTS[2]] * 2
    seeds = [completion_seed(7, 0, index // 3, index % 3) for index in range(5)]
    one_by_one = sample_completions(model, shared, seeds, SAMPLING, generation_batch=1)
    forward, first_forwards = type(model).forward, []

    @functools.wraps(forward)  # the rollout reads the forward's signature (its cache keyword, logits_to_keep)
    def watched(self, input_ids=None, **kwargs):
        output = forward(self, input_ids=input_ids, **kwargs)
        if input_ids.shape[1] > 1:
            first_forwards.append((input_ids.shape[0], output.logits.shape[1]))
        return output

    monkeypatch.setattr(type(model), "forward", watched)
    together = sample_completions(model, shared, seeds, SAMPLING, generation_batch=5)
    assert first_forwards == [(2, 1)]  # two distinct prompts, one position's logits each
    assert together.completions == one_by_one.completions
    assert len({tuple(c) for c in together.completions}) == 5  # the completions of one prompt still differ
