"""Which attention kernel a model family runs: transformers' per-class flags, and FlexAttention where a family has
no SDPA path (gpt-oss: attention sinks) on CUDA.

Eager attention keeps each block's [batch, heads, seq, seq] scores for backward, which caps gpt-oss-20b's context at
about 15K tokens in 80 GiB; transformers' FlexAttention path applies the sinks through the kernel's log-sum-exp and
keeps no scores, but transformers runs it with sinks on CUDA only. The loader and the estimate both ask here, so a
plan assumes the kernel that `memfit train` will run.
"""

from __future__ import annotations

import importlib.util
from typing import Any

_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}


def causal_lm_class(hf_config: Any) -> type | None:
    """The transformers class that `AutoModelForCausalLM` builds for `hf_config`, or None when it maps none."""
    try:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM._model_mapping[type(hf_config)]
    except (ImportError, KeyError):
        return None


def _flex_attention_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def kernel_for_family(hf_config: Any, hf_name: str, device_type: str) -> tuple[str, str]:
    """(the attn_implementation the family runs when `hf_name` is asked on `device_type`, why it differs or '').

    A family without the asked kernel runs FlexAttention on CUDA when transformers gives it one, eager otherwise.
    """
    model_class = causal_lm_class(hf_config)
    flag = _FLAGS.get(hf_name)
    if model_class is None or flag is None or getattr(model_class, flag, True):
        return hf_name, ""
    family = getattr(hf_config, "model_type", model_class.__name__)
    has_flex = bool(getattr(model_class, "_supports_flex_attn", False))
    if has_flex and device_type == "cuda" and _flex_attention_available():
        return "flex_attention", (f"{family} has no {hf_name} attention in transformers; FlexAttention runs instead"
                                  " (no [heads, seq, seq] scores kept)")
    why = "; its FlexAttention path needs CUDA" if has_flex else ""
    return "eager", (f"{family} has no {hf_name} attention in transformers{why}: eager attention runs, which keeps"
                     " [heads, seq, seq] scores for backward")
