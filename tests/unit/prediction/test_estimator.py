"""The estimator: exact state bytes, the JSON schema, and accuracy against measured steps."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig

from memfit.config_loading import load_config
from memfit.memory.categories import CATEGORIES
from memfit.models.presets import MODEL_PRESETS, build_meta_model, parameter_count, preset_config
from memfit.prediction.estimator import (
    BNB_8BIT_BLOCK,
    BNB_8BIT_MIN_SIZE,
    CUDA_CONTEXT_BYTES,
    estimate,
    optimizer_state_bytes_for_shapes,
    resolve_run,
)
from memfit.prediction.traced import StepSetup
from memfit.train.traced import measure_step_with_tracker

SCHEMA = {"model", "method", "peak_bytes", "breakdown", "budget_bytes", "fits", "headroom_bytes", "error_band"}
BREAKDOWN = set(CATEGORIES)  # the tracker's categories: estimate and profile report the same


def small_llama(layers: int = 2) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_state_bytes_of_every_preset_equal_closed_forms(name):
    hf_config = preset_config(name)
    params = parameter_count(hf_config)  # from the config numbers alone
    tensors = len(list(build_meta_model(hf_config).parameters()))
    task = "masked-lm" if hf_config.model_type in ("esm", "bert", "modernbert") else "causal-lm"  # encoders: no causal LM
    full = estimate(load_config(overrides={"model": name, "task": task}), hf_config=hf_config).details["full_bytes"]
    assert full["parameters"] == 4 * params
    assert full["gradients"] == 4 * params
    assert full["optimizer_states"] == 8 * params + 4 * tensors  # two fp32 moments + the fused step counter


def test_8bit_lora_and_bf16_state_bytes_closed_forms():
    hf_config = preset_config("llama-2-7b")
    shapes = [tuple(p.shape) for p in build_meta_model(hf_config).parameters()]
    eight = estimate(load_config(overrides={"model": "llama-2-7b", "optimizer": "adamw-8bit"}), hf_config=hf_config)
    expected = 2 * BNB_8BIT_BLOCK * 4 + sum(
        2 * math.prod(s) + 8 * math.ceil(math.prod(s) / BNB_8BIT_BLOCK) if math.prod(s) >= BNB_8BIT_MIN_SIZE else 8 * math.prod(s)
        for s in shapes
    )
    assert eight.details["full_bytes"]["optimizer_states"] == expected
    lora = estimate(load_config(overrides={"model": "llama-2-7b", "lora_r": 16, "dtype": "bf16"}), hf_config=hf_config)
    # 32 layers x (q, k, v, o: 4096 -> 4096; gate, up: 4096 -> 11008; down: 11008 -> 4096), A and B each
    adapters = 32 * 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    assert lora.details["trainable_parameter_count"] == adapters
    assert lora.details["full_bytes"]["parameters"] == 2 * parameter_count(hf_config) + 4 * adapters
    assert lora.details["full_bytes"]["gradients"] == 4 * adapters
    qlora = estimate(load_config(overrides={"model": "llama-2-7b", "lora_r": 16, "dtype": "bf16", "quantize": "4bit"}),
                     hf_config=hf_config)
    assert qlora.details["full_bytes"]["parameters"] < 0.3 * lora.details["full_bytes"]["parameters"]


def test_8bit_closed_form_matches_bitsandbytes_state():
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from memfit.techniques.optimizers import measured_optimizer_state_bytes

    model = AutoModelForCausalLM.from_config(small_llama())
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (1, 8)), labels=torch.randint(0, 256, (1, 8))).loss.backward()
    optimizer.step()
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert optimizer_state_bytes_for_shapes("adamw-8bit", shapes, 4) == measured_optimizer_state_bytes(optimizer)


def test_json_schema_and_breakdown_is_a_sum():
    result = estimate(load_config(overrides={"model": "llama-3.2-1b", "seq_len": 1024}), gpu="rtx-4090")
    data = result.to_dict()
    assert SCHEMA <= set(data) and set(data["breakdown"]) == BREAKDOWN
    assert sum(data["breakdown"].values()) == data["peak_bytes"]
    assert data["budget_bytes"] == result.budget_bytes > 0
    assert data["headroom_bytes"] == data["budget_bytes"] - data["peak_bytes"]
    assert data["fits"] is (data["headroom_bytes"] >= 0)
    assert 0 < data["error_band"] <= 0.1
    assert data["breakdown"]["other"] >= CUDA_CONTEXT_BYTES  # a GPU preset adds the CUDA context


def test_sharding_divides_state():
    config = load_config(overrides={"model": "llama-2-7b", "seq_len": 512, "batch_size": 1,
                                    "gradient_checkpointing": "full"})
    peaks = {s: estimate(config, world_size=4, sharding=s).peak_bytes for s in ("none", "ddp", "zero1", "zero2", "zero3")}
    # DDP replicates: its in-place per-tensor all-reduce holds nothing beside the gradients
    assert peaks["ddp"] == peaks["none"] > peaks["zero1"] > peaks["zero2"] > peaks["zero3"]
    with pytest.raises(Exception, match="sharding"):
        estimate(config, sharding="zero9")


def _measured(hf_config, config) -> int:
    run = resolve_run(config, hf_config, None)
    setup = StepSetup(config.training.batch_size, config.data.seq_len, {4: torch.float32, 2: torch.bfloat16}[run.weight_bytes],
                      torch.bfloat16 if run.autocast else None, run.attention, run.checkpointing, run.checkpoint_every,
                      run.loss_chunk_size, torch.device("cpu"))
    return measure_step_with_tracker(hf_config, config, setup)


@pytest.mark.parametrize("changes", [
    {},
    {"gradient_checkpointing": "full"},
    {"optimizer": "adamw-8bit"},
    {"precision": "bf16"},
    {"lora_r": 8},
    {"lora_r": 8, "dtype": "bf16", "gradient_checkpointing": "full"},
    {"attention": "eager", "seq_len": 128},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "adamw")
def test_estimates_stay_within_their_error_band_of_the_measured_peak(changes):
    if changes.get("optimizer") == "adamw-8bit":
        pytest.importorskip("bitsandbytes")
    hf_config = small_llama(layers=3)
    config = load_config(overrides={"seq_len": 96, "batch_size": 2, **changes})
    truth = _measured(hf_config, config)
    traced = estimate(config, hf_config=hf_config, method="traced").peak_bytes
    result = estimate(config, hf_config=hf_config)
    analytical, band = result.peak_bytes, result.to_dict()["error_band"]
    print(f"measured {truth} B, traced {traced} B, analytical {analytical} B ({analytical / truth - 1:+.1%}, band {band:.0%})")
    assert traced == truth  # the same step on fake tensors, counted by the same tracker: to the byte
    assert abs(analytical / truth - 1) <= band  # within the band the estimate itself states


def test_traced_7b_step_runs_without_memory():
    import resource

    config = load_config(overrides={"model": "llama-2-7b", "seq_len": 128, "batch_size": 1,
                                    "gradient_checkpointing": "full"})
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    traced = estimate(config, method="traced")
    # the traced step holds shapes, not bytes: the process's high-water mark grows by far less than the 107 GB
    # the step it traces would hold (a timed assert stood here; how long it takes is benchmarks' to say)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 2 * 1024**2
    analytical = estimate(config)
    assert traced.peak_bytes > 6.7e9 * 16  # weights, gradients and two fp32 moments
    assert abs(analytical.peak_bytes / traced.peak_bytes - 1) < 0.10


@pytest.mark.parametrize("impl", ["foreach", "for-loop", "fused"])
def test_adamw_step_temporaries_match_torch(impl):
    from memfit.train.traced import trace_step

    hf_config = small_llama()
    config = load_config(overrides={"seq_len": 8, "batch_size": 1, "optimizer_impl": impl})
    step = trace_step(hf_config, config, StepSetup(1, 8, torch.float32, None, "sdpa", "off", 1, 0, torch.device("cpu")),
                      fake=False)
    result = estimate(config, hf_config=hf_config)
    state = sum(result.details["full_bytes"].values())
    measured_extra = step.phase_peaks["optimizer"] - state
    expected = result.breakdown["other"] if result.details["peak_phase"] == "optimizer step" else 0
    assert abs(measured_extra - expected) <= 512  # a few step counters and norms


def _family(model_type: str):
    """A small config of a family outside the closed forms (4 blocks, hidden 128, vocabulary 1000)."""
    from transformers import AutoConfig

    extra = {"head_dim": 32} if model_type.startswith("gemma") else {}
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    return AutoConfig.for_model(model_type, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                max_position_embeddings=1024, **ids, **extra)


@pytest.mark.parametrize("model_type", ["starcoder2", "gemma3_text", "gpt_neox", "qwen3", "olmo2"])
@pytest.mark.parametrize("changes", [{}, {"gradient_checkpointing": "full"}, {"lora_r": 8}],
                         ids=["adamw", "full checkpointing", "lora"])
def test_families_outside_the_closed_forms_are_measured_from_their_blocks(model_type, changes):
    """Starcoder2 (LayerNorm, GELU MLP with biases), Gemma 3 (four norms and q/k norms per block), GPT-NeoX
    (parallel attention and MLP), Qwen 3 and OLMo 2 (q/k norms): the block probe keeps them in the band."""
    hf_config = _family(model_type)
    config = load_config(overrides={"seq_len": 256, "batch_size": 2, **changes})
    truth = _measured(hf_config, config)
    result = estimate(config, hf_config=hf_config)
    assert result.details["activations_measured_from_model"]
    assert abs(result.peak_bytes / truth - 1) <= 0.10


def test_llama_shaped_closed_forms_would_miss_starcoder2_by_more_than_15_percent():
    """Why the probe exists: the Llama-shaped block terms, applied to Starcoder2, miss by > 15 %."""
    from unittest import mock

    import memfit.prediction.estimator as estimator_module

    hf_config = _family("starcoder2")
    config = load_config(overrides={"seq_len": 256, "batch_size": 2})
    truth = _measured(hf_config, config)
    with mock.patch.object(estimator_module, "_layer_per_token", lambda *args: None):
        llama_shaped = estimate(config, hf_config=hf_config).peak_bytes
    measured_from_model = estimate(config, hf_config=hf_config).peak_bytes
    assert llama_shaped / truth - 1 > 0.15
    assert abs(measured_from_model / truth - 1) <= 0.05


def test_block_probe_agrees_with_the_llama_closed_form():
    from memfit.prediction.activations import Precision, architecture_of, layer_bytes_per_token
    from memfit.prediction.layer_probe import probed_layer_bytes_per_token

    hf_config = small_llama()
    for attention in ("sdpa", "eager"):
        probed = probed_layer_bytes_per_token(hf_config, 4, False, attention, 512)
        closed = layer_bytes_per_token(architecture_of(hf_config), Precision(4, 4), attention, 512)
        assert abs(probed / closed - 1) < 0.05
