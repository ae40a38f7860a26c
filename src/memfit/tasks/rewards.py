"""Reward functions for --task grpo, called as TRL calls them, so a TRL user's reward file works unchanged.

A reward function takes `prompts=`, `completions=`, `completion_ids=`, `trainer_state=` and each of the data's other
columns as keyword arguments (lists with one entry per completion; a prompt's columns repeated for each of its
completions) and returns one float per completion, or None for a completion it does not score. Completions of a
conversational prompt are `[{"role": "assistant", "content": text}]` lists; of a plain prompt, strings.

`--reward-function` names them: `PATH.py:NAME` (the user's file, imported by path because they named it) or a
built-in: answer-match, format, length, overlong (DAPO's soft overlong punishment).
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from memfit.errors import UsageError


@dataclass(frozen=True)
class RewardFunction:
    """One reward of the weighted sum."""

    name: str
    """The built-in's name, or the function's name in the user's file (TRL's metric name rewards/NAME)."""
    weight: float
    """Its weight in the sum (--reward-weights; 1 by default)."""
    function: Callable[..., list[float | None]]
    """Called with TRL's keyword arguments; one float (or None) per completion."""


@dataclass(frozen=True)
class RewardScores:
    """The rewards of a batch of completions."""

    total: Tensor
    """[N] weighted sum over functions, a function's None left out (NaN where no function scored)."""
    per_function: dict[str, Tensor]
    """[N] each function's rewards, NaN where it returned None."""


def completion_text(completion: str | list[dict]) -> str:
    """The text of a completion, plain or conversational (the content of its messages, joined)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion)


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_THINK_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def _normalise(text: str) -> str:
    """Strip spaces, a final full stop and thousands separators; a number is compared by value."""
    text = text.strip().rstrip(".").replace(",", "").strip().strip("$").strip()
    try:
        value = float(text)
    except ValueError:
        return text.lower()
    return repr(value) if math.isfinite(value) else text.lower()


def final_answer(text: str) -> str | None:
    """The completion's final answer: the last <answer>...</answer>, else the last \\boxed{...}, else the last number."""
    for pattern in (_ANSWER_TAG, _BOXED, _NUMBER):
        found = pattern.findall(text)
        if found:
            return found[-1]
    return None


def answer_match(completions, answer=None, solution=None, **kwargs) -> list[float]:
    """1.0 where the completion's final answer (see `final_answer`) equals the data's `answer` (or `solution`)."""
    expected = answer if answer is not None else solution
    if expected is None:
        raise ValueError("answer-match needs an `answer` (or `solution`) column in the data")
    scores = []
    for completion, truth in zip(completions, expected, strict=True):
        given = final_answer(completion_text(completion))
        scores.append(float(given is not None and _normalise(given) == _normalise(str(truth))))
    return scores


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 where the whole completion is `<think>...</think>` then `<answer>...</answer>`."""
    return [float(bool(_THINK_ANSWER.match(completion_text(c)))) for c in completions]


def length_penalty(completions, completion_ids=None, **kwargs) -> list[float]:
    """A penalty on long completions: -(characters / 1000), or with completion_ids -(tokens / 1000).

    Comparing completions of one prompt, the group's advantage turns this into a preference for the shorter ones."""
    if completion_ids is not None:
        return [-len(ids) / 1000.0 for ids in completion_ids]
    return [-len(completion_text(c)) / 1000.0 for c in completions]


