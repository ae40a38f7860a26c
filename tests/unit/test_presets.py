"""Model and GPU presets: published architecture numbers, meta builds, name resolution."""

from __future__ import annotations

import json

import pytest

from memfit.errors import UsageError
from memfit.gpus import GPUS, get_gpu, list_gpus
from memfit.models.presets import (
    MODEL_PRESETS,
    build_meta_model,
    find_preset,
    parameter_count,
    preset_config,
    resolve_model_config,
)
from memfit.units import GIB

# Parameter counts of the published checkpoints.
PUBLISHED = {
    "gpt2": 124_439_808,
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
    "gemma-2b": 2_506_172_416,
}


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_meta_model_parameter_count_equals_the_closed_form(name):
    config = preset_config(name)
    model = build_meta_model(config)
    assert next(model.parameters()).device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == parameter_count(config)


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_closed_form_matches_published_counts(name, count):
    assert parameter_count(preset_config(name)) == count


def test_70b_meta_build_allocates_no_weights():
    # A 70B model built for estimating holds shapes only: on a real device it would need 138 GB (a timed assert
    # stood here; on a loaded machine it failed at 1.05 s and said nothing about memory)
    model = build_meta_model(preset_config("llama-2-70b"))
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert sum(p.numel() for p in model.parameters()) > 68e9


def test_names_resolve_offline(tmp_path):
    from transformers import LlamaConfig

    assert resolve_model_config("tiny").model_type == "llama"
    assert resolve_model_config("Llama-3.1-8B").num_hidden_layers == 32
    assert resolve_model_config("meta-llama/Llama-3.1-8B").num_key_value_heads == 8  # the id of a preset: no network
    assert find_preset("gpt2-small").name == "gpt2"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4).save_pretrained(tmp_path)
    assert resolve_model_config(str(tmp_path)).num_hidden_layers == 3
    assert resolve_model_config(str(tmp_path / "config.json")).num_hidden_layers == 3


def test_bad_names_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="did you mean llama-3.1-8b"):
        resolve_model_config("llama-3.1-8")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(UsageError, match="model_type"):
        resolve_model_config(str(tmp_path))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UsageError, match="Hugging Face Hub"):
        resolve_model_config("no-such-org-memfit/no-such-model")


def test_gpu_spellings_and_unknown_gpu():
    assert get_gpu("rtx-4090") is get_gpu("4090") is get_gpu("RTX 4090") is get_gpu("NVIDIA GeForce RTX 4090")
    assert get_gpu("a100-80gb") is get_gpu("A100 80GB") is get_gpu("a100_80gb")
    assert get_gpu("h100").name == "h100-80gb"
    assert not get_gpu("t4").bf16 and get_gpu("l4").bf16
    assert 23 * GIB < get_gpu("3090").memory_bytes < 24 * GIB
    with pytest.raises(UsageError, match="did you mean rtx-4090"):
        get_gpu("rtx-4091")
    assert len(list_gpus()) == len(GPUS) >= 9


def test_moe_and_recent_presets_match_published_parameter_counts():
    """Every MoE and recent dense preset builds to its model card's total (and, for MoE, active) parameters."""
    from memfit.models.experts import total_and_active_parameters
    from memfit.models.presets_moe import MOE_AND_RECENT_PRESETS, PUBLISHED_PARAMETERS

    assert set(PUBLISHED_PARAMETERS) == set(MOE_AND_RECENT_PRESETS)
    for name, (total, active) in PUBLISHED_PARAMETERS.items():
        config = preset_config(name)
        model = build_meta_model(config)
        counted_total, counted_active = total_and_active_parameters(model)
        assert counted_total / 1e9 == pytest.approx(total, rel=0.015), name
        if active is None:
            assert counted_active == counted_total, name  # a dense model runs every parameter
            continue
        if config.model_type == "gpt_oss":
            counted_active -= config.vocab_size * config.hidden_size  # OpenAI's active count leaves out the embedding
        assert counted_active / 1e9 == pytest.approx(active, rel=0.03), name
        assert counted_active < counted_total / 3, name


def test_moe_presets_resolve_by_name_and_hub_id():
    assert resolve_model_config("gpt-oss-20b").num_local_experts == 32
    assert resolve_model_config("openai/gpt-oss-120b").num_local_experts == 128
    assert resolve_model_config("Qwen/Qwen3-30B-A3B").moe_intermediate_size == 768
    assert resolve_model_config("Mixtral-8x7B").num_experts_per_tok == 2
