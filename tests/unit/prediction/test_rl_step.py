"""memfit estimate of a --task grpo step: generation's key-value cache, exact against a real cache, and the larger of
the two phases as the peak."""

from __future__ import annotations

import torch

from memfit.config_loading import load_config
from memfit.prediction.activations import architecture_of
from memfit.prediction.estimator import estimate
from memfit.prediction.rl_step import generation_phase
from tiny_llama import tiny_llama, tiny_llama_config


def _config(**settings):
    return load_config(overrides={"model": "tiny", "task": "grpo", "seq_len": 32, "max_completion_length": 32,
                                  "num_generations": 4, "batch_size": 8, **settings})


def test_the_cache_term_is_the_bytes_of_a_real_cache():
    model = tiny_llama(seed=0).eval()
    rows, prompt, new = 3, 10, 6
    with torch.no_grad():
        output = model(input_ids=torch.randint(0, 100, (rows, prompt)), use_cache=True)
        cache = output.past_key_values if output.past_key_values is not None else output.cache
        for _ in range(new - 1):
            output = model(input_ids=torch.randint(0, 100, (rows, 1)), cache=cache, use_cache=True)
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    held = sum(t.numel() * t.element_size() for t in tensors)
    config = _config(generation_batch_size=rows)
    phase = generation_phase(config, architecture_of(tiny_llama_config()), 4, prompt + new - 1, completions_in_step=8)
    assert phase.completions == rows and phase.kv_cache_bytes == held


def test_the_peak_is_the_larger_phase_and_both_are_said():
    short = estimate(_config()).details["rl_step"]
    assert short["peak_phase"] == "training" and short["row_tokens"] == 64
    many = estimate(_config(max_completion_length=2048, gradient_checkpointing="full", batch_size=4,
                            gradient_accumulation_steps=16))
    long = many.details["rl_step"]
    assert long["peak_phase"] == "generation" and long["completions_generated_at_once"] == 64
    assert many.peak_bytes == long["generation_bytes"] > long["training_bytes"]
    halved = estimate(_config(max_completion_length=2048, gradient_checkpointing="full", batch_size=4,
                              gradient_accumulation_steps=16, generation_batch_size=32)).details["rl_step"]
    assert halved["kv_cache_bytes"] * 2 == long["kv_cache_bytes"]


def test_the_reference_copy_is_counted_without_lora_only():
    with_copy = estimate(_config(beta=0.04)).details["rl_step"]
    without = estimate(_config()).details["rl_step"]
    assert with_copy["reference_copy_bytes"] > 0 and without["reference_copy_bytes"] == 0
    assert with_copy["training_bytes"] == without["training_bytes"] + with_copy["reference_copy_bytes"]
    lora = estimate(_config(beta=0.04, lora_r=8)).details["rl_step"]
    assert lora["reference_copy_bytes"] == 0
