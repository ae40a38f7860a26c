"""What the chunked loss's backward holds beside the head's gradient, by the path that makes it
(techniques/chunked_head_loss.py)."""

from __future__ import annotations

from typing import Any

# Engines that keep the checkpointed chunks: their hooks gather the head's weight and reduce its gradient.
CHECKPOINTED_CHUNK_SHARDINGS = ("fsdp", "zero1", "zero2", "zero3")


def in_place_head_runs(run: Any, sharding: str = "none") -> bool:
    """Whether the run accumulates a trained head's gradient in place across loss chunks."""
    return not run.lora_r and run.quantize == "none" and sharding not in CHECKPOINTED_CHUNK_SHARDINGS


def chunked_loss_head_bytes(run: Any, head_grad: float, chunk_logits: float, tokens: int, sharding: str = "none") -> float:
    """Bytes live beside the head's gradient (`head_grad`) while the chunked loss's backward makes it: 0 unchunked.

    In place: one chunk's logits and their gradients (`chunk_logits`, the forward's chunk term) beside the one
    head-sized buffer. The checkpointed chunks: autograd adds each chunk's head gradient to the sum so far out of
    place, so the sum, the chunk's and the new sum are live at once: two head-sized tensors more (tracked).
    """
    if run.fused_loss or not 0 < run.loss_chunk_size < tokens or not head_grad:
        return 0.0
    return float(chunk_logits) if in_place_head_runs(run, sharding) else 2.0 * head_grad
