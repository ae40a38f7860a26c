"""The planner tries a preference run's reference: the frozen copy, or its log-probabilities computed once (cached)."""

from __future__ import annotations

import re

import pytest

from memfit.config_loading import load_config
from memfit.errors import DoesNotFitError
from memfit.prediction.planner import plan
from memfit.units import GIB

MODEL = {"model": "preset:llama-3.2-1b", "seq_len": 512, "task": "dpo"}


def _least_needed(**settings) -> float:
    """GiB the plan needs with every lever on (what a budget too small for anything reports)."""
    with pytest.raises(DoesNotFitError) as error:
        plan(load_config(overrides={**MODEL, **settings}), budget_bytes=1024, allow="full")
    return float(re.search(r"needs (\d+\.\d+) GiB with everything on", str(error.value)).group(1))


def test_the_plan_takes_the_cached_reference_where_the_copy_does_not_fit():
    with_copy, with_cache = _least_needed(reference="copy"), _least_needed(reference="cached")
    assert with_cache < with_copy - 1  # a 1B model's copy: about 2.3 GiB in fp32 (bf16 weights: about half)
    budget = int((with_copy + with_cache) / 2 * GIB)
    result = plan(load_config(overrides=MODEL), budget_bytes=budget, allow="full")
    assert result.plan["reference"] == "cached"
    assert "--reference cached" in result.command
    with pytest.raises(DoesNotFitError):  # and only because of it: the copy alone does not fit that budget
        plan(load_config(overrides={**MODEL, "reference": "copy"}), budget_bytes=budget, allow="full")


def test_lora_keeps_its_free_reference_and_a_chosen_one_stays():
    lora = plan(load_config(overrides={**MODEL, "lora_r": 8}), budget_bytes=40 * GIB, allow="lora")
    assert "reference" not in lora.plan
    chosen = plan(load_config(overrides={**MODEL, "reference": "copy"}), budget_bytes=40 * GIB, allow="full")
    assert chosen.plan.get("reference", "copy") == "copy"
