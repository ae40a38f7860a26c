"""Every engine gives the single-process update, under SGD without clipping, and the check can fail.

Adam's update does not change when every gradient is scaled, and clipping at 1.0 hides most
of the rest, so an engine whose loss normalizer is wrong by the world size would pass an
AdamW comparison. Here every run trains with plain SGD (no momentum, no clipping, constant
rate): the final weights after 3 steps are the initial ones minus 0.5 x the summed gradients,
so comparing them compares the gradients. Each engine's twin run has every backward pass
halved (the normalizer not divided by the world size) and must then differ.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from torchrun_helpers import assert_same_weights, final_weights

from fault_injection import largest_update
from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

# The runs are launched by the session fixtures of conftest.py (engine_runs, later_runs, zero_runs),
# together with the AdamW runs of test_torchrun.py.


def test_sgd_reference_moves_the_weights_far_beyond_the_tolerance(sgd_single, llama_dir):
    initial = load_file(str(llama_dir / "model.safetensors"))
    assert largest_update(initial, final_weights(sgd_single)) > 1e-2


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_engine_equals_single_process_under_sgd(engine, engine_runs, sgd_single):
    assert_same_weights(final_weights(sgd_single), final_weights(engine_runs[engine]))
    summary = read_metrics(engine_runs[engine] / "metrics.jsonl")[-1]
    assert summary["world_size"] == 2 and summary["optimizer"].startswith("sgd")


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_engine_check_fails_on_a_2x_gradient_error(engine, engine_runs, sgd_single):
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(sgd_single), final_weights(engine_runs[f"{engine}-fault"]))


def test_ddp_oom_recovery_on_one_rank_equals_single_process_under_sgd(later_runs, sgd_single):
    ooms = [r for r in read_metrics(later_runs["capped"] / "metrics.jsonl") if r.get("event") == "oom"]
    assert ooms and {r["rank"] for r in ooms} == {1} and ooms[0]["new_micro_batch_size"] == 2
    assert_same_weights(final_weights(sgd_single), final_weights(later_runs["capped"]))


def test_ddp_oom_recovery_check_fails_on_a_2x_gradient_error(later_runs, sgd_single):
    assert any(r.get("event") == "oom" for r in read_metrics(later_runs["capped-fault"] / "metrics.jsonl"))
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(sgd_single), final_weights(later_runs["capped-fault"]))


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3-offload"])
def test_deepspeed_equals_single_process_under_sgd(stage, zero_runs, sgd_single):
    assert_same_weights(final_weights(sgd_single), final_weights(zero_runs[stage]))
    if stage == "zero2":  # its blocks were compiled, and nothing fell back
        assert read_metrics(zero_runs[stage] / "metrics.jsonl")[-1]["compile"].startswith("2 of 2 blocks")
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(sgd_single), final_weights(zero_runs[f"{stage}-fault"]))
