"""The one tiny Llama the unit tests build from a config (nothing is downloaded).

Tests differ only in the sizes they need, so they pass those and share the rest.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 256,
    intermediate: int | None = None,
    max_positions: int = 512,
    **overrides,
) -> LlamaConfig:
    """Grouped-query attention (4 heads, 2 key-value heads); the MLP is twice the width unless given."""
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        **overrides,
    )


def tiny_llama(seed: int = 0, **sizes) -> LlamaForCausalLM:
    """A model of `tiny_llama_config(**sizes)`, initialised from `seed` so two builds are equal."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**sizes))
