"""What an encoder's padded micro-batch adds to the estimate: its attention masks.

An encoder task's rows (sequences of a table, masked-LM samples) differ in length; each micro-batch is padded to
its longest row (`memfit.data.collate`) and carries a [b, s] int64 attention mask (a micro-batch without padding
drops it: `memfit.data.prefetch`). From that mask transformers builds a 4-D one as the attention implementation
wants it, once a forward (`transformers.masking_utils`):

- **SDPA**: a boolean [b, 1, s, s] mask. PyTorch's SDPA turns a boolean mask into an additive one of the query's
  dtype before it picks a kernel, and the kernel saves that copy for backward: b x s x s elements in every layer
  that runs with a mask (tracked on CPU: 128 KiB a layer at b = 2, s = 128, fp32; on CUDA the memory-efficient
  kernel, the only one that takes a mask, takes and saves its bias the same way: not measured on a GPU yet). The boolean mask itself lives through the
  forward; under checkpointing every checkpointed block keeps it as an input until backward is past it.
- **eager**: an additive [b, 1, s, s] mask in the embeddings' dtype, added to the scores out of place and never
  saved: gone with the forward's locals, kept only as the checkpointed blocks' input under checkpointing.
- **flash-attention** unpads the rows into one varlen batch (no mask, fewer tokens) and **FlexAttention** builds a
  block mask of (s / 128)^2 entries: the 2-D mask alone (neither measured: CPU runs SDPA).

Layers that build a mask without padding already keep it in what the layer probe measured: ModernBERT's local
layers, whose sliding window is shorter than the sequence, and the global layers the probe takes for local ones
(`probed_mask_layers`). Padding adds a mask to the others (ModernBERT's first layer; every layer of BERT and ESM);
to a step traced unpadded, to every layer that builds none unpadded (ModernBERT's global layers).

The estimate cannot see the data, so it takes an encoder's micro-batch of two rows or more as padded, the larger
case: a batch of rows that all fill --seq-len holds less by these bytes (2.0 % of a 3-block hidden-128 ESM at
b = 2, s = 128 under SDPA). One row is never padded. Causal LMs train on windows of --seq-len tokens and packed
samples (`memfit.techniques.packed_attention`), not on padded rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memfit.prediction.encoders import padded_micro_batches

MASK_2D_BYTES = 8
"""The collated attention mask is int64 (`memfit.data.collate`)."""


@dataclass(frozen=True)
class PaddingMask:
    """An encoder's padded micro-batch, as the estimator adds it."""

    layer_mask: float = 0.0
    """Bytes of the additive mask SDPA saves in one layer (b x s x s in the query's dtype; 0 under eager)."""
    masked_layers: int = 0
    """Layers that save it only because the batch is padded."""
    layers: int = 1
    held_layers: int = 0
    """Layers whose saved tensors are alive at the backward peak: all of them without checkpointing, else the one
    recomputed and those left uncheckpointed."""
    kept: float = 0.0
    """Bytes held beside the blocks through the step: the 2-D mask, and under checkpointing the 4-D mask the
    checkpointed blocks keep as their input."""

    def on_layer(self, layer_per_token: float | None, tokens: int) -> float | None:
        """A block's measured bytes per token (`tokens` a micro-batch) with the mask padding adds, averaged over the
        layers (None: the closed forms, whose families are never padded)."""
        if layer_per_token is None:
            return None
        return layer_per_token + self.layer_mask * self.masked_layers / max(1, self.layers) / max(1, tokens)

    def at_peak(self) -> float:
        """What the masks add at a forward or backward peak: the kept masks and those of the layers held."""
        return self.kept + self.layer_mask * min(self.masked_layers, self.held_layers)


def unpadded_mask_layers(hf_config: Any, seq_len: int) -> set[int]:
    """Layers whose attention builds a mask without padding: sliding-window layers whose window (transformers'
    `sliding_window`, half of ModernBERT's local_attention) the sequence reaches, as `masking_utils` decides."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None) or []
    if not window or seq_len < window:
        return set()
    return {index for index, kind in enumerate(layer_types) if kind == "sliding_attention"}


def probed_mask_layers(hf_config: Any, seq_len: int) -> int:
    """Layers whose unpadded mask the block bytes the layer probe measured already hold.

    The probe measures one block of each kind (its modules and parameter shapes) and counts it for every layer of
    that kind: ModernBERT's global layers after the first are built like its local ones, so the local block it
    measures, mask included, stands for them too (ModernBERT-base: 21 of 22 layers). Padded, every layer has a
    mask, and only the others' are added.
    """
    masked = unpadded_mask_layers(hf_config, seq_len)
    if not masked:
        return 0
    from memfit.prediction.layer_probe import block_kinds, probe_plan

    _, probed = probe_plan(block_kinds(hf_config))
    return sum(count for index, count in probed.items() if index in masked)


def padding_mask(hf_config: Any, run: Any, precision: Any, batch_size: int, seq_len: int,
                 probed: bool = True) -> PaddingMask:
    """The masks of a padded micro-batch of `batch_size` rows of `seq_len` tokens (nothing when it is not padded).

    `run`: the resolved run (`run_shape.RunShape`: attention, checkpointing, weight bytes: the embeddings' dtype,
    eager's mask's); `precision`: the bytes of what the step keeps (SDPA's additive mask takes the query's dtype).
    `probed`: added to the layer probe's block bytes (the analytical estimate), else to a step traced unpadded,
    which holds the unpadded masks of the layers that really build one.
    """
    attention, checkpointing = run.attention, run.checkpointing
    query_bytes, embedding_bytes = precision.attention or precision.compute, run.weight_bytes
    if not padded_micro_batches(hf_config, batch_size):
        return PaddingMask()
    tokens = batch_size * seq_len
    kept = float(MASK_2D_BYTES * tokens)
    layers = hf_config.num_hidden_layers
    newly_masked = layers - (probed_mask_layers(hf_config, seq_len) if probed
                             else len(unpadded_mask_layers(hf_config, seq_len)))
    if attention not in ("sdpa", "eager") or newly_masked <= 0:
        return PaddingMask(kept=kept)
    square = tokens * seq_len  # [b, 1, s, s]
    held = layers
    if checkpointing == "full":
        held = 1 + layers - math.ceil(layers / max(1, run.checkpoint_every))  # the recomputed and the uncheckpointed
    if checkpointing != "off":  # the checkpointed blocks' input, one tensor for all of them
        kept += square * (1 if attention == "sdpa" else embedding_bytes)
    layer_mask = float(query_bytes * square) if attention == "sdpa" else 0.0
    return PaddingMask(layer_mask, newly_masked, layers, held, kept)
