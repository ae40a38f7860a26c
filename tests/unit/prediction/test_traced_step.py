"""The traced estimate runs memfit's own step on fake tensors: same bytes as the real step, same categories as the profile."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from memfit.config_loading import load_config
from memfit.memory.categories import CATEGORIES, OPTIMIZER_STATES
from memfit.prediction.estimator import estimate
from memfit.prediction.traced import StepSetup
from memfit.train.traced import trace_step
from tiny_llama import tiny_llama_config


def small_llama() -> LlamaConfig:
    return tiny_llama_config(layers=3, max_positions=2048)


@pytest.mark.slow
@pytest.mark.parametrize(
    "checkpointing, changes",
    [
        ("off", {}),
        ("full", {}),
        ("full", {"lora_r": 8}),
        ("off", {"optimizer_in_backward": True, "max_grad_norm": 0.0}),
    ],
    ids=["plain", "checkpointed", "lora-checkpointed", "optimizer-in-backward"],
)
def test_fake_step_counts_what_the_real_step_holds_to_the_byte(checkpointing, changes):
    config = load_config(overrides={"seq_len": 64, "batch_size": 2, **changes})
    setup = StepSetup(2, 64, torch.float32, None, "sdpa", checkpointing, 1, 0, torch.device("cpu"))
    fake = trace_step(small_llama(), config, setup, fake=True)
    real = trace_step(small_llama(), config, setup, fake=False)
    assert (fake.peak_bytes, fake.breakdown, fake.phase_peaks) == (real.peak_bytes, real.breakdown, real.phase_peaks)
    assert list(fake.breakdown) == list(CATEGORIES) and sum(fake.breakdown.values()) == fake.peak_bytes
    if checkpointing == "full":
        assert fake.breakdown["recomputed_activations"] > 0 or fake.peak_phase != "backward"


def test_lora_auto_targets_come_from_the_training_mapping():
    """The traced step puts adapters where training does (techniques/lora.py), so its optimizer state matches."""
    from transformers import AutoModelForCausalLM

    from memfit.techniques.lora import apply_lora

    config = load_config(overrides={"seq_len": 32, "batch_size": 1, "lora_r": 8, "lora_targets": "auto"})
    model, _ = apply_lora(AutoModelForCausalLM.from_config(small_llama()), config.lora, gradient_checkpointing=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    adamw_state = sum(8 * p.numel() + 4 for p in trainable)  # two fp32 moments and a step counter each
    setup = StepSetup(1, 32, torch.float32, None, "sdpa", "off", 1, 0, torch.device("cpu"))
    assert trace_step(small_llama(), config, setup, fake=True).breakdown[OPTIMIZER_STATES] == adamw_state


@pytest.mark.slow
def test_traced_estimate_and_profile_agree_on_categories_and_bytes(llama_dir, text_file, tmp_path):
    from memfit.train.profiling import profile_run

    config = load_config(
        overrides={
            "model": str(llama_dir),
            "dataset": str(text_file),
            "seq_len": 64,
            "batch_size": 2,
            "loss_chunk_size": 0,
            "max_steps": 2,
            "output_dir": str(tmp_path),
            "precision": "fp32",
        }
    )
    report, _ = profile_run(config)
    traced = estimate(config, method="traced")
    assert list(report.breakdown) == list(traced.breakdown) == list(CATEGORIES)
    # The same step, counted by the same tracker: the second step's peak, category by category.
    assert report.step_peak_bytes[-1] == traced.peak_bytes
    assert report.breakdown == traced.breakdown
