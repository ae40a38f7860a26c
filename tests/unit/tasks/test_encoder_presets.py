"""DNA and protein encoder presets: built offline on the meta device at their published size, with every task head."""

from __future__ import annotations

import pytest
import torch

from memfit.models.presets import MODEL_PRESETS, build_meta_model, find_preset, parameter_count, resolve_model_config
from memfit.models.presets_encoders import ENCODER_PRESETS

SMALL = [name for name, preset in ENCODER_PRESETS.items() if preset.published_parameters < 400_000_000]


def test_encoder_presets_are_registered_and_resolve_by_name_and_hub_id():
    for name, preset in ENCODER_PRESETS.items():
        assert MODEL_PRESETS[name] is preset
        assert find_preset(preset.hf_id) is preset  # the Hugging Face id, offline
        assert resolve_model_config(name).model_type == preset.model_type


@pytest.mark.parametrize("name", sorted(ENCODER_PRESETS))
def test_meta_build_has_the_published_size(name):
    preset = ENCODER_PRESETS[name]
    model = build_meta_model(preset.to_hf_config())
    assert type(model).__name__.endswith("ForMaskedLM")
    assert next(model.parameters()).device.type == "meta"
    count = sum(p.numel() for p in model.parameters())
    assert count == parameter_count(preset.to_hf_config())
    assert abs(count / preset.published_parameters - 1) < 0.08, (count, preset.published_parameters)


@pytest.mark.parametrize("name", ["nt-v2-50m", "dnabert-2-117m"])
def test_a_gated_mlp_is_built_with_the_published_weights(name):
    """3 x hidden x intermediate weights a layer, as the published gated MLP holds (biases aside)."""
    preset = ENCODER_PRESETS[name]
    model = build_meta_model(preset.to_hf_config())
    layer = next(module for module in model.modules() if type(module).__name__.endswith("Layer"))
    mlp = sum(m.weight.numel() for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)
              and ("intermediate" in n or n.startswith("output")))
    assert mlp == 3 * preset.hidden_size * preset.intermediate_size
    assert preset.differs


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("head", ["AutoModelForSequenceClassification", "AutoModelForTokenClassification"])
def test_every_task_head_builds(name, head):
    import transformers

    config = ENCODER_PRESETS[name].to_hf_config()
    config.num_labels = 3
    with torch.device("meta"):
        model = getattr(transformers, head).from_config(config)
    assert model.config.num_labels == 3


def test_presets_table_lists_the_encoders():
    from memfit.cli.presets import models_table

    table = models_table()
    for name in ("esm2-8m", "nt-v2-500m", "dnabert-2-117m", "modernbert-base"):
        assert name in table
