"""The estimates of mixture-of-experts models against the tracker on real CPU steps, within the decoders' bands.

Small models of the zoo's MoE families (docs/accuracy.md's shapes: Qwen3-MoE, gpt-oss, Mixtral, OLMoE, and DeepSeek-V3 and GLM-4-MoE with
their dense first layer and shared expert), none of them used to fit any term of the estimator: two real training
steps, the second one's peak counted by memfit's MemoryTracker, against `estimate(method=...)` of the same config.
fp32 weights run the grouped path whose meta kernel takes bf16 only (the traced estimate answers it itself).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from memfit.config_loading import load_config
from memfit.prediction.estimator import ERROR_BAND, estimate
from memfit.prediction.run_shape import resolve_run
from memfit.prediction.traced import StepSetup
from memfit.train.traced import measure_step_with_tracker
from model_zoo import ZOO

FAMILIES = ("qwen3_moe", "gpt_oss", "mixtral", "olmoe", "deepseek_v3", "glm4_moe")
VARIANTS = {
    "fp32": {},
    "bf16 autocast": {"precision": "bf16"},
    "lora bf16": {"lora_r": 8, "dtype": "bf16", "gradient_checkpointing": "full"},
}
BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_moe_estimate_accuracy.py"


def _bench_architectures() -> dict:
    """The MoE shapes of docs/accuracy.md (4 layers, hidden 128, 8 experts of width 96, top-2)."""
    spec = importlib.util.spec_from_file_location("bench_moe_estimate_accuracy", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH.parent))  # it reuses bench_estimate_accuracy's measurement
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(BENCH.parent))
    return bench.architectures()


def _measured(hf_config, config) -> int:
    run = resolve_run(config, hf_config, None)
    setup = StepSetup(config.training.batch_size, config.data.seq_len, {4: torch.float32, 2: torch.bfloat16}[
        run.weight_bytes], torch.bfloat16 if run.autocast else None, run.attention, run.checkpointing,
        run.checkpoint_every, run.loss_chunk_size, torch.device("cpu"))
    return measure_step_with_tracker(hf_config, config, setup)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_estimates_within_the_decoders_band(family):
    """Held out from any tuning; on the zoo's 32-wide models fixed terms weigh more (bf16 autocast and LoRA
    rows there fell 10-14 % short), so the shapes are docs/accuracy.md's."""
    torch.manual_seed(0)
    hf_config = _bench_architectures()[family]
    for variant, changes in VARIANTS.items():
        config = load_config(overrides={"seq_len": 128, "batch_size": 2, **changes})
        truth = _measured(hf_config, config)
        for method in ("analytical", "traced"):
            predicted = estimate(config, hf_config=hf_config, method=method).peak_bytes
            assert predicted / truth - 1 == pytest.approx(0, abs=ERROR_BAND[method]), (
                f"{family} {variant} {method}: {predicted} vs {truth} measured")


def test_every_expert_counts_in_the_state_and_active_in_the_details():
    hf_config = ZOO["qwen3_moe"]()
    result = estimate(load_config(overrides={"seq_len": 32, "batch_size": 1}), hf_config=hf_config)
    model = __import__("model_zoo").build_model("qwen3_moe")
    total = sum(p.numel() for p in model.parameters())
    assert result.details["parameters_total"] == total
    assert result.details["full_bytes"]["gradients"] == 4 * total  # every expert gets a gradient
    experts = result.details["expert_parameter_count"]
    # 2 layers x 4 experts x (gate_up 64 x 32 + down 32 x 32): top-2 of 4 run per token
    assert experts == 2 * 4 * (64 * 32 + 32 * 32)
    assert result.details["parameters_active"] == total - experts // 2


def test_expert_adapters_count_when_lora_targets_the_experts():
    hf_config = ZOO["mixtral"]()
    plain = estimate(load_config(overrides={"lora_r": 4, "lora_targets": "q_proj,v_proj"}), hf_config=hf_config)
    auto = estimate(load_config(overrides={"lora_r": 4}), hf_config=hf_config)
    # auto adds (besides k and o) per layer: gate_up 4 experts x rank 4 x (128 + 32), down 4 x 4 x (32 + 64)
    experts = 2 * (4 * 4 * (128 + 32) + 4 * 4 * (32 + 64))
    assert auto.details["trainable_parameter_count"] - plain.details["trainable_parameter_count"] >= experts


def test_expert_adapter_buffers_do_not_turn_the_probed_bytes_negative_at_long_sequences():
    """Split LoRA keeps per-expert buffers whose size does not follow the tokens: a constant per block. The probe
    fits c + a*s + b*s^2, so adapters add bytes at 8K tokens; a per-token line through two lengths went negative."""
    from memfit.models.presets import preset_config
    from memfit.prediction.layer_probe import probed_layer_bytes_per_token

    hf_config = preset_config("qwen3-30b-a3b")
    plain = probed_layer_bytes_per_token(hf_config, 2, False, "sdpa", 8192)
    adapted = probed_layer_bytes_per_token(hf_config, 2, False, "sdpa", 8192, lora_r=16)
    assert plain > 0 and adapted >= plain
