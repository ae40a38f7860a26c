"""What the GRPO integration tests share: a reward file, the SGD run they compare, and readers of its output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fault_injection import SGD_NO_CLIPPING
from memfit.config_loading import load_config

REWARDS = """
def token_value(completions, completion_ids=None, **kwargs):
    return [sum(token % 10 for token in ids) / (10 * max(1, len(ids))) for ids in completion_ids]
"""


@pytest.fixture(scope="module", name="reward_file")
def reward_file_fixture(tmp_path_factory) -> Path:
    """A Python file of one reward function, `token_value`: the mean of the completion's token ids modulo 10."""
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    return path


def sgd_config(model_dir, rewards, out, **extra):
    """A tiny --task grpo run under SGD without clipping (a 2x gradient changes its weights): 3 steps of 2 prompts,
    2 completions each; `extra` overrides any setting."""
    values = dict(model=str(model_dir), task="grpo", chat_template="chatml", reward_function=f"{rewards}:token_value",
                  num_generations=2, max_completion_length=6, batch_size=4, max_steps=3, output_dir=str(out), lr=0.5,
                  report=False, cache_dir=str(Path(out) / "cache"), **SGD_NO_CLIPPING)
    return load_config(overrides=values | extra)


def step_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line.get("event") is None and "step" in line]


def sampled(run_dir: Path, step: int) -> list[dict]:
    """The completions of `step` the run kept in completions.jsonl."""
    lines = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    return [line for line in lines if line["step"] == step]


def load_final(run_dir: Path):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))
