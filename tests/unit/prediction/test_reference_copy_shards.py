"""The estimate of the frozen reference copy a rank holds: a share of it where the engine shards the policy's weights
(fsdp, zero3: distributed/reference_shards.py shards the copy the same way), the whole copy under ddp and zero1/2.

Compared at the estimate's own figures: the preference step's `reference_copy_bytes` and its parameters, and GRPO's
(--beta > 0) `rl_step` facts, under 2 ranks against one process.
"""

from __future__ import annotations

import pytest

from memfit.config_loading import load_config
from memfit.distributed.reference_shards import copy_bytes_per_rank
from memfit.prediction.estimator import estimate
from tiny_llama import tiny_llama, tiny_llama_config

SIZES = dict(hidden=64, layers=2, vocab=512)


def _whole_copy() -> int:
    return sum(parameter.numel() * 4 for parameter in tiny_llama(**SIZES).parameters())


def _dpo(sharding: str, world_size: int):
    config = load_config(overrides={"task": "dpo", "seq_len": 64, "batch_size": 2})
    return estimate(config, hf_config=tiny_llama_config(**SIZES), sharding=sharding, world_size=world_size)


@pytest.mark.parametrize(("sharding", "share"), [("fsdp", 0.5), ("zero3", 0.5), ("ddp", 1.0), ("zero2", 1.0)])
def test_a_preference_ranks_copy_is_its_share_where_the_weights_are_sharded(sharding, share):
    whole = _whole_copy()
    ranked, one = _dpo(sharding, 2), _dpo("none", 1)
    assert one.details["preference"]["reference_copy_bytes"] == whole
    assert ranked.details["preference"]["reference_copy_bytes"] == int(whole * share)
    # the copy's share is on top of the policy's own sharded weights: parameters drop by the copy's other share
    policy = ranked.details["full_bytes"]["parameters"]
    assert ranked.breakdown["parameters"] == pytest.approx(
        policy / (2 if share < 1 else 1) + whole * share, rel=1e-6)


@pytest.mark.parametrize(("sharding", "share"), [("fsdp", 0.5), ("ddp", 1.0)])
def test_a_grpo_ranks_copy_is_its_share_where_the_weights_are_sharded(sharding, share):
    config = load_config(overrides={"model": "tiny", "task": "grpo", "reward_function": "length", "seq_len": 16,
                                    "max_prompt_length": 16, "beta": 0.1, "batch_size": 4, "num_generations": 4})
    ranked = estimate(config, sharding=sharding, world_size=2).details["rl_step"]["reference_copy_bytes"]
    one = estimate(config, sharding="none", world_size=1).details["rl_step"]["reference_copy_bytes"]
    assert one > 0 and ranked == int(one * share)


def test_the_share_is_the_copy_over_the_ranks():
    assert copy_bytes_per_rank(1200.0, "fsdp", 4) == 300.0
    assert copy_bytes_per_rank(1200.0, "zero3", 3) == 400.0
    assert copy_bytes_per_rank(1200.0, "zero1", 4) == copy_bytes_per_rank(1200.0, "fsdp", 1) == 1200.0
