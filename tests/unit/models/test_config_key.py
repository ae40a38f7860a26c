"""The key of the shape and probe caches: one per config state, blind to use_cache only."""

from __future__ import annotations

import json

from transformers import LlamaConfig

from memfit.models.config_key import config_key


def _config(**changes) -> LlamaConfig:
    shape = dict(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    return LlamaConfig(**{**shape, **changes})


def test_the_key_is_the_configs_json_without_use_cache():
    config = _config()
    expected = json.loads(config.to_json_string(use_diff=False))
    expected.pop("use_cache")
    assert json.loads(config_key(config)) == expected


def test_a_loaded_config_with_the_cache_off_shares_the_key():
    config = _config()
    before = config_key(config)
    config.use_cache = False  # what memfit train's loader does to the loaded model's config
    assert config_key(config) == before


def test_every_change_that_builds_other_modules_changes_the_key():
    config = _config()
    first = config_key(config)
    config.num_hidden_layers = 3
    assert config_key(config) != first
    assert json.loads(config_key(config))["num_hidden_layers"] == 3
    # a change made in place inside a nested dict shows too (the remembered JSON is per state, not per object)
    scaled = _config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    two = config_key(scaled)
    scaled.rope_parameters["factor"] = 4.0
    four = config_key(scaled)
    assert four != two and json.loads(four)["rope_parameters"]["factor"] == 4.0


def test_equal_configs_built_apart_share_the_key():
    assert config_key(_config()) == config_key(_config())
    assert config_key(_config()) != config_key(_config(hidden_size=64, intermediate_size=128))
