"""Reward functions for --task grpo: a reward file written as for TRL loads and scores with TRL's keyword arguments;
weights make a weighted sum, None is left out; the built-ins score what they claim; bad specs are refused in one line."""

from __future__ import annotations

import math

import pytest

from memfit.errors import UsageError
from memfit.tasks.rewards import final_answer, load_reward_functions, score_completions

REWARD_FILE = '''
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

def reward_keyword(completions, keyword, trainer_state=None, completion_ids=None, **kwargs):
    return [None if k is None else float(k in c) for c, k in zip(completions, keyword)]

def broken(completions, **kwargs):
    raise KeyError("score")

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_FILE)
    return path


def test_a_trl_reward_file_loads_and_scores_with_weights(reward_file):
    functions = load_reward_functions(f"{reward_file}:reward_len,{reward_file}:reward_keyword", "0.5,2")
    assert [(f.name, f.weight) for f in functions] == [("reward_len", 0.5), ("reward_keyword", 2.0)]
    completions = ["cat" * 5, "dog", "a cat", "x" * 20]
    scores = score_completions(functions, prompts=["p1", "p1", "p2", "p2"], completions=completions,
                               completion_ids=[[1]] * 4, columns={"keyword": ["cat", None]})
    assert scores.per_function["reward_len"].tolist() == [-5.0, -17.0, -15.0, 0.0]
    keyword = scores.per_function["reward_keyword"]
    assert keyword[:2].tolist() == [1.0, 0.0] and math.isnan(keyword[2]) and math.isnan(keyword[3])
    assert scores.total.tolist() == [-2.5 + 2.0, -8.5, -7.5, 0.0]


def test_a_completion_no_function_scores_is_nan(reward_file):
    functions = load_reward_functions(f"{reward_file}:reward_keyword", None)
    scores = score_completions(functions, ["p", "q"], ["a", "b"], [[1], [2]], {"keyword": ["a", None]})
    assert scores.total[0] == 1.0 and math.isnan(scores.total[1])


def test_builtins_on_conversational_completions():
    functions = load_reward_functions("answer-match,format,length", None)
    completions = [
        [{"role": "assistant", "content": "<think>2+2</think> <answer>4</answer>"}],
        [{"role": "assistant", "content": "I think it is 5."}],
        [{"role": "assistant", "content": "so \\boxed{1,000}"}],
        [{"role": "assistant", "content": "<answer>7</answer> and more"}],
    ]
    scores = score_completions(functions, ["p"] * 4, completions, [[1] * 10, [1] * 2, [1] * 4, [1] * 6],
                               {"answer": ["4", "1000"]})
    assert scores.per_function["answer-match"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scores.per_function["format"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert scores.per_function["length"].tolist() == pytest.approx([-0.01, -0.002, -0.004, -0.006])


def test_final_answer_prefers_the_answer_tag_then_boxed_then_the_last_number():
    assert final_answer("3 then <answer> 12 </answer> 9") == " 12 "
    assert final_answer("3 then \\boxed{x+1} 9") == "x+1"
    assert final_answer("3 apples, then -4.5") == "-4.5"
    assert final_answer("none") is None


@pytest.mark.parametrize(("spec", "weights", "message"), [
    (None, None, "--task grpo needs --reward-function"),
    ("answer-mach", None, "did you mean answer-match?"),
    ("missing.py:f", None, "no file missing.py"),
    ("{file}:reward_lenn", None, "has no reward_lenn; did you mean reward_len?"),
    ("{file}:NOT_A_FUNCTION", None, "is a int, not a function"),
    ("format,length", "1", "1 values for 2 reward functions"),
    ("format", "one", "give comma-separated numbers"),
])
def test_bad_specs_are_refused_in_one_line(reward_file, spec, weights, message):
    spec = spec and spec.format(file=reward_file)
    with pytest.raises(UsageError, match=message) as caught:
        load_reward_functions(spec, weights)
    assert "\n" not in str(caught.value)


def test_a_reward_function_that_raises_is_named(reward_file):
    functions = load_reward_functions(f"{reward_file}:broken", None)
    with pytest.raises(UsageError, match="reward function broken raised KeyError: 'score'"):
        score_completions(functions, ["p"], ["a"], [[1]], {})


def test_overlong_is_dapos_soft_punishment_against_the_runs_maximum():
    (function,) = load_reward_functions("overlong", None, max_completion_length=10)
    ids = [[1] * n for n in (3, 8, 9, 10, 12)]  # free up to 8 tokens, cache 2
    scores = score_completions([function], ["p"] * 5, ["x"] * 5, ids, {})
    assert scores.total.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
