"""The mixture-of-experts terms of an estimate: total and active parameters, expert adapters, routed activations,
router logits and the load-balancing loss.

Weights, gradients and optimizer state: every expert is stored and, when it trains, gets a gradient and optimizer
state, so the state bytes count the whole fused stack (`ParameterInventory.expert_params`); only the FLOPs per
token follow the active count. Activations of an MoE block are measured from the model's code by the layer probe
(its grouped path on fake tensors); the closed forms here say what that path holds, per token of the micro-batch:

- the permutation: each token's hidden state copied once per routed expert (tokens x top-k rows, sorted by
  expert) and the sort's indices;
- per routed row: the gate and up projection (2 x expert width), the activation and its product with up
  (2 x expert width), the down projection's output (hidden), each in the compute dtype;
- router logits (experts per token) and the routing weights and indices (top-k per token).

The load-balancing loss (`output_router_logits`) keeps every MoE layer's router logits until the loss and the
fp32 softmax it takes of them: (compute bytes + 4) x experts x MoE layers per token, outside the blocks.

QLoRA (`--quantize 4bit`) holds every fused expert stack in NF4 (techniques/expert_quant.py): `nf4_stack_bytes`
per stack, to the byte of what bitsandbytes allocates, in place of its 16-bit bytes; each grouped matmul
dequantizes one stack to the compute dtype for its call and drops it, in forward and again in backward, so one
stack (the largest: a layer's gate_up_proj) is live beside the resident bytes.
"""

from __future__ import annotations

import math
from typing import Any

from memfit.models.experts import EXPERT_PARAMETERS, MoeShape, moe_shape
from memfit.models.state_bytes import ParameterInventory


def expert_adapter_shapes(inventory: ParameterInventory, lora_targets: str) -> list[tuple[int, ...]]:
    """Shapes of the LoRA pairs `--lora-targets` puts on the fused experts (auto and `experts`: all of them)."""
    names = [name.strip() for name in lora_targets.split(",") if name.strip()]
    shapes: list[tuple[int, ...]] = []
    for weight, lora_a, lora_b in inventory.expert_adapters:
        if "auto" in names or "experts" in names or (weight in names and weight in EXPERT_PARAMETERS):
            shapes += [lora_a, lora_b]
    return shapes


def routed_bytes_per_token(shape: MoeShape, hidden: int, compute_bytes: int) -> float:
    """What one MoE layer's grouped path keeps for backward per token (closed form; the probe measures it)."""
    rows = shape.top_k
    permutation = compute_bytes * hidden * rows + 8 * rows  # sorted copies of the input and the sort's int64 indices
    per_row = compute_bytes * (4 * shape.expert_width + hidden) if shape.gated else compute_bytes * (
        2 * shape.expert_width + hidden)
    router = compute_bytes * shape.experts + (4 + 8) * shape.top_k  # logits, routing weights and indices
    shared = 4 * compute_bytes * shape.shared_width
    return permutation + rows * per_row + router + shared


def balancing_loss_bytes(hf_config: Any, tokens: int, compute_bytes: int) -> int:
    """Bytes the load-balancing loss keeps (router logits of every MoE layer and their fp32 softmax); 0 when off."""
    shape = moe_shape(hf_config)
    if shape is None or not getattr(hf_config, "output_router_logits", False):
        return 0
    return int((compute_bytes + 4) * shape.experts * shape.moe_layers * tokens)


def moe_details(hf_config: Any, inventory: ParameterInventory, tokens: int, compute_bytes: int) -> dict[str, Any]:
    """What the estimate reports of a mixture of experts (empty for a dense model)."""
    shape = moe_shape(hf_config)
    if shape is None:
        return {}
    return {
        "experts": shape.experts,
        "experts_per_token": shape.top_k,
        "moe_layers": shape.moe_layers,
        "expert_parameter_count": inventory.expert_params,
        "routed_activation_bytes": int(routed_bytes_per_token(shape, hf_config.hidden_size, compute_bytes)
                                       * tokens * shape.moe_layers),
        "balancing_loss_bytes": balancing_loss_bytes(hf_config, tokens, compute_bytes),
    }


NF4_BLOCK = 64
"""Weights per absmax block (bitsandbytes' QLoRA blocksize); 256 absmax blocks share one fp32 scale."""
NF4_FIXED_BYTES = 64 + 4 + 1024
"""Per stack: the 16-entry NF4 code, the absmax offset and the 256-entry map of the double quantization (fp32)."""


def nf4_stack_bytes(numel: int) -> int:
    """Bytes bitsandbytes allocates for one tensor of `numel` weights in NF4 with double quantization."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / 256) + NF4_FIXED_BYTES


def expert_stack_sizes(inventory: ParameterInventory, lora_r: int) -> list[int]:
    """Weights of each fused expert stack, read from the adapter shapes the inventory lists per stack at rank r."""
    if not lora_r:
        return []
    # lora_A is (experts x r, second), lora_B (first, experts x r): the stack is experts x first x second
    return [(lora_a[0] // lora_r) * lora_a[1] * lora_b[0] for _, lora_a, lora_b in inventory.expert_adapters]


def with_nf4_experts(parts: dict[str, Any], quantize: str, inventory: ParameterInventory, lora_r: int,
                     weight_bytes: int, compute_bytes: int) -> dict[str, Any]:
    """The state parts with QLoRA's NF4 expert stacks in place of 16-bit ones, and the one dequantized stack.

    `parts["experts_nf4_bytes"]`: the stacks' NF4 bytes; `parts["experts_dequantized_bytes"]`: the largest stack in
    the compute dtype, live during its grouped matmul (0 without 4-bit quantization or experts).
    """
    sizes = expert_stack_sizes(inventory, lora_r) if quantize == "4bit" else []
    nf4 = sum(nf4_stack_bytes(size) for size in sizes)
    parts = dict(parts)
    parts["parameters"] -= sum(sizes) * weight_bytes - nf4
    parts["experts_nf4_bytes"] = nf4
    parts["experts_dequantized_bytes"] = max(sizes, default=0) * compute_bytes
    return parts
