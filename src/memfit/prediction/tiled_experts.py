"""The estimate of tiled experts (techniques/tiled_experts.py): MoE blocks under `--tiled-mlp N`.

What a block keeps is measured by the layer probe twice, with the experts call as it is and tiled (the
technique applied to the probe's model): the difference is what one MoE layer's experts call keeps per token
(the routed rows' projections, activation chain and permutation buffers), which tiling takes out of what the
block keeps. Dense MLP layers beside the MoE ones (DeepSeek-V3's and GLM-4-MoE's first layers, Jamba's) are
tiled as in a dense model: their MLP's closed-form share comes out too.

In backward a tiled MoE block holds, beyond what it saved: the hidden states' gradient, whole (tokens x hidden
in the stream's dtype), the routing weights' gradient (tokens x top-k), and one tile's recompute with its
gradients. The last was counted with a live-storage dispatch mode around one experts call's backward (torch
2.13, CPU; gpt-oss and Qwen3-MoE blocks of hidden 64, 8 experts of width 256, top-2, 1,024 and 4,096 tokens,
4 to 16 tiles; fp32 frozen, bf16 with split LoRA r16, fp32 under bf16 autocast): 1.3 to 2.1 times the tile's
share of what the experts call keeps; 2.1 is counted. In a full fine-tune the tile's parameter gradients are
a temporary beside their running sum: one MoE layer's expert weights in the gradients' dtype.

Shared experts (DeepSeek-V3's, GLM-4-MoE's, Qwen2-MoE's gated one) are tiled with the routed ones, so the
probe's difference holds their gated MLP's share too. Their backward runs before the routed experts' and
apart from it, as a dense tiled MLP of the shared width (`tiled_mlp_backward_bytes`); the routed backward
then holds the shared expert's input gradient, waiting to be summed with its own, beside its working set.
The larger of the two is counted (summing both tiles' working sets put the estimate 10 % over the tracker
for a DeepSeek-V3 block with four shared experts of width 64).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

from memfit.models.experts import moe_shape
from memfit.prediction.activations import (
    ActivationTerms,
    Architecture,
    Precision,
    mlp_bytes_per_token,
    tiled_mlp_backward_bytes,
)

TILE_BACKWARD_FACTOR = 2.1
"""A recomputed tile's working set in backward, in units of its share of what the experts call keeps (measured)."""


class TiledMoe(NamedTuple):
    """The activation terms of a mixture of experts whose experts (and dense MLPs) run over token tiles."""

    layer_per_token: float
    """Bytes a block keeps per token, the average over the model's layers, with the tiling applied."""
    experts_per_token: float
    """What one MoE layer's experts call keeps per token untiled (what tiling takes out)."""
    backward_bytes: float
    """What one tiled block's backward holds beyond what it saved: the larger of an MoE and a dense layer's."""

    def with_backward(self, terms: ActivationTerms) -> ActivationTerms:
        """`terms` with the tiled block's backward working set added to the moment a block is recomputed."""
        return terms._replace(recompute=terms.recompute + self.backward_bytes)


def tiled_moe_terms(run: Any, arch: Architecture, hf_config: Any, precision: Precision, tokens: int,
                    expert_params: int, trainable_bytes: int,
                    probed_per_token: Callable[[bool], float | None]) -> TiledMoe | None:
    """The tiled MoE terms for `tokens` tokens of a micro-batch, or None (a dense model, or no tiling).

    Args:
        run: the resolved run (its `mlp_tiles` and `lora_r`).
        expert_params: weights of every fused expert stack of the model (ParameterInventory.expert_params).
        trainable_bytes: bytes per element of a trainable parameter's gradient.
        probed_per_token: the layer probe's bytes per token of a block, with the experts tiled (True) or not.
    """
    shape = moe_shape(hf_config)
    if shape is None or not shape.moe_layers or run.mlp_tiles <= 1:
        return None
    untiled, tiled = probed_per_token(False), probed_per_token(True)
    if untiled is None or tiled is None:
        return None
    dense_layers = max(0, arch.layers - shape.moe_layers)
    experts = max(0.0, untiled - tiled) * arch.layers / shape.moe_layers
    dense_mlp = mlp_bytes_per_token(arch, precision)
    per_token = tiled - dense_mlp * dense_layers / arch.layers
    tile = tokens / run.mlp_tiles
    shared_arch = replace(arch, intermediate=shape.shared_width)
    shared = min(experts, mlp_bytes_per_token(shared_arch, precision)) if shape.shared_width else 0.0
    hidden_grad = precision.residual * arch.hidden * tokens  # an experts call's input gradient, filled tile by tile
    backward = (TILE_BACKWARD_FACTOR * (experts - shared) * tile + hidden_grad
                + (hidden_grad if shared else 0.0)  # the shared expert's input gradient, not yet summed
                + 4 * shape.top_k * tokens)  # the routing weights' gradient
    shared_backward = tiled_mlp_backward_bytes(shared_arch, precision, tokens, run.mlp_tiles) if shared else 0.0
    if not run.lora_r:  # a full fine-tune: one tile's expert gradients beside their sum
        backward += trainable_bytes * expert_params / shape.moe_layers
        shared_backward += trainable_bytes * 3 * arch.hidden * shape.shared_width
    dense = tiled_mlp_backward_bytes(arch, precision, tokens, run.mlp_tiles) if dense_layers else 0.0
    return TiledMoe(per_token, experts, max(backward, shared_backward, dense))
