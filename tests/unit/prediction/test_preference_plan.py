"""The planner tries a preference run's reference: the frozen copy, or its log-probabilities computed once (cached)."""

from __future__ import annotations

import re

import pytest

from memfit.config_loading import load_config
from memfit.errors import DoesNotFitError
from memfit.prediction.planner import plan
from memfit.units import GIB

MODEL = {"model": "preset:llama-3.2-1b", "seq_len": 512, "task": "dpo"}


def _least_needed(allow: str = "full", **settings) -> float:
    """GiB the plan needs with every lever on (what a budget too small for anything reports)."""
    with pytest.raises(DoesNotFitError) as error:
        plan(load_config(overrides={**MODEL, **settings}), budget_bytes=1024, allow=allow)
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


# -- the pair layout: one forward (faster) or two (one side's activations at the peak) -------------------------------

PAIRS = {"model": "preset:gpt2", "seq_len": 1024, "task": "dpo", "batch_size": 8, "lora_r": 16}
"""A DPO run whose activations decide its peak: 8 pairs of 1,024-token rows under LoRA, whose gradients (which wait
while the rejected rows run again) are small."""


def test_the_plan_runs_two_forwards_where_one_does_not_fit_and_one_where_both_fit():
    one_forward, two_forwards = (_least_needed("lora", **PAIRS, pair_layout=layout) for layout in ("two-rows", "split"))
    assert two_forwards < one_forward - 0.1  # about 0.8 and 0.5 GiB
    tight = plan(load_config(overrides=PAIRS), budget_bytes=int((one_forward + two_forwards) / 2 * GIB), allow="lora")
    assert tight.plan["pair_layout"] == "split" and "--pair-layout split" in tight.command
    roomy = plan(load_config(overrides=PAIRS), budget_bytes=40 * GIB, allow="lora")
    assert roomy.plan.get("pair_layout", "two-rows") == "two-rows"
    # and because one forward is faster, not by the order the grid lists them in
    asked = plan(load_config(overrides={**PAIRS, "pair_layout": "split"}), budget_bytes=40 * GIB, allow="lora")
    assert asked.plan.get("pair_layout", "split") == "split" and asked.tokens_per_second < roomy.tokens_per_second


def test_the_estimate_keeps_one_side_of_a_pair_under_two_forwards():
    from memfit.prediction.estimator import estimate

    one, two = (estimate(load_config(overrides={**PAIRS, "pair_layout": layout})) for layout in ("two-rows", "split"))
    assert two.details["preference"]["forwards"] == 2 and one.details["preference"]["forwards"] == 1
    assert two.per_layer_activation_bytes == pytest.approx(one.per_layer_activation_bytes / 2, rel=0.01)
    assert two.peak_bytes < one.peak_bytes


SPLIT_MODES = {"dpo split copy": ({"task": "dpo", "pair_layout": "split"}, "copy"),
               "dpo split cached": ({"task": "dpo", "reference": "cached", "pair_layout": "split"}, "cached")}


@pytest.mark.parametrize("shape", ["head-bound", "mlp-bound"])
@pytest.mark.parametrize("mode", list(SPLIT_MODES))
def test_the_estimate_of_two_forwards_is_within_5_percent_of_the_tracked_peak(monkeypatch, shape, mode):
    """memfit's real step under --pair-layout split against the analytical estimate, on the tiny Llamas of
    test_preference_estimate.py: one side's activations, and every chosen-row gradient waiting while the rejected
    rows run again."""
    import test_preference_estimate as measured

    monkeypatch.setattr(measured, "MODES", {**measured.MODES, **SPLIT_MODES})
    truth = measured._measured(shape, mode)
    estimated = measured._estimated(shape, mode)
    print(f"{shape} {mode}: measured {truth / 2**20:.2f} MiB, estimated {estimated / truth - 1:+.1%}")
    assert abs(estimated / truth - 1) <= measured.BAND
