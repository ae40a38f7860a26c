"""The planner: what it picks fits, what cannot fit says by how much, plans apply to a config."""

from __future__ import annotations

import pytest

from memfit.config_loading import load_config
from memfit.errors import DoesNotFitError, UsageError
from memfit.memory.estimator import estimate
from memfit.memory.planner import MARGIN, plan, plan_to_overrides
from memfit.units import GIB, MIB


def test_plan_picks_a_configuration_that_fits_and_applies_to_the_config():
    config = load_config(overrides={"model": "tiny", "seq_len": 256, "batch_size": 8})
    budget = 64 * MIB
    result = plan(config, budget_bytes=budget)
    assert result.fits and result.estimated_peak_bytes <= budget * (1 - MARGIN)
    planned = config.replace(**plan_to_overrides(result))
    assert planned.effective_batch_for() == config.effective_batch_for()  # the effective batch is kept
    again = estimate(planned, budget_bytes=budget)
    assert again.peak_bytes == result.estimated_peak_bytes and again.fits
    assert result.command.startswith("memfit train --model tiny --seq-len 256 --batch-size ")
    for alternative in result.alternatives:
        assert alternative["estimated_peak_bytes"] <= budget * (1 - MARGIN)
        assert 0 < alternative["relative_speed"] <= 1.0


def test_a_roomy_budget_trains_everything_fast():
    result = plan(load_config(overrides={"model": "tiny", "seq_len": 128}), budget_bytes=8 * GIB)
    assert result.plan["lora_r"] == 0 and result.plan["gradient_checkpointing"] == "off"


def test_too_small_budget_says_how_much_is_needed():
    config = load_config(overrides={"model": "tiny", "seq_len": 256})
    with pytest.raises(DoesNotFitError, match=r"needs \d+\.\d GiB with everything on; 0\.0 GiB available") as error:
        plan(config, budget_bytes=1024)
    assert error.value.exit_code == 3


def test_auto_falls_back_to_lora_then_proposes_more_gpus():
    config = load_config(overrides={"model": "llama-3.1-8b", "seq_len": 2048})
    result = plan(config, gpu="rtx-4090")
    assert result.plan["lora_r"] > 0 and result.plan["quantize"] == "none"  # the least lossy that fits
    assert "--lora-r" in result.command
    with pytest.raises(DoesNotFitError, match="use --allow lora or .* GPUs with --sharding fsdp"):
        plan(config, gpu="rtx-4090", allow="full")
    sharded = plan(config, gpu="a100-80gb", allow="full", world_size=4)
    assert sharded.command.startswith("torchrun --nproc-per-node 4 -m memfit train")


def test_plan_needs_a_budget_or_a_gpu():
    with pytest.raises(UsageError, match="--gpu NAME or --memory-budget"):
        plan(load_config(overrides={"model": "tiny"}))
