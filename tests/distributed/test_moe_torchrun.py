"""A mixture of experts under FSDP2: the fused 3-D expert parameters are sharded over the ranks like every other
parameter, and the update equals the one-process run (SGD without clipping; the runs are in the shared launches of
conftest.py: `references` and `engine_runs`)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from torchrun_helpers import assert_same_weights, final_weights

from fault_injection import largest_update
from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed


def test_moe_reference_moves_its_experts(references, moe_sgd_args):
    initial = load_file(moe_sgd_args[moe_sgd_args.index("--model") + 1] + "/model.safetensors")
    final = final_weights(references["moe-sgd"])
    experts = {name: tensor for name, tensor in initial.items() if ".experts." in name}
    assert experts  # saved per expert (transformers' checkpoint format); fused into 3-D stacks when loaded
    assert largest_update(experts, {name: final[name] for name in experts}) > 1e-3


def test_fsdp_with_sharded_experts_equals_one_process_under_sgd(engine_runs, references):
    assert_same_weights(final_weights(references["moe-sgd"]), final_weights(engine_runs["moe-fsdp"]))
    steps = [r for r in read_metrics(engine_runs["moe-fsdp"] / "metrics.jsonl") if "event" not in r]
    whole = sum(t.numel() * t.element_size() for t in final_weights(references["moe-sgd"]).values())
    for rank in steps[-1]["ranks"]:  # each rank holds about half of every parameter, the experts included
        assert rank["parameters"] < 0.6 * whole


def test_fsdp_moe_check_fails_on_a_2x_gradient_error(engine_runs, references):
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(references["moe-sgd"]), final_weights(engine_runs["moe-fsdp-fault"]))
