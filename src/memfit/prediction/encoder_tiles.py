"""The tiled MLP on encoder layers whose feed-forward is a method of the layer, as the estimator counts it.

BERT, RoBERTa, XLM-R, CamemBERT, ELECTRA and ESM compute their feed-forward in the layer's
`feed_forward_chunk` (memfit.techniques.tiled_mlp tiles it through `LayerFeedForward`). Tiled, the
layer stops keeping more than `activations.mlp_bytes_per_token` (the dense output and the GELU's
intermediates): the feed-forward's LayerNorm is inside the tiled function too. BERT's post-norm keeps
its input (the residual sum), ESM's pre-norm its output (the first dense's input), one hidden-wide
tensor either way, and the LayerNorm's fp32 mean and 1/std: counted on one layer of the 3-block,
hidden-128, intermediate-512 test encoders (saved-tensor hooks, CPU, fp32), BERT 5,642 and ESM 9,738
bytes a token kept by the untiled feed-forward beyond its input, none tiled; of which 1,026 are the
two dense weights and the LayerNorm's, counted with the parameters. Under LoRA (rank 8, every linear
adapted) 64 more a token: the two adapters' rank-wide outputs.
ModernBERT's `mlp` module is tiled as a decoder's: its norm stays outside.
"""

from __future__ import annotations

from typing import Any

FEED_FORWARD_METHOD_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "electra", "esm"})
"""Encoder model types whose layers compute the feed-forward in `feed_forward_chunk`, LayerNorm included."""

NORM_STATISTICS_BYTES = 8
"""The LayerNorm's fp32 mean and 1/std, a token."""


def tiled_layer_per_token(per_token: float | None, arch: Any, precision: Any, tiles: int) -> float | None:
    """A probed layer's bytes per token, less what the tiled feed-forward's LayerNorm no longer keeps, and
    under LoRA the rank-wide outputs of the two dense layers' fp32 adapters (A's, which B keeps).

    `per_token` None (a closed-form family) or untiled runs pass through; `activations.activation_bytes`
    takes the MLP's own share (`mlp_bytes_per_token`) off afterwards.
    """
    if per_token is None or tiles <= 1 or arch.model_type not in FEED_FORWARD_METHOD_TYPES:
        return per_token
    adapters = 2 * 4 * precision.lora_rank
    return per_token - (precision.compute * arch.hidden + NORM_STATISTICS_BYTES + adapters)
