"""Attention kernel choice: flash-attn, PyTorch SDPA or eager, and a report of what ran.

Eager attention stores the [batch, heads, seq, seq] probabilities for backward; SDPA's
flash and memory-efficient kernels and flash-attn do not, which is what makes long
sequences fit.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

# memfit name -> transformers' attn_implementation
HF_NAMES = {"flash": "flash_attention_2", "flex": "flex_attention", "sdpa": "sdpa", "eager": "eager"}


@dataclass(frozen=True)
class AttentionChoice:
    requested: str
    """What the user asked for (auto, flash, sdpa, eager)."""
    implementation: str
    """memfit name of the kernel asked of transformers: flash, flex, sdpa or eager."""
    reason: str
    """Why, when it differs from the request."""

    @property
    def hf_name(self) -> str:
        return HF_NAMES[self.implementation]

    @property
    def fell_back(self) -> bool:
        """Something other than what was explicitly requested runs."""
        return self.requested not in ("auto", self.implementation)


def flash_attn_usable(device: torch.device, compute_dtype: torch.dtype | None) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "flash-attn needs a CUDA GPU"
    if importlib.util.find_spec("flash_attn") is None:
        return False, "flash-attn is not installed"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return False, "flash-attn needs compute capability 8.0+"
    if compute_dtype not in (torch.bfloat16, torch.float16):
        return False, "flash-attn needs bf16 or fp16 compute"
    return True, ""


def choose_attention(requested: str, device: torch.device, compute_dtype: torch.dtype | None) -> AttentionChoice:
    """Pick the kernel to ask for; the loader falls back to eager if a model lacks SDPA."""
    flash_ok, why_not = flash_attn_usable(device, compute_dtype)
    if requested == "auto":
        if flash_ok:
            return AttentionChoice(requested, "flash", "auto: flash-attn available")
        return AttentionChoice(requested, "sdpa", f"auto: PyTorch SDPA ({why_not})")
    if requested == "flash" and not flash_ok:
        # Visible fallback: SDPA also avoids the [batch, heads, seq, seq] probabilities.
        return AttentionChoice(requested, "sdpa", f"flash requested, PyTorch SDPA ran instead: {why_not}")
    if requested == "flex" and device.type != "cuda":
        return AttentionChoice(requested, "sdpa", "flex requested, PyTorch SDPA ran instead: PyTorch's FlexAttention"
                                                   " has no backward on the CPU")
    return AttentionChoice(requested, requested, f"requested {requested}")


def attention_that_ran(model: torch.nn.Module) -> str:
    """The kernel transformers really set up, in memfit's names."""
    config = getattr(model, "config", None)
    hf_name = getattr(config, "_attn_implementation", None) or "eager"
    reverse = {v: k for k, v in HF_NAMES.items()}
    return reverse.get(hf_name, hf_name)


def _resolve(facts, run) -> dict:
    """The kernel the estimate counts: flash-attn and FlexAttention keep SDPA's flash kernel's tensors."""
    from memfit.models.attention_support import kernel_for_family

    attention = facts.config.model.attention
    if attention in ("auto", "flex"):
        attention = "sdpa"
    if facts.hf_config is not None and attention in _FAMILY_NAMES:
        # the kernel the family runs there: eager without an SDPA path (Mamba-2; gpt-oss on a CPU), FlexAttention
        # for gpt-oss's attention sinks on CUDA
        runs, _ = kernel_for_family(facts.hf_config, _FAMILY_NAMES[attention], facts.device_type)
        if runs != _FAMILY_NAMES[attention]:
            attention = {"flex_attention": "flex"}.get(runs, runs)
    if attention == "sdpa" and facts.device_type == "cuda" and run.autocast is None and run.weight_bytes == 4 and (
            _grouped_query(facts.hf_config)):
        # fp32 SDPA with grouped-query attention on CUDA: the flash kernel takes no fp32 and the memory-efficient
        # one no GQA, so PyTorch runs its math kernel, which keeps [heads, s, s] probabilities as eager attention
        # does (an H100 measured 1,330 MiB against 66 MiB in bf16: docs/gpu-truth.md)
        attention = "eager"
    return {"attention": attention}


_FAMILY_NAMES = {"sdpa": "sdpa", "flash": "flash_attention_2", "flash_attention_2": "flash_attention_2",
                 "flex": "flex_attention", "flex_attention": "flex_attention"}


def _grouped_query(hf_config) -> bool:
    heads = getattr(hf_config, "num_attention_heads", None) or 0
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return 0 < kv_heads < heads


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="attention", stage="choice", settings=("attention",), after=("precision",), resolve=_resolve,
        report=lambda run: {"attention": run.attention},
        summary="SDPA, flash-attn or FlexAttention: no [batch, heads, seq, seq] probabilities kept",
    )


TECHNIQUE = _technique()


def run_attention(config, device: torch.device, compute_dtype: torch.dtype | None) -> AttentionChoice:
    """The kernel a run asks the loader for, for its --attention (the model may still run another)."""
    return choose_attention(config.model.attention, device, compute_dtype)
