"""`memfit plan --gpus 4 --maximize seq-len` searches context-parallel sizes and plans a longer context than one GPU."""
import pytest
from transformers import LlamaConfig

from memfit import load_config
from memfit.prediction.context_parallel_plan import context_parallel_sizes
from memfit.prediction.estimator import estimate
from memfit.prediction.planner import MARGIN, SEQ_STEP, plan
from memfit.units import GIB

BUDGET = int(0.25 * GIB)
HOST = 64 * GIB


@pytest.fixture(scope="module")
def model():
    """A small Llama: 8 heads, 4 key-value heads, positions far past what the budget allows."""
    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1 << 22)


def _config():
    return load_config(overrides={"model": "tiny", "precision": "fp32"})


def _longest(model, gpus):
    return plan(_config(), budget_bytes=BUDGET, allow="full", world_size=gpus, maximize="seq-len", hf_config=model,
                host_memory=HOST)


def test_sizes_divide_the_gpus_and_the_key_value_heads(model):
    assert context_parallel_sizes(model, 8) == [1, 2, 4]
    assert context_parallel_sizes(model, 6) == [1, 2]


def test_four_gpus_plan_a_context_parallel_split_and_a_longer_context(model):
    one, four = _longest(model, 1), _longest(model, 4)
    size = four.plan["context_parallel"]
    assert size > 1
    assert four.plan["seq_len"] > one.plan["seq_len"]
    assert f"--context-parallel {size}" in four.command and "--nproc-per-node 4" in four.command
    assert "data-parallel x" in four.trades[0] and "GiB of host memory" in four.trades[0]
    # the planned context's per-rank estimate fits the budget; one step up does not
    changes = {name: value for name, value in four.plan.items() if value is not None}
    planned = _config().replace(**changes)
    fits = estimate(planned, world_size=4, sharding="fsdp", budget_bytes=BUDGET, hf_config=model)
    assert fits.details["context_parallel"]["size"] == size
    assert fits.peak_bytes <= BUDGET * (1 - MARGIN)
    longer = planned.replace(seq_len=four.plan["seq_len"] + SEQ_STEP)
    assert estimate(longer, world_size=4, sharding="fsdp", budget_bytes=BUDGET,
                    hf_config=model).peak_bytes > BUDGET * (1 - MARGIN)
