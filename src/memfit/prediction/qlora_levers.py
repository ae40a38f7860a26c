"""Device bytes of the frozen-weight levers of a LoRA/QLoRA run: the input embedding in host memory and the
NF4 expert stacks dequantized a group of experts at a time.

- `--embedding-on-host` (techniques/host_embedding.py): the frozen, untied input embedding leaves the device
  (vocab x hidden x the load dtype's bytes) and is held in host memory instead; its looked-up rows are the
  embedding output the activations already count.
- `--expert-dequant-group G` (techniques/expert_dequant_groups.py): the dequantized copy of a stack during its
  grouped matmul holds G of its experts instead of all, plus the fp32 absmax of the whole stack (4 bytes a
  64-weight block) made once per call.
"""

from __future__ import annotations

from typing import Any

from memfit.config import TrainConfig

NF4_BLOCK = 64


def dequantized_bytes(weights: int, experts: int, compute_bytes: int, group: int) -> int:
    """Bytes live while one NF4 stack of `weights` weights over `experts` experts is dequantized for its matmul."""
    if not 0 < group < experts or (weights // experts) % NF4_BLOCK:  # not whole blocks an expert: dequantized whole
        return weights * compute_bytes
    return (weights // experts) * group * compute_bytes + 4 * (weights // NF4_BLOCK)


def embedding_host_bytes(config: TrainConfig, hf_config: Any, lora_r: int, weight_bytes: int) -> int:
    """Bytes the input embedding moves to host memory under --embedding-on-host (0 where it stays on the device)."""
    from memfit.prediction.encoders import architecture_for

    if not getattr(config.memory, "embedding_on_host", False) or not lora_r:
        return 0
    arch = architecture_for(hf_config)
    if arch.tied_embeddings or not arch.vocab:
        return 0  # tied to the head, which projects with it on the device: the technique leaves it there
    return arch.vocab * arch.hidden * weight_bytes


def with_qlora_levers(parts: dict[str, Any], config: TrainConfig, hf_config: Any, inventory: Any, lora_r: int,
                      quantize: str, weight_bytes: int, compute_bytes: int) -> dict[str, Any]:
    """The state parts with the embedding off the device and the grouped expert dequantization counted.

    `parts["embedding_host_bytes"]`: the input embedding's bytes now in host memory (0 when it stays).
    """
    parts = dict(parts)
    host = embedding_host_bytes(config, hf_config, lora_r, weight_bytes)
    parts["parameters"] -= host
    parts["embedding_host_bytes"] = host
    group = getattr(config.memory, "expert_dequant_group", 0)
    if quantize == "4bit" and lora_r and group:
        stacks = [((a[0] // lora_r) * a[1] * b[0], a[0] // lora_r) for _, a, b in inventory.expert_adapters]
        parts["experts_dequantized_bytes"] = max(
            (dequantized_bytes(size, experts, compute_bytes, group) for size, experts in stacks), default=0)
    return parts
