"""Exact bytes of weights, gradients and optimizer state, from the parameter shapes.

Shapes come from a meta-device build of the model (cached per config), so the counts
are those of the real module tree: tied weights once, fused projections as they are.
The one model of optimizer-state bytes: the estimator (memfit.memory) and the automatic
checkpointing choice (memfit.techniques) both use it, so it sits below both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from memfit.errors import UsageError
from memfit.models.config_key import config_key
from memfit.models.optimizer_state import (
    SMALL_STATE_OPTIMIZERS,
    LowRankSettings,
    NamedTensor,
    named_trainable,
    projection_settings,
    state_bytes,
    step_temporary_bytes,
)

NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
"""4-bit nf4: half a byte, one 8-bit absmax per 64 weights, one fp32 absmax per 256 blocks (double quantization)."""
BNB_8BIT_MIN_SIZE = 4096
"""bitsandbytes keeps 32-bit state for tensors with fewer elements than this."""
BNB_8BIT_BLOCK = 256


@dataclass
class ParameterInventory:
    """Parameter tensors of the model as training sees them."""

    shapes: list[tuple[int, ...]]
    """Every parameter tensor (tied weights once)."""
    linear_params: int
    """Weights of the linear layers LoRA targets / QLoRA quantizes (not the output head)."""
    adapter_shapes: list[tuple[int, ...]]
    """LoRA A and B matrices."""
    named: list[NamedTensor] = field(default_factory=list)
    """Every parameter tensor with its name and kind (what the small-state optimizers' state depends on)."""
    head_block: int = 1
    """Values of one attention head's query weights as Adam-mini splits them (hidden^2 / heads)."""
    expert_params: int = 0
    """Weights of the fused 3-D experts (every expert counts: all are stored, trained and stepped)."""
    active: int = 0
    """Parameters one token runs through (routed experts top-k of n); the total for a dense model."""
    expert_adapters: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    """LoRA pairs on the fused experts (PEFT's target_parameters, rank r per expert): (weight name, A, B) each."""

    @cached_property  # once per inventory: the planner reads it in each of its thousands of estimates
    def total(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


_INVENTORIES: dict[tuple[str, int], ParameterInventory] = {}


def parameter_inventory(hf_config: Any, lora_r: int = 0) -> ParameterInventory:
    """Shapes from a meta-device build (no memory, under a second for 70B); cached per config."""
    key = (config_key(hf_config), lora_r)  # kept per config state: the planner asks thousands of times
    if key not in _INVENTORIES:
        _INVENTORIES[key] = _build_inventory(hf_config, lora_r)
    return _INVENTORIES[key]


def _build_inventory(hf_config: Any, lora_r: int) -> ParameterInventory:
    from torch import nn

    from memfit.models.presets import build_meta_model

    model = build_meta_model(hf_config)
    head = model.get_output_embeddings()
    shapes = [tuple(p.shape) for p in model.parameters()]
    linear_params, adapters = 0, []
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, nn.Linear):
            fan_in, fan_out = module.in_features, module.out_features
        elif type(module).__name__ == "Conv1D":  # GPT-2's transposed linear
            fan_in, fan_out = module.weight.shape
        else:
            continue
        linear_params += fan_in * fan_out
        if lora_r:
            adapters += [(lora_r, fan_in), (fan_out, lora_r)]
    heads = getattr(hf_config, "num_attention_heads", None) or 1
    hidden = getattr(hf_config, "hidden_size", None) or 1
    from memfit.models.expert_bytes import expert_inventory

    expert_params, active, expert_adapters = expert_inventory(model, lora_r)
    return ParameterInventory(shapes, linear_params, adapters, named_trainable(model), max(1, hidden * hidden // heads),
                              expert_params, active, expert_adapters)


def small_state_optimizer_bytes(optimizer_config: Any, inventory: ParameterInventory, param_bytes: int,
                                in_backward: bool, lora: bool = False) -> int:
    """State bytes of one of SMALL_STATE_OPTIMIZERS over the whole model, or over the LoRA adapters."""
    name = optimizer_config.optimizer
    settings = projection_settings(optimizer_config)
    tensors = inventory.named if not lora else [
        NamedTensor(f"adapter.{i}", shape, "other") for i, shape in enumerate(inventory.adapter_shapes)]
    return state_bytes(name, tensors, param_bytes, settings, inventory.head_block, in_backward)


def optimizer_state_bytes_for_shapes(optimizer: str, shapes: list[tuple[int, ...]], param_bytes: int,
                                     momentum: float = 0.0, fused_step: bool = True) -> int:
    """Bytes of optimizer state for trainable tensors of `shapes` stored in `param_bytes` per element."""
    step = 4 if fused_step else 0  # one fp32 step counter per tensor, on the device for fused AdamW
    if optimizer == "adamw":
        return sum(2 * param_bytes * math.prod(s) + step for s in shapes)
    if optimizer in ("adamw-8bit", "paged-adamw-8bit"):
        total = 2 * BNB_8BIT_BLOCK * 4  # the two quantization maps, shared by all tensors
        for s in shapes:
            n = math.prod(s)
            if n >= BNB_8BIT_MIN_SIZE:
                total += 2 * n + 2 * 4 * math.ceil(n / BNB_8BIT_BLOCK)
            else:
                total += 8 * n
        return total
    if optimizer == "sgd":
        return sum(param_bytes * math.prod(s) for s in shapes) if momentum else 0
    if optimizer == "adafactor":
        total = 0
        for s in shapes:
            factored = len(s) >= 2
            total += param_bytes * ((math.prod(s[:-1]) + s[-1]) if factored else math.prod(s)) + 4
        return total
    if optimizer in SMALL_STATE_OPTIMIZERS:
        # From shapes alone nothing is known to be projected: full moments, an upper bound for GaLore and APOLLO
        # (small_state_optimizer_bytes knows the names).
        tensors = [NamedTensor(f"tensor.{i}", tuple(s), "other") for i, s in enumerate(shapes)]
        settings = LowRankSettings(rank=1, update_proj_gap=1, scale=1.0, target_modules="all-linear")
        return state_bytes(optimizer, tensors, param_bytes, settings)
    raise UsageError(f"unknown optimizer {optimizer!r}")


def optimizer_step_temporary_bytes(run: Any, shapes: list[tuple[int, ...]], param_bytes: int) -> int:
    """Bytes the optimizer step allocates on top of its state (measured on torch 2.13).

    Fused AdamW updates in place. The foreach implementation builds sqrt(v) for a whole
    parameter group at once: one state-sized copy of the larger group (the matrices).
    The for-loop one works a tensor at a time, with sqrt(v) and its scaled copy alive
    together: 2.5 x the largest tensor measured. Adafactor's update of the largest
    tensor: 1.5 x. bitsandbytes 8-bit AdamW updates in place.
    """
    if run.optimizer_offload:
        return 0
    sizes = [math.prod(s) for s in shapes] or [0]
    if run.optimizer in SMALL_STATE_OPTIMIZERS:
        return step_temporary_bytes(run.optimizer, max(sizes), param_bytes)
    if run.optimizer == "adamw":
        if run.optimizer_impl in ("auto", "fused"):
            return 0
        if run.optimizer_impl == "foreach":
            matrices = sum(math.prod(s) for s in shapes if len(s) >= 2)
            return param_bytes * max(matrices, sum(sizes) - matrices)
        return int(2.5 * param_bytes * max(sizes))
    if run.optimizer == "adafactor":
        return int(1.5 * param_bytes * max(sizes))
    return 0


def in_backward_step_temporary_bytes(optimizer: str, numel: int, param_bytes: int) -> int:
    """Bytes one parameter's step allocates under --optimizer-in-backward (measured with the tracker, torch 2.13).

    Each parameter has its own for-loop optimizer (memfit.train.setup builds them so): AdamW
    holds sqrt(v) and its bias-corrected copy together, two copies of the tensor; the for-loop
    closed form's 2.5 x comes from the previous tensor's denominator outliving its loop
    iteration, which a one-tensor optimizer never has. Adafactor's update: 1.5 x. bitsandbytes
    8-bit AdamW and SGD update in place.
    """
    if optimizer == "adamw":
        return 2 * param_bytes * numel
    if optimizer == "adafactor":
        return int(1.5 * param_bytes * numel)
    if optimizer in SMALL_STATE_OPTIMIZERS:
        return step_temporary_bytes(optimizer, numel, param_bytes)
    return 0