def overlong_penalty(max_completion_length: int, cache: int | None = None) -> Callable[..., list[float]]:
    """DAPO's soft overlong punishment, in tokens: 0 up to max - cache, then falling linearly to -1 at the maximum.

    `cache` defaults to a fifth of the maximum (DAPO's 4,096 of 20,480 tokens)."""
    cache = max(1, max_completion_length // 5) if cache is None else cache
    free = max_completion_length - cache

    def overlong(completions, completion_ids=None, **kwargs) -> list[float]:
        if completion_ids is None:
            raise ValueError("overlong needs completion_ids (the completions' tokens)")
        return [0.0 if len(ids) <= free else max(-1.0, (free - len(ids)) / cache) for ids in completion_ids]

    return overlong


BUILTINS: dict[str, Callable[..., list[float | None]]] = {
    "answer-match": answer_match,
    "format": format_reward,
    "length": length_penalty,
    "overlong": overlong_penalty(512),  # replaced by the run's --max-completion-length in load_reward_functions
}


def _load_from_file(entry: str) -> RewardFunction:
    """`PATH.py:NAME`: import the user's file by its path and take the callable NAME from it."""
    path_text, _, name = entry.rpartition(":")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise UsageError(f"--reward-function {entry}: no file {path}; give an existing FILE.py:NAME or a built-in "
                         f"({', '.join(BUILTINS)})")
    module_name = f"memfit_user_rewards_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's own file: say which and why, in one line
        raise UsageError(f"--reward-function {entry}: importing {path} failed: {type(error).__name__}: {error}") from None
    if not hasattr(module, name):
        found = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(name, found, n=1)
        hint = f"did you mean {close[0]}?" if close else f"callables there: {', '.join(found) or 'none'}"
        raise UsageError(f"--reward-function {entry}: {path} has no {name}; {hint}")
    function = getattr(module, name)
    if not callable(function):
        raise UsageError(f"--reward-function {entry}: {name} in {path} is a {type(function).__name__}, not a function")
    return RewardFunction(name=name, weight=1.0, function=function)


def _load_one(entry: str, max_completion_length: int | None) -> RewardFunction:
    if entry == "overlong" and max_completion_length is not None:
        return RewardFunction(name=entry, weight=1.0, function=overlong_penalty(max_completion_length))
    if entry in BUILTINS:
        return RewardFunction(name=entry, weight=1.0, function=BUILTINS[entry])
    if ":" in entry and entry.rpartition(":")[0].endswith(".py"):
        return _load_from_file(entry)
    close = difflib.get_close_matches(entry, list(BUILTINS), n=1, cutoff=0.4)
    hint = f"did you mean {close[0]}?" if close else f"built-ins: {', '.join(BUILTINS)}"
    raise UsageError(f"--reward-function {entry}: not a built-in or FILE.py:NAME; {hint}")


def _parse_weights(weights: str, count: int) -> list[float]:
    parts = [part.strip() for part in weights.split(",") if part.strip()]
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise UsageError(f"--reward-weights {weights}: give comma-separated numbers, one per --reward-function") from None
    if len(values) != count:
        raise UsageError(f"--reward-weights has {len(values)} values for {count} reward functions; give one per "
                         f"--reward-function, in the same order")
    return values


def load_reward_functions(spec: str | None, weights: str | None, max_completion_length: int | None = None
                          ) -> list[RewardFunction]:
    """The reward functions `--reward-function` names, with `--reward-weights` (1 each by default).

    `max_completion_length`: the run's --max-completion-length, which the built-in `overlong` penalises against
    (512, TRL's default, when not given).

    Raises:
        UsageError: no function named, a file or function that is not there, a weight count that differs.
    """
    entries = [entry.strip() for entry in (spec or "").split(",") if entry.strip()]
    if not entries:
        raise UsageError(f"--task grpo needs --reward-function: FILE.py:NAME (a TRL reward function) or a built-in "
                         f"({', '.join(BUILTINS)})")
    functions = [_load_one(entry, max_completion_length) for entry in entries]
    if weights is None:
        return functions
    values = _parse_weights(weights, len(functions))
    return [RewardFunction(f.name, value, f.function) for f, value in zip(functions, values, strict=True)]


def score_completions(
    functions: Sequence[RewardFunction],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
) -> RewardScores:
    """Each completion's reward: the weighted sum of the functions' rewards, None counted as NaN and left out.

    Args:
        prompts: one per completion (a prompt's G completions consecutive).
        completions: [N] strings or assistant-message lists, as TRL gives them.
        completion_ids: [N] token ids of each completion.
        columns: the data's other columns, one value per prompt; repeated for each of its completions.

    Raises:
        UsageError: a function raised, or returned the wrong number of rewards.
    """
    count = len(completions)
    per_prompt = {name: len(values) for name, values in columns.items()}
    repeats = {name: count // n if n else 0 for name, n in per_prompt.items()}
    keyword_columns = {name: [v for v in values for _ in range(repeats[name])] for name, values in columns.items()}
    per_function: dict[str, Tensor] = {}
    total = torch.zeros(count, dtype=torch.float32)
    for function in functions:
        try:
            rewards = function.function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                        trainer_state=None, **keyword_columns)
        except Exception as error:  # the user's code: name it and its error in one line
            message = str(error).splitlines()[0] if str(error) else ""
            raise UsageError(f"reward function {function.name} raised {type(error).__name__}: {message}") from None
        if rewards is None or len(rewards) != count:
            raise UsageError(f"reward function {function.name} returned {0 if rewards is None else len(rewards)} "
                             f"rewards for {count} completions; return one float (or None) per completion")
        values = torch.tensor([math.nan if r is None else float(r) for r in rewards], dtype=torch.float32)
        per_function[function.name] = values
        total = total + torch.nan_to_num(values * function.weight, nan=0.0)
    scored = torch.stack(list(per_function.values()), dim=1) if per_function else torch.zeros(count, 0)
    total[torch.isnan(scored).all(dim=1)] = math.nan
    return RewardScores(total=total, per_function=per_function)
