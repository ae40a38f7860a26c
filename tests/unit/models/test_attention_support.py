"""The attention kernel a family runs (models.attention_support), as the loader asks it and the estimate counts it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from memfit.models.attention_support import kernel_for_family
from memfit.prediction.layer_probe import PROBE_SEQ_LENS, _parabola_through, supported_attention
from model_zoo import ZOO


def test_a_family_without_sdpa_runs_flex_attention_on_cuda_and_eager_on_a_cpu():
    gpt_oss = ZOO["gpt_oss"]()
    runs, why = kernel_for_family(gpt_oss, "sdpa", "cuda")
    assert runs == "flex_attention" and "FlexAttention runs instead" in why
    runs, why = kernel_for_family(gpt_oss, "sdpa", "cpu")
    assert runs == "eager" and "needs CUDA" in why
    assert supported_attention(gpt_oss, "sdpa", "cuda") == "flex"
    assert supported_attention(gpt_oss, "sdpa") == "eager"


def test_families_with_the_asked_kernel_keep_it_and_mamba_runs_eager_everywhere():
    assert kernel_for_family(ZOO["llama"](), "sdpa", "cuda") == ("sdpa", "")
    assert kernel_for_family(ZOO["qwen3_moe"](), "sdpa", "cpu") == ("sdpa", "")
    runs, why = kernel_for_family(ZOO["mamba2"](), "sdpa", "cuda")
    assert runs == "eager" and "needs CUDA" not in why


def test_a_config_transformers_does_not_map_keeps_the_asked_kernel():
    assert kernel_for_family(SimpleNamespace(model_type="unknown"), "sdpa", "cuda") == ("sdpa", "")


def test_the_probe_fit_without_its_quadratic_term_drops_only_the_scores():
    # bytes of a block at s tokens: 1000 constant, 300 a token, 2 per score (s x s)
    def block(s):
        return 1000 + 300 * s + 2 * s * s

    ys = [block(s) for s in PROBE_SEQ_LENS]
    assert _parabola_through(PROBE_SEQ_LENS, ys, 100_000) == pytest.approx(block(100_000))
    assert _parabola_through(PROBE_SEQ_LENS, ys, 100_000, quadratic_term=False) == pytest.approx(
        1000 + 300 * 100_000)


def test_a_preset_of_a_family_without_sdpa_loads_with_the_kernel_it_runs(caplog):
    import torch

    from memfit.models.loader import _family_kernel
    from memfit.techniques.attention import choose_attention

    choice = choose_attention("auto", torch.device("cpu"), torch.float32)
    with caplog.at_level(logging.WARNING, logger="memfit"):
        assert _family_kernel(ZOO["gpt_oss"](), choice, torch.device("cpu")) == "eager"
    assert "gpt_oss has no sdpa attention" in caplog.text
    assert _family_kernel(ZOO["llama"](), choice, torch.device("cpu")) == "sdpa"


def test_flex_keeps_key_and_value_narrow_where_eager_saves_them_repeated_to_every_head():
    """The probe runs eager attention for gpt-oss; FlexAttention (CUDA) saves K and V as the model makes them.

    Eager saves the query and K and V repeated to the 4 query heads (each [heads, s, head_dim] after matmul folds
    the batch); flex with enable_gqa saves query, key and value with K and V on their 2 heads. The estimate takes
    off the difference, computed from the config: here it is checked against the tensors eager really saves.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from memfit.prediction.layer_probe import flex_narrow_key_value_saving

    config = ZOO["gpt_oss"]()
    config.num_hidden_layers, config.layer_types = 1, config.layer_types[:1]
    heads, kv_heads, head_dim, tokens = config.num_attention_heads, config.num_key_value_heads, config.head_dim, 64
    assert kv_heads < heads
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    saved = []
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(input_ids=ids, labels=ids)
    per_head = [t for t in saved if t.numel() == heads * tokens * head_dim and heads in t.shape]
    assert len(per_head) == 3  # the query, K and V repeated to every head
    repeated = sum(t.numel() * t.element_size() for t in per_head) * 2 // 3  # all but the query
    narrow = 2 * kv_heads * tokens * head_dim * 4
    assert flex_narrow_key_value_saving(config, 4) * tokens == repeated - narrow
    config.num_attention_heads = 6  # not a power of two: transformers repeats K and V before flex as well
    assert flex_narrow_key_value_saving(config, 4) == 0
