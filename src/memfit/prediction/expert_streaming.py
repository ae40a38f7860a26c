"""Estimate and plan terms of `--expert-offload` (techniques/expert_streaming.py): frozen experts streamed per layer.

Weights: the routed experts' frozen bytes (bf16 stacks, or NF4's packed bytes; its statistics stay) leave the
device's parameter term for host memory; the device keeps one layer's worth while it runs, and on CUDA a second,
the next layer's copy prefetched on a side stream (on a CPU the copies are made one at a time: one layer).
Time: the streamed bytes cross the host link twice a micro-batch (forward and the recompute), three times under
tiled experts (they hold a layer for all their tiles, and their backward brings it once more); the copies run
beside the layers' compute, so only what the forward and recompute passes cannot hide is added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memfit.config import TrainConfig
from memfit.prediction.run_shape import resolve_mlp_tiles

HIDING_SHARE = 0.5
"""Share of a step's compute the copies can overlap: forward and recompute (backward reads no new layer first)."""


def streamed_expert_bytes(inventory: Any, hf_config: Any, lora_r: int, quantize: str,
                          weight_bytes: int) -> tuple[int, int]:
    """(bytes kept in host memory, the largest layer's) of the fused experts; (0, 0) for a dense model."""
    from memfit.models.experts import moe_shape

    shape = moe_shape(hf_config)
    if not inventory.expert_params or shape is None or not lora_r:
        return 0, 0
    # NF4: the packed weights stream (half a byte each); the absmax statistics stay on the device
    total = inventory.expert_params // 2 if quantize == "4bit" else inventory.expert_params * weight_bytes
    return int(total), int(total // max(1, shape.moe_layers))


def with_streamed_experts(parts: dict[str, Any], config: TrainConfig, inventory: Any, hf_config: Any, lora_r: int,
                          quantize: str, weight_bytes: int, device_type: str) -> dict[str, Any]:
    """The state parts with the streamed experts in host memory; `parts["experts_host_bytes"]` (0 when off)."""
    parts = dict(parts)
    parts["experts_host_bytes"] = 0
    if not config.memory.expert_offload:
        return parts
    total, per_layer = streamed_expert_bytes(inventory, hf_config, lora_r, quantize, weight_bytes)
    on_device = min(total, (2 if device_type == "cuda" else 1) * per_layer)  # running (+ prefetched on CUDA)
    parts["parameters"] -= total - on_device
    parts["experts_host_bytes"] = total
    parts["experts_streamed_layer_bytes"] = per_layer
    parts["experts_streamed_device_bytes"] = on_device  # in flight during a step, not while loading
    # a layer crosses the link in forward and in the checkpointed recompute; tiled experts hold it for all their
    # tiles (techniques/tiled_experts.py), and their own backward brings it once more
    tiles = resolve_mlp_tiles(config.memory.tiled_mlp, config.data.seq_len) if config.data.seq_len else 0
    parts["experts_stream_calls"] = 3 if tiles > 1 else 2
    return parts


def streaming_host_and_notes(parts: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """Host breakdown and detail entries of a streamed run (both empty when off)."""
    total = int(parts.get("experts_host_bytes", 0))
    if not total:
        return {}, {}
    return {"experts": total}, {"expert_stream_bytes_per_micro_batch": parts["experts_stream_calls"] * total,
                                "expert_stream_copies": parts["experts_stream_calls"],
                                "expert_stream_layer_bytes": int(parts["experts_streamed_layer_bytes"])}


def stream_seconds(est: Any, link_bytes_per_second: float, compute_seconds: float, accumulation: int) -> float:
    """Seconds the expert copies add to a step: link time beyond what the forward and recompute hide."""
    moved = accumulation * est.details.get("expert_stream_bytes_per_micro_batch", 0)
    return max(0.0, moved / link_bytes_per_second - HIDING_SHARE * compute_seconds)


def streaming_changes(mode: str, config: TrainConfig, hf_config: Any, user_set: Callable[[Any, str], bool]
                      ) -> dict[str, Any]:
    """The plan's expert-offload lever: LoRA/QLoRA on a mixture of experts, unless the user chose.

    `user_set(config, name)`: whether the user gave `name` (candidates.user_set, passed in: candidates imports this).
    """
    from memfit.models.experts import moe_shape

    if mode == "full" or hf_config is None or moe_shape(hf_config) is None or user_set(config, "expert_offload"):
        return {}
    if user_set(config, "compile") and config.memory.compile:
        return {}  # compiled blocks would capture the swapped weights: the user's --compile wins
    return {"expert_offload": True, "compile": False}


def prefer_resident(fitting: list) -> list:
    """Streaming is planned only where nothing fits with the experts on the device."""
    resident = [c for c in fitting if not c.changes.get("expert_offload")]
    return resident or fitting


def streaming_trades(changes: dict[str, Any], est: Any, link_bytes_per_second: float) -> list[str]:
    """What expert offload costs, in words (memfit.prediction.trade_offs lists it)."""
    if not changes.get("expert_offload") or not est.host_breakdown.get("experts"):
        return []
    moved = est.details.get("expert_stream_bytes_per_micro_batch", 0)
    return [f"expert offload: the frozen experts ({est.host_breakdown['experts'] / 2**30:.1f} GiB) stay in pinned host"
            f" memory and come to the device a layer at a time ({est.details['expert_stream_layer_bytes'] / 2**20:.0f}"
            f" MiB each); {moved / 2**30:.1f} GiB over the host link per micro-batch (forward, recompute"
            f"{' and the tiled backward' if est.details.get('expert_stream_copies', 2) == 3 else ''},"
            f" {moved / link_bytes_per_second:.2f} s at {link_bytes_per_second / 1e9:.0f} GB/s), hidden under compute"
            " where the next layer's copy finishes first"]
