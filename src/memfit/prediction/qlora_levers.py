"""Device bytes of the frozen-weight levers of a LoRA/QLoRA run: the input embedding in host memory, the
NF4 expert stacks dequantized a group of experts at a time, and the output head in NF4.

- `--embedding-on-host` (techniques/host_embedding.py): the frozen, untied input embedding leaves the device
  (vocab x hidden x the load dtype's bytes) and is held in host memory instead; its looked-up rows are the
  embedding output the activations already count.
- `--expert-dequant-group G` (techniques/expert_dequant_groups.py): the dequantized copy of a stack during its
  grouped matmul holds G of its experts instead of all, plus the fp32 absmax of the whole stack (4 bytes a
  64-weight block) made once per call.
- `--quantize-head` (techniques/nf4_head.py): the frozen untied head in NF4 (about 0.52 byte a weight) instead of
  the load dtype; while the loss projects, one tile of its rows is dequantized beside the head's fp32 absmax.
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


def nf4_head_saving(config: TrainConfig, hf_config: Any, lora_r: int, quantize: str, weight_bytes: int,
                    compute_bytes: int) -> tuple[int, int] | None:
    """Under --quantize-head: (device bytes the NF4 head saves, bytes of one dequantized tile and the absmax)."""
    from memfit.prediction.encoders import architecture_for
    from memfit.prediction.experts import nf4_stack_bytes
    from memfit.techniques.nf4_head import tile_rows

    if not getattr(config.lora, "quantize_head", False) or quantize != "4bit" or not lora_r:
        return None
    arch = architecture_for(hf_config)
    if arch.tied_embeddings or not arch.vocab or arch.hidden % 2:
        return None  # the technique leaves a tied head (or an odd width) as it is
    weights = arch.vocab * arch.hidden
    tile = min(arch.vocab, tile_rows(arch.hidden)) * arch.hidden * compute_bytes
    return weights * weight_bytes - nf4_stack_bytes(weights), tile + 4 * (weights // NF4_BLOCK)


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
    if quantize == "4bit" and lora_r and group:  # a group of experts in place of the whole stack
        stacks = [((a[0] // lora_r) * a[1] * b[0], a[0] // lora_r) for _, a, b in inventory.expert_adapters]
        parts["experts_dequantized_bytes"] = max(
            (dequantized_bytes(size, experts, compute_bytes, group) for size, experts in stacks), default=0)
    head = nf4_head_saving(config, hf_config, lora_r, quantize, weight_bytes, compute_bytes)
    if head:
        parts["parameters"] -= head[0]
        # one tile of the head dequantized (and the head's fp32 absmax) while the loss projects a chunk: the larger
        # of that and the experts' dequantized copy is the working set (they are never live together)
        parts["experts_dequantized_bytes"] = max(parts.get("experts_dequantized_bytes", 0), head[1])
    return parts


def lever_changes(mode: str, config: TrainConfig, hf_config: Any, user_set: Any) -> dict[str, Any]:
    """The frozen-weight levers a LoRA/QLoRA plan may turn on for this model (empty where none applies or the user chose).

    The embedding goes to host memory and a QLoRA head to NF4 where they are untied; a QLoRA mixture of experts dequantizes an eighth of each
    stack's experts at a time (at least one). `user_set(config, name)`: whether the user chose `name`.
    """
    from memfit.prediction.encoders import architecture_for

    if mode == "full" or hf_config is None:
        return {}
    changes: dict[str, Any] = {}
    arch = architecture_for(hf_config)
    if not arch.tied_embeddings and arch.vocab and not user_set(config, "embedding_on_host"):
        changes["embedding_on_host"] = True
    if mode == "qlora" and not arch.tied_embeddings and arch.vocab and not user_set(config, "quantize_head"):
        changes["quantize_head"] = True
    experts = _experts_of(hf_config)
    if mode == "qlora" and experts > 1 and not user_set(config, "expert_dequant_group"):
        changes["expert_dequant_group"] = max(1, experts // 8)
    return changes


def _experts_of(hf_config: Any) -> int:
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    return 0


def lever_trades(changes: dict[str, Any], est: Any, hf_config: Any, seconds: dict[str, float] | None = None) -> list[str]:
    """What the frozen-weight levers of a plan cost, in words (memfit.prediction.trade_offs lists them).

    `seconds`: what each adds to the predicted step (prediction/speed_model.lever_step_seconds), said where given.
    """
    seconds = seconds or {}

    def cost(lever: str) -> str:
        if lever not in seconds:
            return ""
        if not seconds[lever] and lever == "embedding_on_host":
            return "; no time on a CPU (the step reads the rows where they are)"
        value = seconds[lever]
        return f"; +{value:.2f} s per step" if value >= 0.01 else f"; +{value * 1e3:.3g} ms per step"

    lines = []
    if changes.get("embedding_on_host") and est.host_breakdown.get("embedding"):
        lines.append(f"embedding on host: the frozen input embedding ({est.host_breakdown['embedding'] / 2**30:.2f} GiB)"
                     " stays in host memory; each forward sends the token ids to the host and their rows back"
                     + cost("embedding_on_host"))
    if changes.get("quantize_head") and changes.get("quantize") == "4bit":
        lines.append("NF4 output head: the frozen head's weights rounded to 4 bits like the linears, dequantized a tile"
                     " of rows at a time in each loss chunk's forward, recompute and backward; no fused linear"
                     " cross-entropy" + cost("quantize_head"))
    group = changes.get("expert_dequant_group")
    if group and changes.get("quantize") == "4bit":
        experts = _experts_of(hf_config)
        lines.append(f"expert dequantization {group} of {experts} experts at a time: {-(-experts // group)} grouped"
                     " matmuls per projection instead of one, and the expert offsets read on the host each call"
                     + cost("expert_dequant_group"))
    return lines
