"""The speed model prices Ulysses' all-to-all traffic: a context-parallel step is the compute share plus the bytes
crossing the GPUs' link at its rate."""
import pytest

from memfit import load_config
from memfit.gpus import get_gpu
from memfit.models.presets import resolve_model_config
from memfit.prediction.context_parallel import peer_link, ulysses_bytes_per_step
from memfit.prediction.estimator import estimate
from memfit.prediction.speed_model import estimated_step_seconds

SEQ = 65536


def _step_seconds(context_parallel: int, gpu: str, checkpointing: str = "full") -> float:
    config = load_config(overrides={"model": "llama-3.1-8b", "seq_len": SEQ, "batch_size": 1,
                                    "gradient_checkpointing": checkpointing, "context_parallel": context_parallel})
    hf_config = resolve_model_config("llama-3.1-8b")
    est = estimate(config, world_size=8, sharding="fsdp", gpu=gpu, hf_config=hf_config)
    changes = {"batch_size": 1, "gradient_accumulation_steps": 1, "gradient_checkpointing": checkpointing}
    return estimated_step_seconds(changes, config, est, get_gpu(gpu), hf_config)


def test_llama_8b_all_to_all_bytes_by_hand():
    hf_config = resolve_model_config("llama-3.1-8b")
    # per layer and pass: q and out at 32 x 128, k and v at 8 x 128, 32768 tokens a rank, bf16, half leaves the rank
    per_pass = (2 * 4096 + 2 * 1024) * 32768 * 2 * 0.5
    assert ulysses_bytes_per_step(hf_config, SEQ, 2, 1, 2, recomputed=True) == 32 * 3 * per_pass
    assert ulysses_bytes_per_step(hf_config, SEQ, 2, 1, 2, recomputed=False) == 32 * 2 * per_pass
    assert ulysses_bytes_per_step(hf_config, SEQ, 1, 1, 2, recomputed=True) == 0


@pytest.mark.parametrize("gpu, link", [("h100", 450.0), ("rtx-4090", 32.0)])
def test_step_time_is_the_compute_share_plus_the_traffic_over_the_link(gpu, link):
    hf_config = resolve_model_config("llama-3.1-8b")
    assert peer_link(get_gpu(gpu), 2)[1] == link
    traffic = ulysses_bytes_per_step(hf_config, SEQ, 2, 1, 2, recomputed=True) / (link * 1e9)
    one, two = _step_seconds(1, gpu), _step_seconds(2, gpu)
    assert two == pytest.approx(one / 2 + traffic, rel=1e-6)
    assert two > one / 2 + 0.99 * traffic


def test_no_recomputation_moves_two_passes_not_three():
    hf_config = resolve_model_config("llama-3.1-8b")
    traffic = ulysses_bytes_per_step(hf_config, SEQ, 2, 1, 2, recomputed=False) / 450e9
    assert _step_seconds(2, "h100", "off") == pytest.approx(_step_seconds(1, "h100", "off") / 2 + traffic, rel=1e-6)


def test_a_group_past_one_node_crosses_infiniband():
    assert peer_link(get_gpu("h100"), 16) == ("InfiniBand NDR", 50.0)
    assert peer_link(None, 2)[0] == "host memory (gloo)"
