"""The parameters of a mixture of experts as the estimate needs them: expert weights, active count, expert adapters.

Every expert's weights, gradients and optimizer state are held (a token runs through top-k of them, training
touches all), so the state bytes count them all; the active count (what one token runs) is what the FLOPs and
the MFU use. With LoRA, memfit's default targets (`--lora-targets auto`) give every fused expert weight an
adapter through PEFT's `target_parameters` (techniques/expert_lora.py): per expert a rank-r pair, that is
lora_A (experts x r, in) and lora_B (out, experts x r) per fused weight.
"""

from __future__ import annotations

from typing import Any

from memfit.models.experts import fused_expert_modules, total_and_active_parameters


def expert_inventory(model: Any, lora_r: int) -> tuple[int, int, list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """(fused expert weights, active parameters, the expert adapters at rank `lora_r`) of a (meta) model.

    Each adapter is (the fused weight's name, e.g. gate_up_proj; lora_A's shape; lora_B's shape).
    """
    from torch import nn

    expert_params, adapters = 0, []
    for _, module in fused_expert_modules(model):
        for name, weight in module.named_parameters(recurse=False):
            if not isinstance(weight, nn.Parameter) or weight.dim() != 3:
                continue  # gpt-oss's expert biases stay as they are (not adapted, never quantized)
            experts, first, second = weight.shape
            expert_params += weight.numel()
            if lora_r:
                adapters.append((name, (experts * lora_r, second), (first, experts * lora_r)))
    _, active = total_and_active_parameters(model)
    return expert_params, active, adapters
